"""What the incident capsule (issue 31, Config.capsule_dir) costs at the incident step, on
the CPU: the bad step's wall time with and without capsules, for a small MLP and a ~100 MB
one, side by side.

    python bench/capsule_cost.py [--repeats 5]

Each run trains a few steps under on_nonfinite="warn" (on the CPU the replay, the capsule's
copy and its write all happen at the bad step's end) with one batch row that overflows the
first layer at step 4. Printed per model: the median time of the bad step (the loop
iteration: forward, backward, optimizer step, hookprof's step end) without capsules, with
them, and with them above capsule_max_bytes (a sha256 per parameter instead of the weights),
the ratio to the run without, and the capsule's size. The steps before it are unchanged by
capsule_dir (nothing runs without an incident); their median is printed too, as a check.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hookprof  # noqa: E402
from hookprof import _testing  # noqa: E402

BAD_STEP = 4


def mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def one_run(make, width: int, capsule: str | None, max_bytes: int) -> tuple[float, float, int]:
    """(bad step seconds, median seconds of the steps before it, capsule bytes)."""
    _testing.forget_capsules_written()
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    settings = dict(
        summary_at_exit=False,
        port=0,
        on_nonfinite="warn",
        sample_every=1000,
        min_sample_interval_s=3600.0,
        capsule_max_bytes=max_bytes,
    )
    if capsule is not None:
        settings["capsule_dir"] = capsule
    g = torch.Generator().manual_seed(1)
    times = []
    with hookprof.attach(model, **settings) as prof:
        for step in range(1, BAD_STEP + 2):
            x = torch.randn(32, width, generator=g)
            if step == BAD_STEP:
                x[0] = 3e38 * torch.sign(model[0].weight[0].detach())
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            times.append(time.perf_counter() - start)
        prof.flush()
        path = prof.snapshot().first_nonfinite.capsule
    size = os.path.getsize(path) if path else 0
    if path:
        os.unlink(path)
    return times[BAD_STEP - 1], statistics.median(times[1 : BAD_STEP - 1]), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("hookprof").setLevel(logging.ERROR)  # the incident's own log lines
    models = {
        "small MLP (8 wide, 2 layers, 1 KB)": (lambda: mlp(8, 2), 8),
        "MLP 2048 wide, 6 layers (~100 MB)": (lambda: mlp(2048, 6), 2048),
    }
    directory = tempfile.mkdtemp(prefix="hookprof-capsule-bench-")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats} runs"
    )
    print(
        f"{'model':<36} {'bad step, no capsule':>21} {'with capsule':>14} {'ratio':>6} "
        f"{'above cap (hashes)':>19} {'ratio':>6} {'capsule':>10} {'steps before (with/without)':>28}"
    )
    for name, (make, width) in models.items():
        params = sum(p.numel() * p.element_size() for p in make().parameters())
        rows = {}
        for label, capsule, cap in (
            ("off", None, 256 * 2**20),
            ("on", directory, 256 * 2**20),
            ("hashes", directory, 1),
        ):
            runs = [one_run(make, width, capsule, cap) for _ in range(args.repeats)]
            rows[label] = (
                statistics.median(r[0] for r in runs),
                statistics.median(r[1] for r in runs),
                runs[0][2],
            )
        off, on, hashes = rows["off"], rows["on"], rows["hashes"]
        print(
            f"{name + f' [{params / 2**20:.1f} MiB]':<36} {off[0] * 1e3:>18.1f} ms {on[0] * 1e3:>11.1f} ms "
            f"{on[0] / off[0]:>6.2f} {hashes[0] * 1e3:>16.1f} ms {hashes[0] / off[0]:>6.2f} "
            f"{on[2] / 2**20:>7.2f} MiB {on[1] * 1e3:>12.2f} / {off[1] * 1e3:.2f} ms"
        )
    os.rmdir(directory)


if __name__ == "__main__":
    main()
