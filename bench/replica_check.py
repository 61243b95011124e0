"""What the checks of Config.sdc_check_interval_s (issue 43 item 4) cost, on the full-size
GPT-2 124M shape (148 parameter tensors, 124M parameters, fp32), timed on this machine's
device:

- the replica check: one fingerprint of the parameters (hookprof/integrity/fingerprint.py),
  with the ATen ops it issues (each a kernel launch on a GPU) counted, and the watch of a
  check step's parameters from its forward to its update (two sums of each parameter's bits
  and their comparison: ReplicaCheck.hold and .release);
- the replay check: a check step (sampled, its forward replayed before the update, every
  layer's output summed in both forwards) against a sampled step without it and a bare step,
  hookprof attached for each in turn, steps interleaved by rounds;

then amortised per step for a step time and an interval.

    python bench/replica_check.py                 # CPU
    python bench/replica_check.py --device cuda   # on a GPU
    python bench/replica_check.py --small         # a 2-block model: CI's smoke run

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

import hookprof
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
    parser.add_argument("--small", action="store_true", help="2 blocks of 64: a smoke run")
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = {"dim": 64, "heads": 2, "layers": 2, "vocab": 512, "block": 128} if args.small else {}
    model = GPTShape(**shape).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, shape.get("vocab", 50304), (1, 128), device=args.device)
    check = ReplicaCheck(model, args.interval, "run:bench")

    def watch() -> None:  # a check step's watch: its parameters' sums at forward and update
        check.hold()
        check.release()

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
    watch()
    with OpCounter() as watch_ops:
        watch()
    watched = timed(watch, args.device, args.rounds)
    step_s = timed(step, args.device, max(3, args.rounds // 2))
    steps_per_check = max(1, int(args.interval / step_s))
    # the replay check: a check step against a sampled one and a bare one, in rounds
    sampled = {"sample_every": 1, "min_sample_interval_s": 0.0, "port": 0}
    configs = {"bare": None, "sampled": sampled, "check": {**sampled, "sdc_check_interval_s": 1e-9}}
    per_config: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(max(2, args.rounds // 2)):
        for name, config in configs.items():
            prof = hookprof.attach(model, **config) if config is not None else None
            try:
                for _ in range(2):  # warm: the first sampled step installs the hooks
                    step()
                    if prof is not None:
                        prof.step()

                def checked_step() -> None:
                    step()
                    if prof is not None:
                        prof.step()

                per_config[name].append(timed(checked_step, args.device, 3))
            finally:
                if prof is not None:
                    prof.detach()
    median = {name: sorted(v)[len(v) // 2] for name, v in per_config.items()}
    out = {
        "device": args.device,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors": len(list(model.parameters())),
        "ops_per_check": sum(ops.ops.values()),
        "check_ms": whole * 1e3,
        "step_ms": step_s * 1e3,
        "check_over_step": whole / step_s,
        "ops_per_watch": sum(watch_ops.ops.values()),
        "watch_ms": watched * 1e3,
        "watch_over_step": watched / step_s,
        "interval_s": args.interval,
        "amortised_per_step": whole / step_s / steps_per_check,
        "replay_step_ms": {name: v * 1e3 for name, v in median.items()},
        "replay_check_over_bare": median["check"] / median["bare"],
        "replay_check_over_sampled": median["check"] / median["sampled"],
        "replay_amortised_per_step": (median["check"] - median["bare"])
        / median["bare"]
        / max(1, int(args.interval / median["bare"])),
    }
    print(json.dumps(out))
    print(
        f"\n| device | parameters (tensors) | ATen ops per check | one check | one step (1 x 128) "
        f"| check / step | amortised per step at {args.interval:g} s |\n|---|---|---|---|---|---|---|\n"
        f"| {args.device} | {out['parameters'] / 1e6:.0f}M ({out['tensors']}) | "
        f"{out['ops_per_check']} | {out['check_ms']:.1f} ms | {out['step_ms']:.0f} ms | "
        f"{out['check_over_step']:.3f} | {out['amortised_per_step']:.1e} |"
    )
    print(
        f"\n| device | ATen ops per watch | one watch (hold + release) | watch / step |\n"
        f"|---|---|---|---|\n| {args.device} | {out['ops_per_watch']} | "
        f"{out['watch_ms']:.1f} ms | {out['watch_over_step']:.3f} |"
    )
    ms = out["replay_step_ms"]
    print(
        f"\n| device | bare step | sampled step | check step (replayed) | check / sampled "
        f"| check / bare | amortised per step at {args.interval:g} s |\n"
        f"|---|---|---|---|---|---|---|\n"
        f"| {args.device} | {ms['bare']:.0f} ms | {ms['sampled']:.0f} ms | {ms['check']:.0f} ms | "
        f"{out['replay_check_over_sampled']:.2f} | {out['replay_check_over_bare']:.2f} | "
        f"{out['replay_amortised_per_step']:.1e} |"
    )


if __name__ == "__main__":
    main()
