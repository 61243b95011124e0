"""The run report's inline CSS and script. The script only reads what the page already shows
(the charts' data-* attributes) to give hover values and a sortable table: without it,
nothing is missing but the hover. It fetches nothing."""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:20px 28px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 10px}h2{font-size:17px;margin:26px 0 6px}h3{font-size:14px;margin:14px 0 0}
.muted{color:#666;font-weight:normal}.bad{color:#d62728;font-weight:600}
.model{border-top:1px solid #ddd;margin-top:18px;padding-top:12px}
.figures{display:flex;flex-wrap:wrap;gap:10px}.figure{border:1px solid #e3e3e3;border-radius:6px;padding:6px 12px;min-width:120px}
.figure span{display:block;color:#666;font-size:12px}.figure b{font-size:16px;font-weight:600}
.bad-box{border-color:#d62728;background:#fdf0f0}.bad-box b{color:#d62728}
.incident-box{border-left:4px solid #d62728;background:#fdf6f6;padding:8px 14px;margin:6px 0}
.incident-box p{margin:2px 0 6px}.clean{color:#2a7a2a}
table.kv th{text-align:left;font-weight:normal;color:#666;padding:1px 14px 1px 0;vertical-align:top}
svg{width:100%;height:auto;display:block;overflow:visible}
svg text{font-size:12px;fill:#444}svg .axis{stroke:#888}svg .grid{stroke:#eee}
svg .axis-title{fill:#777;font-style:italic}svg .line{fill:none;stroke:#1f77b4;stroke-width:1.8}
svg .dot{fill:#1f77b4}svg .band-mean{fill:none;stroke:#1f77b4;stroke-width:1;opacity:.7}
.chart-note{margin:0 0 8px;font-size:12px}svg .cross{stroke:#333;stroke-width:1;stroke-dasharray:2 2}
svg text.incident-label,svg text.dropped-label{fill:#d62728;font-weight:600;paint-order:stroke;stroke:#fff;stroke-width:3px}
svg.heatmap rect{shape-rendering:crispEdges}
.chart-box{margin-bottom:4px}
table.layers{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
table.layers th{text-align:left;border-bottom:2px solid #ccc;padding:4px 8px;cursor:pointer;white-space:nowrap;user-select:none}
table.layers th.num,table.layers td.num{text-align:right}
table.layers td{padding:3px 8px;border-bottom:1px solid #eee;white-space:nowrap}
table.layers tr:hover td{background:#f5f9fd}
table.layers td.num{position:relative}
.share-bar{position:absolute;left:0;top:3px;bottom:3px;background:#1f77b4;opacity:.18}
tr.bad-row td:first-child,td.nan-marks{color:#d62728;font-weight:600}
th.sorted-up::after{content:" \\25B2"}th.sorted-down::after{content:" \\25BC"}
.tip{position:absolute;display:none;pointer-events:none;background:#222;color:#fff;padding:4px 8px;
border-radius:4px;font-size:12px;max-width:520px;z-index:10;white-space:normal}
"""

SCRIPT = r"""
(function(){
var tip=document.getElementById('tip');
function show(e,text){tip.textContent=text;tip.style.display='block';
var x=e.pageX+14;if(x+tip.offsetWidth>document.documentElement.clientWidth+window.scrollX-8){x=e.pageX-tip.offsetWidth-14;}
tip.style.left=x+'px';tip.style.top=(e.pageY+16)+'px';}
function hide(){tip.style.display='none';}
function fmt(v){if(v.indexOf('~')>0){var m=v.split('~');return fmt(m[0])+' mean, '+fmt(m[1])+' to '+fmt(m[2]);}if(v==='-'||v==='NaN/Inf'){return v==='-'?'no value':v;}var n=Number(v);return Math.abs(n)>=1e5||(n!==0&&Math.abs(n)<1e-3)?n.toPrecision(4):String(Number(n.toPrecision(5)));}
function step(svg,e){var p=svg.createSVGPoint();p.x=e.clientX;p.y=e.clientY;p=p.matrixTransform(svg.getScreenCTM().inverse());
var d=svg.dataset,s0=+d.s0,s1=+d.s1,x0=+d.x0,x1=+d.x1;return {x:p.x,s:s0+(p.x-x0)/(x1-x0)*(s1-s0),at:function(s){return x0+(s-s0)/(s1-s0)*(x1-x0);}};}
function steps(a,b){return a===b?'step '+a:'steps '+a+'-'+b;}
document.querySelectorAll('svg.chart').forEach(function(svg){
var line=svg.querySelector('.line'),cross=svg.querySelector('.cross');if(!line){return;}
var st=line.dataset.steps.split(' ').map(Number),first=line.dataset.first.split(' ').map(Number),vals=line.dataset.values.split(' '),unit=svg.dataset.unit;
svg.addEventListener('mousemove',function(e){var p=step(svg,e),best=-1,gap=Infinity;
for(var i=0;i<st.length;i++){var g=Math.abs(st[i]-p.s);if(g<gap){gap=g;best=i;}}
if(best<0||p.x<+svg.dataset.x0-4){hide();cross.setAttribute('display','none');return;}
var x=p.at(st[best]);cross.setAttribute('x1',x);cross.setAttribute('x2',x);cross.setAttribute('display','inline');
show(e,steps(first[best],st[best])+': '+fmt(vals[best])+(unit&&vals[best]!=='-'&&vals[best]!=='NaN/Inf'?' '+unit:''));});
svg.addEventListener('mouseleave',function(){hide();cross.setAttribute('display','none');});});
document.querySelectorAll('svg.heatmap').forEach(function(svg){var cross=svg.querySelector('.cross');
svg.addEventListener('mousemove',function(e){var r=e.target;if(!r.dataset||r.dataset.v===undefined){hide();cross.setAttribute('display','none');return;}
var p=step(svg,e),s=r.dataset.s.split('-');cross.setAttribute('x1',p.x);cross.setAttribute('x2',p.x);cross.setAttribute('display','inline');
show(e,r.parentNode.dataset.layer+', '+steps(s[0],s[1])+', near step '+Math.round(p.s)+': gradient norm '+fmt(r.dataset.v)+(s[0]!==s[1]?' (largest)':''));});
svg.addEventListener('mouseleave',function(){hide();cross.setAttribute('display','none');});});
document.addEventListener('mouseover',function(e){var t=e.target.closest&&e.target.closest('[data-tip]');if(t){show(e,t.dataset.tip);}});
document.addEventListener('mouseout',function(e){var t=e.target.closest&&e.target.closest('[data-tip]');if(t){hide();}});
document.querySelectorAll('table.layers').forEach(function(table){var ths=table.querySelectorAll('th');
ths.forEach(function(th,col){th.addEventListener('click',function(){var up=th.classList.contains('sorted-down');
ths.forEach(function(h){h.classList.remove('sorted-up','sorted-down');});th.classList.add(up?'sorted-up':'sorted-down');
var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
rows.sort(function(a,b){var x=a.cells[col],y=b.cells[col],u=x.dataset.sort,v=y.dataset.sort;
if(u===undefined&&v===undefined){return (up?-1:1)*x.textContent.localeCompare(y.textContent);}
if(u===undefined){return 1;}if(v===undefined){return -1;}return up?u-v:v-u;});
rows.forEach(function(r){body.appendChild(r);});});});});
})();
"""
