"""What each efficiency feature (issue 15) costs on one sampled step, side by side in one run.

    python bench/efficiency_cost.py            # MLP 24x512 batch 64 (bench/overhead.py's), CPU

Per sampled step, median over --repeat runs, next to a plain training step of the same model:
- update norms: the copy before the update plus the weight and update squares after it
  (UpdateNorms.before_update + after_update), at the default byte cap and at a cap of a
  quarter of the model (layers take turns);
- FLOPs, steady state: noting every layer call's signature (what LayerHooks.on_call is
  set to by StepEfficiency.listen, for each call of a step) plus the step's end (counts,
  totals, the peak);
- FLOPs, first sight of a shape: counting one layer kind on meta tensors (once per kind and
  input signature, then cached).
Off the sampled steps these features do nothing. Device-side work is synchronous on the CPU,
so these are whole costs here; on a GPU the norms' kernels run asynchronously.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hookprof.efficiency.figures import StepEfficiency  # noqa: E402
from hookprof.efficiency.flops import _Meta, count  # noqa: E402
from hookprof.layers import LayerTable  # noqa: E402
from hookprof.notices import Notices  # noqa: E402
from hookprof.efficiency.updates import UpdateNorms  # noqa: E402
from overhead import WORKLOADS  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    w = WORKLOADS[args.workload]
    torch.manual_seed(0)
    model = w.build()
    x = w.make_input(torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (w.batch,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    table = LayerTable(model)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    rows = {"training step (no hookprof)": median_ms(step, args.repeat)}
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for label, cap in (("update norms, all layers", 256 * 2**20),
                       ("update norms, cap = model/4", model_bytes // 4)):
        norms = UpdateNorms(table, cap)

        def measure():
            norms.before_update()
            norms.after_update()

        rows[label] = median_ms(measure, args.repeat)

    # a step's layer calls, as LayerHooks reports them: (layer, args, kwargs, nested)
    calls = []
    hooks = [layer.module.register_forward_pre_hook(
        lambda m, a, i=layer.index: calls.append((i, a, {}, False))) for layer in table.layers]
    model(x)
    for h in hooks:
        h.remove()
    eff = StepEfficiency(table, flops=True, update_norms=False, update_max_bytes=0, peak_flops=1e12,
                         notices=Notices())
    hooks = types.SimpleNamespace(on_call=None)  # LayerHooks' attribute, called per layer call
    eff.listen(hooks)
    for call in calls:  # first sight: counted once
        hooks.on_call(*call)
    eff.end_step(1, time.perf_counter_ns(), 0.01)

    def steady():
        for call in calls:
            hooks.on_call(*call)
        eff.end_step(2, time.perf_counter_ns(), 0.01)

    rows[f"FLOPs, steady ({len(calls)} calls noted)"] = median_ms(steady, args.repeat)
    first = table.layers[0].module
    meta = (_Meta(x),)
    rows[f"FLOPs, first sight of one {type(first).__name__} shape"] = median_ms(lambda: count(first, meta, {}), 10)

    print(f"# {w.name}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs; median of {args.repeat}; per sampled step")
    base = rows["training step (no hookprof)"]
    print(f"{'':48} {'ms':>8} {'x step':>8}")
    for label, ms in rows.items():
        print(f"{label:48} {ms:8.3f} {ms / base:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
