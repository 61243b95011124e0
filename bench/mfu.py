"""hookprof's FLOP count, MFU and device phase times on a GPU, against numbers worked out apart.

    python bench/mfu.py                  # GPT-124M shape (bf16) and the MLP (fp32), on CUDA
    python bench/mfu.py --device cpu     # a smoke run on the narrow shapes (no peak: no MFU)

For each workload (bench/shapes.py) three figures are set side by side:

- FLOPs per training step: hookprof's count (`Snapshot.efficiency.flops_per_step`, counted
  per leaf layer on meta tensors) against the analytic count of the same leaf layers' matrix
  products, 2 x batch rows x in x out per Linear forward and twice that backward (the
  attention scores, inside a non-leaf module, are outside both and printed apart);
- the step time: CUDA events around the same steps without hookprof (median of several
  rounds), and hookprof's own mean step time on its sampled steps;
- MFU: hookprof's `flops_utilization` against analytic FLOPs / the bare step time / the
  datasheet peak of the card (efficiency/peaks.py) for the precision the model computes in;
- the device phase times of hookprof's sampled steps (forward, backward, optimizer ...)
  against their sum and the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paths  # noqa: E402,F401  (first: the hookprof under test)
import shapes  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import hookprof  # noqa: E402
from hookprof.efficiency import peaks  # noqa: E402

SETTINGS = dict(
    port=0, summary_at_exit=False, stall_detection=False, sample_every=4, min_sample_interval_s=0.0
)


def leaf_linear_flops(shape: shapes.Shape) -> float:
    """Forward + backward FLOPs of every leaf Linear's matrix product for one step: each row
    of the input through an in x out weight is 2*in*out forward; backward the same again for
    the weight's gradient, and again for the input's when the input needs one (not the first
    layer of a model fed data)."""
    seen: dict[nn.Module, tuple[int, bool]] = {}

    def note(m, args, out):
        x = args[0]
        seen[m] = (x.numel() // x.shape[-1], x.requires_grad)

    handles = [
        m.register_forward_hook(note) for m in shape.model.modules() if isinstance(m, nn.Linear)
    ]
    try:
        with torch.autocast(
            shape.batch[0].device.type, dtype=shape.autocast, enabled=shape.autocast is not None
        ):
            shape.loss(shape.model, shape.batch)  # the graph is dropped unused
    finally:
        for h in handles:
            h.remove()
    return sum(
        (3 if grad_in else 2) * 2 * rows * m.in_features * m.out_features
        for m, (rows, grad_in) in seen.items()
    )


def attention_flops(shape: shapes.Shape) -> float:
    """The attention products of the GPT shape (QK^T and AV, forward and backward, as
    FlopCounterMode counts scaled_dot_product_attention: not halved for causality)."""
    model = shape.model
    if not isinstance(model, shapes.GPTShape):
        return 0.0
    b, t = shape.batch[0].shape
    dim = model.wte.embedding_dim
    return len(model.h) * 3 * (2 * 2 * b * t * t * dim)


def bare_step_seconds(shape: shapes.Shape, rounds: int, steps: int) -> float:
    """Median over rounds of the mean step time, CUDA events (or the host clock on a CPU)."""
    cuda = shape.batch[0].is_cuda
    times = []
    for _ in range(rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                shape.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                shape.step()
            times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def one(name: str, device: torch.device, full: bool, rounds: int, steps: int) -> dict:
    shape = shapes.build(name, device, full=full)
    for _ in range(3):
        shape.step()
    bare_s = bare_step_seconds(shape, rounds, steps)
    analytic = leaf_linear_flops(shape)
    attention = attention_flops(shape)
    prof = hookprof.attach(shape.model, **SETTINGS)
    try:
        for _ in range(rounds * steps):
            shape.step()
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    eff = snap.efficiency
    precision = (
        "bf16"
        if shape.autocast is not None
        else ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32")
    )
    name_of_device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peaks.lookup(name_of_device, precision) if device.type == "cuda" else None
    device_phases = dict(snap.device_phase_seconds or {})
    return {
        "workload": shape.name,
        "device": name_of_device,
        "precision": precision,
        "peak_flops": peak,
        "flops_per_step_hookprof": eff.flops_per_step if eff else None,
        "flops_per_step_analytic_leaf_linears": analytic,
        "attention_flops_outside_leaves": attention,
        "bare_step_ms": bare_s * 1e3,
        "hookprof_flops_per_second": eff.flops_per_second if eff else None,
        "hookprof_mfu": eff.flops_utilization if eff else None,
        "analytic_mfu_leaf_linears": analytic / bare_s / peak if peak else None,
        "analytic_mfu_with_attention": (analytic + attention) / bare_s / peak if peak else None,
        "sampled_steps": snap.sampled_steps,
        "steps": snap.step,
        "host_phase_seconds": dict(snap.phase_seconds),
        "host_phase_steps": snap.phase_steps,
        "device_phase_seconds": device_phases,
        "device_phase_steps": snap.device_phase_steps,
        "internal_errors": snap.internal_errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default="gpt,mlp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    full = device.type == "cuda"
    print(
        f"# hookprof FLOPs, MFU and device phases: torch {torch.__version__}, "
        f"{torch.cuda.get_device_name(device) if full else 'cpu'}, {time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    results = []
    for name in args.workloads.split(","):
        r = one(name, device, full, args.rounds, args.steps)
        results.append(r)
        mine, theirs = r["flops_per_step_hookprof"], r["flops_per_step_analytic_leaf_linears"]
        print(
            f"{r['workload']}: FLOPs/step hookprof {mine:.4g} analytic {theirs:.4g} "
            f"(ratio {mine / theirs if mine and theirs else float('nan'):.4f}); attention outside "
            f"leaves {r['attention_flops_outside_leaves']:.4g}; bare step {r['bare_step_ms']:.2f} ms; "
            f"MFU hookprof {r['hookprof_mfu']} analytic {r['analytic_mfu_leaf_linears']} "
            f"(with attention {r['analytic_mfu_with_attention']}), peak {r['peak_flops']} ({r['precision']})",
            flush=True,
        )
        dev = r["device_phase_seconds"]
        if dev and r["device_phase_steps"]:
            per_step = {k: v / r["device_phase_steps"] * 1e3 for k, v in dev.items()}
            print(
                "  device phases per sampled step (ms): "
                + ", ".join(f"{k} {v:.2f}" for k, v in per_step.items())
                + f"; sum {sum(per_step.values()):.2f} vs bare step {r['bare_step_ms']:.2f}",
                flush=True,
            )
        host = r["host_phase_seconds"]
        if host and r["host_phase_steps"]:
            print(
                "  host phases per step (ms): "
                + ", ".join(f"{k} {v / r['host_phase_steps'] * 1e3:.2f}" for k, v in host.items()),
                flush=True,
            )
        torch.cuda.empty_cache() if full else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
