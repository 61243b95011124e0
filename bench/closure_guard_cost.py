"""What on_nonfinite="skip" costs a closure step (optimizer.step(closure)) next to "record":
under skip/raise the guard judges each evaluation of the closure as it returns (one per-layer
gradient reduction per evaluation, LBFGS making up to max_eval of them per step), under
record the gradients are read once per step. Side by side, in one run, rounds interleaved:

    python bench/closure_guard_cost.py [--rounds 3] [--steps 50]

Prints the median step time per configuration and its ratio to no hookprof.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import hookprof


def make_model(width: int = 256, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, width)]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


OPTIMIZERS = {
    "SGD + closure (1 evaluation)": lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9),
    "LBFGS max_iter=4 (4 evaluations)": lambda m: torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=4),
}

SETTINGS = {"none": None, "record": {}, "skip": {"on_nonfinite": "skip"}}


def seconds_per_step(make_opt, settings: dict | None, steps: int) -> float:
    model = make_model()
    opt = make_opt(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    prof = hookprof.attach(model, port=0, **settings) if settings is not None else None
    try:
        for _ in range(5):  # warm-up
            opt.step(closure)
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step(closure)
        return (time.perf_counter() - t0) / steps
    finally:
        if prof is not None:
            prof.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'optimizer':<36}{'setting':<10}{'ms/step':>10}{'vs none':>10}")
    for name, make_opt in OPTIMIZERS.items():
        times: dict[str, list[float]] = {key: [] for key in SETTINGS}
        for _ in range(args.rounds):  # interleaved, so drifts in machine load hit all alike
            for key, settings in SETTINGS.items():
                times[key].append(seconds_per_step(make_opt, settings, args.steps))
        base = statistics.median(times["none"])
        for key in SETTINGS:
            t = statistics.median(times[key])
            print(f"{name:<36}{key:<10}{t * 1e3:>10.3f}{t / base:>10.3f}")
        skip, record = statistics.median(times["skip"]), statistics.median(times["record"])
        print(f"{name:<36}{'skip/record':<10}{'':>10}{skip / record:>10.3f}")


if __name__ == "__main__":
    main()
