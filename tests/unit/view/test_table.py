"""The per-layer table (hookprof/view/table.py): its figures checked against hand computations,
from a Snapshot and from /metrics text; str(snapshot), Profiler.report() and the summary
said at detach and at interpreter exit."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
from types import MappingProxyType

import pytest
import torch

import hookprof
from hookprof import _testing
from hookprof import metrics_names as names
from hookprof.demo import DemoNet, InjectNonFinite
from hookprof.serve.exporter import SnapshotCollector, make_registry, render
from hookprof.snapshot import LayerStatisticValues, LayerStats, NonFiniteEvent, Snapshot
from hookprof.view.table import (
    choose,
    filter_rows,
    from_metrics,
    from_snapshot,
    quantile,
    sort_rows,
    with_rates,
)
from hookprof.view.table import (
    render as render_table,
)
from support.metrics import scrape
from support.models import train

INF = math.inf
# the every_step fixture here also turns the system metrics off
pytestmark = pytest.mark.every_step(system_metrics=False)


def hand_snapshot(rank: int = 0) -> Snapshot:
    """30 steps taking 0.3 s in all (10 ms each on average), 3 of them sampled."""
    layers = {
        "enc": LayerStats(
            name="enc",
            module="Linear",
            forward_seconds_total=0.006,
            forward_calls_total=3,
            backward_seconds_total=0.009,
            backward_calls_total=3,
            grad_norm=0.5,
            activation_abs_max=2.0,
            activation_zero_ratio=0.25,
        ),
        "act": LayerStats(
            name="act",
            module="ReLU",
            forward_seconds_total=0.003,
            forward_calls_total=3,
            backward_seconds_total=0.003,
            backward_calls_total=3,
            activation_abs_max=1.5,
            activation_zero_ratio=0.5,
        ),
        "dec": LayerStats(
            name="dec",
            module="Linear",
            grad_norm=0.1,
            nonfinite=MappingProxyType({"forward": 0, "backward": 2}),
        ),
    }
    return Snapshot(
        rank=rank,
        step=30,
        sampled_steps=3,
        last_sampled_step=30,
        step_duration_buckets=((0.005, 10), (0.01, 20), (0.025, 30), (INF, 30)),
        step_duration_sum=0.3,
        loss=1.25,
        grad_norm=0.75,
        nonfinite_steps=MappingProxyType({"forward": 0, "backward": 2, "loss": 0}),
        layers=MappingProxyType(layers),
        exported_layers=("enc", "act", "dec"),
        first_nonfinite=NonFiniteEvent("dec", "backward", 12),
        # what the exporter renders them from (hookprof's built-in statistics, as a real
        # snapshot carries them beside the layers' fields)
        layer_statistics=MappingProxyType(
            {
                stat: LayerStatisticValues(
                    "help", {name: getattr(layers[name], stat) for name in ("enc", "act")}
                )
                for stat in ("activation_abs_max", "activation_zero_ratio")
            }
        ),
    )


def row_of(table, name):
    (row,) = [r for r in table.rows if r.layer == name]
    return row


def test_rows_from_a_snapshot_match_hand_arithmetic():
    table = from_snapshot(hand_snapshot())
    enc, act, dec = (row_of(table, n) for n in ("enc", "act", "dec"))
    # 6 ms over 3 calls, 9 ms over 3 calls; (15 ms / 3 sampled steps) / 10 ms mean step
    assert enc.forward_ms == pytest.approx(2.0) and enc.backward_ms == pytest.approx(3.0)
    assert enc.share == pytest.approx(0.5)
    assert act.share == pytest.approx(0.2)  # (6 ms / 3) / 10 ms
    assert (enc.grad_norm, enc.abs_max, enc.dead_ratio) == (0.5, 2.0, 0.25)
    assert act.grad_norm is None
    # never timed: no figure rather than a 0 that looks measured
    assert (dec.forward_ms, dec.backward_ms, dec.share) == (None, None, None)
    assert dec.first and dec.nonfinite == {"backward": 2}
    assert not enc.first and enc.nonfinite == {}
    h = table.header
    # histogram_quantile by hand: rank 15 lies in (5 ms, 10 ms] holding 10..20
    assert h.step_quantile(0.5) == pytest.approx(0.005 + 0.005 * 5 / 10)
    assert h.step_quantile(0.95) == pytest.approx(0.01 + 0.015 * 8.5 / 10)
    assert (h.steps, h.sampled_steps, h.loss, h.grad_norm) == (30, 3, 1.25, 0.75)


def test_shares_never_add_past_the_whole_when_sampled_steps_ran_long():
    # one sampled step (a first step's warm-up) whose layers took 30 ms, steps 10 ms on average
    snap = hand_snapshot()
    slow = {
        n: LayerStats(
            name=n,
            module="Linear",
            forward_seconds_total=0.015,
            forward_calls_total=1,
            backward_seconds_total=0.0,
            backward_calls_total=0,
        )
        for n in ("a", "b")
    }
    snap = Snapshot(
        step=30,
        sampled_steps=1,
        step_duration_sum=0.3,
        step_duration_buckets=snap.step_duration_buckets,
        layers=MappingProxyType(slow),
    )
    shares = [r.share for r in from_snapshot(snap).rows]
    assert shares == [pytest.approx(0.5), pytest.approx(0.5)]  # of the layers' 30 ms, not 300%


def test_quantile_edges_follow_prometheus():
    assert quantile(0.5, ()) is None
    assert quantile(0.5, ((1.0, 0), (INF, 0))) is None
    # the lowest bucket starts at 0
    assert quantile(0.5, ((1.0, 4), (INF, 4))) == pytest.approx(0.5)
    # a rank in the +Inf bucket: the largest finite bound
    assert quantile(0.99, ((1.0, 1), (2.0, 2), (INF, 10))) == 2.0


PAGE = textwrap.dedent("""\
    # TYPE hookprof_steps_total counter
    hookprof_steps_total{model="M",rank="0"} 100
    hookprof_steps_total{model="M",rank="1"} 100
    # TYPE hookprof_sampled_steps_total counter
    hookprof_sampled_steps_total{model="M",rank="0"} 4
    hookprof_sampled_steps_total{model="M",rank="1"} 4
    # TYPE hookprof_step_duration_seconds histogram
    hookprof_step_duration_seconds_bucket{le="0.01",model="M",rank="0"} 50
    hookprof_step_duration_seconds_bucket{le="0.1",model="M",rank="0"} 100
    hookprof_step_duration_seconds_bucket{le="+Inf",model="M",rank="0"} 100
    hookprof_step_duration_seconds_sum{model="M",rank="0"} 2.0
    hookprof_step_duration_seconds_count{model="M",rank="0"} 100
    hookprof_step_duration_seconds_bucket{le="0.01",model="M",rank="1"} 0
    hookprof_step_duration_seconds_bucket{le="0.1",model="M",rank="1"} 100
    hookprof_step_duration_seconds_bucket{le="+Inf",model="M",rank="1"} 100
    hookprof_step_duration_seconds_sum{model="M",rank="1"} 4.0
    hookprof_step_duration_seconds_count{model="M",rank="1"} 100
    # TYPE hookprof_loss gauge
    hookprof_loss{model="M",rank="0"} 0.5
    # TYPE hookprof_gradient_norm gauge
    hookprof_gradient_norm{model="M",rank="0"} 3.0
    # TYPE hookprof_nonfinite_steps_total counter
    hookprof_nonfinite_steps_total{model="M",phase="forward",rank="1"} 1
    hookprof_nonfinite_steps_total{model="M",phase="backward",rank="1"} 1
    hookprof_nonfinite_steps_total{model="M",phase="loss",rank="1"} 0
    # TYPE hookprof_first_nonfinite_info gauge
    hookprof_first_nonfinite_info{layer="fc",model="M",phase="forward",rank="1",step="77"} 1
    # TYPE hookprof_layer_forward_seconds summary
    hookprof_layer_forward_seconds_sum{layer="fc",model="M",module="Linear",rank="0"} 0.008
    hookprof_layer_forward_seconds_count{layer="fc",model="M",module="Linear",rank="0"} 4
    hookprof_layer_forward_seconds_sum{layer="fc",model="M",module="Linear",rank="1"} 0.04
    hookprof_layer_forward_seconds_count{layer="fc",model="M",module="Linear",rank="1"} 4
    # TYPE hookprof_layer_backward_seconds summary
    hookprof_layer_backward_seconds_sum{layer="fc",model="M",module="Linear",rank="0"} 0.012
    hookprof_layer_backward_seconds_count{layer="fc",model="M",module="Linear",rank="0"} 4
    # TYPE hookprof_layer_gradient_norm gauge
    hookprof_layer_gradient_norm{layer="fc",model="M",rank="0"} 2.5
    # TYPE hookprof_layer_activation_abs_max gauge
    hookprof_layer_activation_abs_max{layer="fc",model="M",rank="1"} NaN
    # TYPE hookprof_layer_activation_zero_ratio gauge
    hookprof_layer_activation_zero_ratio{layer="fc",model="M",rank="0"} 0.125
    # TYPE hookprof_layer_nonfinite_total counter
    hookprof_layer_nonfinite_total{layer="fc",model="M",phase="forward",rank="1"} 1
    # TYPE hookprof_build_info gauge
    hookprof_build_info{torch_version="2",version="0"} 1
    """)


def test_rows_from_metric_text_match_hand_arithmetic():
    r0, r1 = from_metrics(PAGE)
    assert (r0.header.rank, r0.header.model, r1.header.rank) == (0, "M", 1)
    fc0, fc1 = r0.rows[0], r1.rows[0]
    assert fc0.forward_ms == pytest.approx(2.0) and fc0.backward_ms == pytest.approx(3.0)
    # (8 + 12 ms) / 4 sampled steps over a 20 ms mean step
    assert fc0.share == pytest.approx(0.25)
    assert (fc0.grad_norm, fc0.dead_ratio, fc0.module) == (2.5, 0.125, "Linear")
    assert fc1.forward_ms == pytest.approx(10.0) and fc1.backward_ms is None
    assert fc1.share == pytest.approx(0.25)  # (40 ms / 4) / 40 ms
    assert math.isnan(fc1.abs_max) and fc1.first and fc1.nonfinite == {"forward": 1}
    assert r1.header.first_nonfinite.layer == "fc" and r1.header.first_nonfinite.step == 77
    assert r1.header.nonfinite_steps == {"forward": 1, "backward": 1, "loss": 0}
    assert (r0.header.loss, r0.header.grad_norm, r1.header.loss) == (0.5, 3.0, None)
    # half the steps at or under 10 ms, all under 100 ms
    assert r0.header.step_quantile(0.5) == pytest.approx(0.01)
    assert r1.header.step_quantile(0.5) == pytest.approx(0.01 + 0.09 * 0.5)


def test_a_page_with_two_models_gets_a_model_column():
    # rank 1's series relabelled as a second model of rank 0 (one process, two models)
    page = "\n".join(
        line.replace('model="M"', 'model="M-2"').replace('rank="1"', 'rank="0"')
        if 'rank="1"' in line
        else line
        for line in PAGE.splitlines()
    )
    tables = from_metrics(page)
    assert [(t.header.model, t.header.rank) for t in tables] == [("M", 0), ("M-2", 0)]
    lines = render_table(tables, by="layer").splitlines()
    assert lines[4].split()[:3] == ["rank", "model", "layer"]
    assert [line.split()[:3] for line in lines[5:]] == [["0", "M", "fc"], ["0", "M-2", "fc"]]


def test_per_process_series_with_a_rank_make_no_table_of_their_own():
    """A GPU process's page also holds the CUDA allocator gauges, labelled rank and device
    but no model (served once per process): the first GPU run's `top` read them as a second,
    empty table named "" (test_stalls failed there)."""
    cuda_lines = "\n".join(
        f'{metric.name}{{device="0",rank="0"}} 1.2e+09'
        for metric in (names.CUDA_MEMORY_ALLOCATED_BYTES, names.CUDA_MEMORY_RESERVED_BYTES)
    )
    tables = from_metrics(PAGE + cuda_lines + "\n")
    assert [(t.header.model, t.header.rank) for t in tables] == [("M", 0), ("M", 1)]


def test_steps_per_second_and_recent_quantiles_from_two_looks():
    (before,) = from_metrics(
        PAGE.replace('rank="1"', 'rank="9"')
        .replace(
            'hookprof_steps_total{model="M",rank="0"} 100',
            'hookprof_steps_total{model="M",rank="0"} 60',
        )
        .replace('{le="0.1",model="M",rank="0"} 100', '{le="0.1",model="M",rank="0"} 60')
        .replace('{le="+Inf",model="M",rank="0"} 100', '{le="+Inf",model="M",rank="0"} 60')
    )[:1]
    now = from_metrics(PAGE)[0]
    h = with_rates(now, before, 2.0).header
    assert h.steps_per_s == pytest.approx(20.0)  # 40 steps in 2 s
    # the 40 steps in between all fell in (10 ms, 100 ms]: their median is its middle
    assert h.step_quantile(0.5) == pytest.approx(0.01 + 0.09 * 0.5)
    assert with_rates(now, None, 0.0).header.steps_per_s is None


def test_page_and_snapshot_give_the_same_rows():
    snap = hand_snapshot(rank=3)
    page = render(
        make_registry(
            SnapshotCollector(lambda: snap, "2", rank=3, model="Net"), process_metrics=False
        )
    ).decode()
    (from_page,) = from_metrics(page)
    direct = from_snapshot(snap, model="Net")
    assert from_page.header.first_nonfinite == direct.header.first_nonfinite
    assert from_page.header.steps == 30 and from_page.header.rank == 3
    for name in ("enc", "act", "dec"):
        a, b = row_of(from_page, name), row_of(direct, name)
        if name == "dec":  # never timed: the page has no series that names its module
            b = b.__class__(**{**{f: getattr(b, f) for f in b.__slots__}, "module": ""})
        assert a == b


def test_sorting_filtering_and_choosing():
    rows = from_snapshot(hand_snapshot()).rows
    assert [r.layer for r in sort_rows(rows, "share")] == ["enc", "act", "dec"]  # untimed last
    assert [r.layer for r in sort_rows(rows, "share", reverse=True)] == ["act", "enc", "dec"]
    assert [r.layer for r in sort_rows(rows, "layer")] == ["act", "dec", "enc"]
    assert [r.layer for r in sort_rows(rows, "nan")][0] == "dec"
    assert [r.layer for r in filter_rows(rows, "EN")] == ["enc"]
    assert [r.layer for r in filter_rows(rows, "relu")] == ["act"]  # module types match too
    shown, left_out = choose(sort_rows(rows, "share"), 1)
    # a table cut short still shows the offender
    assert [r.layer for r in shown] == ["enc", "dec"] and left_out == 1


def test_str_of_a_snapshot_is_the_readable_table_and_repr_is_short():
    text = str(hand_snapshot())
    as_of, *lines = text.splitlines()
    assert as_of.startswith(
        "hookprof snapshot of a model, rank 0, as of step 30 ("
    )  # no name given
    assert lines[0].startswith("rank 0  step 30 (3 sampled)")
    assert "step time p50 7.5 ms p95 22.8 ms" in lines[0] and "loss 1.25" in lines[0]
    assert lines[1].strip() == (
        "non-finite steps: forward 0, backward 2, loss 0; first: dec (backward) at step 12"
    )
    assert lines[2].split() == [
        "layer",
        "module",
        "fwd",
        "ms/call",
        "bwd",
        "ms/call",
        "share",
        "grad",
        "norm",
        "|act|",
        "max",
        "dead",
        "NaN",
    ]
    cells = {line.split()[0]: line.split() for line in lines[3:]}
    assert cells["enc"] == ["enc", "Linear", "2.000", "3.000", "50.0%", "0.5", "2", "25%"]
    assert cells["act"] == ["act", "ReLU", "1.000", "1.000", "20.0%", "-", "1.5", "50%"]
    assert cells["dec"] == ["dec", "Linear", "-", "-", "-", "0.1", "-", "-", "first", "B2"]
    assert [line.split()[0] for line in lines[3:]] == ["enc", "act", "dec"]
    r = repr(hand_snapshot())
    assert len(r) < 200 and r.startswith("<hookprof.Snapshot rank=0 step=30 sampled=3 layers=3")


def test_render_cuts_long_tables_and_says_so():
    many = {
        f"l{i}": LayerStats(
            name=f"l{i}",
            module="Linear",
            forward_seconds_total=0.001 * (i + 1),
            forward_calls_total=1,
        )
        for i in range(40)
    }
    snap = Snapshot(step=10, sampled_steps=1, step_duration_sum=1.0, layers=MappingProxyType(many))
    lines = render_table([from_snapshot(snap)], limit=5).splitlines()
    assert [line.split()[0] for line in lines[3:8]] == ["l39", "l38", "l37", "l36", "l35"]
    assert lines[-1] == "... 35 more layers not shown"


def test_a_real_run_reads_the_same_from_its_page_and_its_snapshot(every_step):
    torch.manual_seed(0)
    model = DemoNet()
    prof = hookprof.attach(model, summary_at_exit=False, **every_step)
    try:
        train(model, 12, prof=prof, explicit_step=True)
        assert prof.flush()
        (page,) = from_metrics(scrape(prof.url))
        direct = from_snapshot(prof.snapshot(), model=prof.name)
        modules = dict(model.named_modules())
        assert page.header.steps == direct.header.steps == 12
        for row in direct.rows:
            other = row_of(page, row.layer)
            assert (
                other.forward_ms,
                other.backward_ms,
                other.share,
                other.grad_norm,
                other.abs_max,
            ) == (row.forward_ms, row.backward_ms, row.share, row.grad_norm, row.abs_max), row.layer
            # the gradient norm is the layer's own parameters' (every step sampled: the last one's)
            grads = [p.grad.flatten() for p in modules[row.layer].parameters(recurse=False)]
            if grads:
                expected = torch.linalg.vector_norm(torch.cat(grads)).item()
                assert row.grad_norm == pytest.approx(expected, rel=1e-5), row.layer
        timed = [r for r in direct.rows if r.share is not None]
        assert {"attn", "mlp.0", "head"} <= {r.layer for r in timed}
        assert 0 < sum(r.share for r in timed) <= 1.0 + 1e-9
        report = prof.report()
        assert report.splitlines()[0].startswith(f"rank 0  model {prof.name}  step 12 (12 sampled)")
        assert {line.split()[0] for line in report.splitlines()[3:]} == set(prof.snapshot().layers)
    finally:
        prof.detach()


def test_detach_logs_a_summary_naming_the_first_offender(every_step, caplog):
    torch.manual_seed(0)
    model = DemoNet()
    InjectNonFinite(model.mlp[0], {5}, count_calls=True)
    prof = hookprof.attach(model, **every_step)
    train(model, 8, prof=prof, explicit_step=True)
    with caplog.at_level(logging.INFO, logger="hookprof"):
        prof.detach()
    (text,) = [r.getMessage() for r in caplog.records if "hookprof summary" in r.getMessage()]
    lines = text.splitlines()
    assert lines[0].startswith(
        f"hookprof summary ({prof.name}, rank 0): 8 steps, 8 sampled; step time p50 "
    )
    assert "first: mlp.0 (forward) at step 5" in lines[1]
    top = lines[2].split(": ", 1)[1].split(", ")
    assert len(top) == 5
    # the five named are the five largest shares, in order
    expected = sorted(
        ((r.share, r.layer) for r in from_snapshot(prof.snapshot()).rows if r.share is not None),
        reverse=True,
    )[:5]
    assert [t.split()[0] for t in top] == [name for _, name in expected]


def test_summary_opt_out_and_nothing_left_watched(every_step, caplog):
    model = DemoNet()
    prof = hookprof.attach(model, summary_at_exit=False, **every_step)
    assert not _testing.summary_registered()  # nothing watched: no exit hook
    train(model, 2, prof=prof, explicit_step=True)
    with caplog.at_level(logging.INFO, logger="hookprof"):
        prof.detach()
    assert not [r for r in caplog.records if "hookprof summary" in r.getMessage()]
    prof = hookprof.attach(model, **every_step)
    assert _testing.summary_registered() and prof in _testing.summary_watched()
    prof.detach()
    # (atexit._ncallbacks() does not shrink on unregister in CPython: the flag is what tells)
    assert not _testing.summary_registered() and not _testing.summary_watched()


def test_disabled_profiler_reports_that_it_is_disabled():
    prof = hookprof.attach(DemoNet(), disable=True)
    assert "disabled" in prof.report()


EXITS_ATTACHED = """
    import torch, hookprof
    from hookprof.demo import DemoNet
    model = DemoNet()
    prof = hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        x, y = model.batch(g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["attached", "opt-out", "detached"])
def test_interpreter_exit_while_attached_says_the_summary(how):
    import os

    env = {**os.environ, "HOOKPROF_SUMMARY_AT_EXIT": "0" if how == "opt-out" else "1"}
    code = textwrap.dedent(EXITS_ATTACHED) + ("prof.detach()\n" if how == "detached" else "")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    if how == "opt-out":
        assert "hookprof summary" not in out.stderr
    elif how == "detached":  # said once, at detach; the exit hook went with it
        assert out.stderr.count("hookprof summary") == 1, out.stderr
    else:
        # logging not set up: straight to stderr, and the last steps are in (flushed at exit)
        assert "hookprof summary (DemoNet, rank 0): 6 steps, 6 sampled" in out.stderr, out.stderr
        assert "top layers by share of step time: " in out.stderr


# issue 32: print(prof.snapshot()) right after training showed a step behind without saying
# so, and its header did not name the model
def test_the_printed_snapshot_names_its_model_and_the_step_it_is_as_of():
    from hookprof.snapshot import Snapshot

    first, header = str(Snapshot(step=7, rank=2, model="Discriminator")).splitlines()[:2]
    assert first.startswith("hookprof snapshot of Discriminator, rank 2, as of step 7 (")
    assert "prof.flush()" in first
    assert header.startswith("rank 2  model Discriminator  step 7 ")


def test_a_profilers_snapshot_carries_the_models_name():
    import hookprof
    from support.models import DeepNet, seeded, train

    model = seeded(DeepNet)
    with hookprof.attach(
        model, port=0, name="student", sample_every=1, min_sample_interval_s=0.0
    ) as prof:
        train(model, 2)
        prof.flush()
        assert prof.snapshot().model == "student"
        assert "hookprof snapshot of student, rank 0, as of step 2 (" in str(prof.snapshot())
