"""What the replica check (Config.sdc_check_interval_s, issue 43 item 4) costs: one check's
fingerprint of the parameters (hookprof/integrity/fingerprint.py) on the full-size GPT-2 124M
shape (148 parameter tensors, 124M parameters, fp32), timed on this machine's device, with
the ATen ops it issues (each a kernel launch on a GPU) counted; then amortised per step for
a step time and an interval.

    python bench/replica_check.py                 # CPU
    python bench/replica_check.py --device cuda   # on a GPU

Side by side in the same run: one training step of the same model on a batch of 1 x 128
tokens, so the check's cost reads against a step of its own size on this device.
"""

from __future__ import annotations

import argparse
import json
import time

import paths  # noqa: F401  (first: this checkout's hookprof and the test helpers)
import torch
from shapes import GPTShape

from hookprof.integrity.replicas import ReplicaCheck
from support.op_counter import OpCounter


def timed(fn, device: str, rounds: int) -> float:
    """Median seconds of `fn()` over `rounds`, synchronised on CUDA."""
    times = []
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--interval", type=float, default=600.0, help="sdc_check_interval_s")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPTShape().to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 50304, (1, 128), device=args.device)
    check = ReplicaCheck(list(model.named_parameters()), args.interval)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        opt.step()

    step()
    check.take()  # warm-up: the weights' tensor made once per device
    with OpCounter() as ops:
        check.take()
    whole = timed(check.take, args.device, args.rounds)
    step_s = timed(step, args.device, max(3, args.rounds // 2))
    steps_per_check = max(1, int(args.interval / step_s))
    out = {
        "device": args.device,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors": len(list(model.parameters())),
        "ops_per_check": sum(ops.ops.values()),
        "check_ms": whole * 1e3,
        "step_ms": step_s * 1e3,
        "check_over_step": whole / step_s,
        "interval_s": args.interval,
        "amortised_per_step": whole / step_s / steps_per_check,
    }
    print(json.dumps(out))
    print(
        f"\n| device | parameters (tensors) | ATen ops per check | one check | one step (1 x 128) "
        f"| check / step | amortised per step at {args.interval:g} s |\n|---|---|---|---|---|---|---|\n"
        f"| {args.device} | {out['parameters'] / 1e6:.0f}M ({out['tensors']}) | "
        f"{out['ops_per_check']} | {out['check_ms']:.1f} ms | {out['step_ms']:.0f} ms | "
        f"{out['check_over_step']:.3f} | {out['amortised_per_step']:.1e} |"
    )


if __name__ == "__main__":
    main()
