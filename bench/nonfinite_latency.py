"""How soon hookprof sees, names and stops a NaN, and what `nonfinite_sync` costs (issue 12).

    python bench/nonfinite_latency.py                 # CPU: the narrow GPT shape
    python bench/nonfinite_latency.py --full          # on a GPU: GPT-124M, bf16, fused AdamW
    python bench/nonfinite_latency.py --lag 3         # CPU, a device emulated 3 steps behind

The workload is bench/shapes.py's GPT shape, hookprof with its default sampling. One layer
(`h.5.mlp.c_fc`) makes a NaN in its forward on step 23, an unsampled step (checked: the run
stops with an error otherwise); the loop never reads a value back from the device.
For each policy the run goes on for at least 60 more steps, and on until the snapshot names
the producer or 5 s have passed (or until hookprof raises); after every step the snapshot (a
host read, no wait) is looked at. Printed per policy:

- detected: the first step after whose end the snapshot holds the NaN (its step and phase);
- named: the first step after which it also names the layer that produced it;
- seconds: from the end of the bad step's loop iteration to detected / named (the snapshot
  is what /metrics serves; it is refreshed every publish_interval_s, 1 s by default);
- raised: under "raise", the step whose boundary raised NonFiniteError, and the layer it named;
- weights: whether every parameter and every optimizer state tensor is finite at the end
  (under "raise" and "skip" no non-finite update may have reached them).

Steps are counted in loop iterations (step 23 is the bad one; "+0" means the boundary of that
same step). On a CPU every copy is done when it is issued, so everything is "+0": the figures
that matter are a GPU's, where the host runs ahead of the device.

With `--lag K` the run is on tests/support/lagging_device.py's emulated device, K optimizer steps
behind the host (one-value flags and counter drains not ready for K steps; a wait completes
them at once): the GPU's code paths and their step counts, on the CPU. Its seconds are the
CPU's, and the sync cost is not measured (a wait costs nothing there).

Then the cost of `nonfinite_sync=True` (a wait for one flag at each optimizer step): step time
with it over step time without it, both with hookprof's defaults otherwise, in interleaved
rounds (paired median of the per-round ratios), on a clean run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import paths  # first: the hookprof under test (HOOKPROF_ROOT's or this checkout's) and the tests' helpers
import shapes
import torch

import hookprof
from hookprof._testing import replaying, step_is_sampled

BAD_STEP = 23
PRODUCER = "h.5.mlp.c_fc"
POLICIES = (
    ("record", {}),
    ("record, nonfinite_sync", {"nonfinite_sync": True}),
    ("skip", {"on_nonfinite": "skip"}),
    ("raise", {"on_nonfinite": "raise"}),
    ("raise, nonfinite_sync", {"on_nonfinite": "raise", "nonfinite_sync": True}),
)
# hookprof's sampling defaults (at least 10 steps and 2 s apart): step 1 is sampled, step 23
# is not as long as a step takes under ~90 ms. The non-finite counters ride the sampled steps'
# copies, so under "record" the snapshot learns of a NaN at the next sampled step.
SETTINGS = dict(port=0, stall_detection=False, system_metrics=False, summary_at_exit=False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Poison:
    """Forward hooks that turn the layer's output into NaN in every forward of one batch
    (a data-dependent overflow): the batch given to the step it is armed for, a copy of the
    shape's fixed one, so that hookprof's replay of that step, a few steps later on a device
    behind the host, makes the NaN again, and no other step does. The replay runs on its own
    copy of the step's inputs, so it is told apart by `replaying` (set once attached), not by
    the batch's identity; it replays only the bad step."""

    def __init__(self, model: torch.nn.Module, layer: torch.nn.Module):
        self.batch: torch.Tensor | None = None  # the root input that overflows
        self._input: torch.Tensor | None = None  # the root input of the forward running now
        self.replaying: Callable[[], bool] = lambda: False  # a hookprof replay is running
        self.handles = [
            model.register_forward_pre_hook(self._note),
            layer.register_forward_hook(self._hook),
        ]

    def arm(self, shape: shapes.Shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Give the next step an equal copy of the batch, poisoned; returns the batch to put back."""
        original = shape.batch
        self.batch = original[0].clone()
        shape.batch = (self.batch, original[1])
        return original

    def _note(self, module, args):
        self._input = args[0] if args else None

    def _hook(self, module, args, output):
        bad = self.batch is not None and (self._input is self.batch or self.replaying())
        return output * float("nan") if bad else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def all_finite(shape: shapes.Shape) -> bool:
    tensors = list(shape.model.parameters())
    for state in shape.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def one_policy(
    name: str,
    overrides: dict,
    device: torch.device,
    full: bool,
    after: int,
    deadline_s: float,
    settings: dict = SETTINGS,
    fused: bool | None = None,
) -> dict:
    shape = shapes.build("gpt", device, full=full)
    if fused is not None:  # the shape's AdamW is fused where the device has it: else this
        shape.optimizer = torch.optim.AdamW(shape.model.parameters(), lr=6e-4, fused=fused)
    for _ in range(3):  # warm-up (kernels chosen, memory allocated) before step 1
        shape.step()
    synchronize(device)
    poison = Poison(shape.model, shape.model.get_submodule(PRODUCER))
    prof = hookprof.attach(shape.model, **settings, **overrides)
    poison.replaying = lambda: replaying(prof)
    result: dict = {
        "policy": name,
        "detected": None,
        "named": None,
        "raised": None,
        "raised_layer": None,
        "seconds_to_detected": None,
        "seconds_to_named": None,
    }
    bad_issued = None
    step = 0
    try:
        # at least `after` steps past the bad one; on, while the snapshot (published every
        # publish_interval_s) has not named the producer, for up to `deadline_s`
        while step < BAD_STEP + after or (
            result["named"] is None and time.perf_counter() - bad_issued < deadline_s
        ):
            step += 1
            if step == BAD_STEP and step_is_sampled(prof):  # planned at step 22's end
                raise SystemExit(
                    f"step {BAD_STEP} is sampled (steps take > ~90 ms here): the "
                    "bench measures an unsampled one; use a narrower shape"
                )
            fixed_batch = poison.arm(shape) if step == BAD_STEP else None
            try:
                shape.step()
            except hookprof.NonFiniteError as exc:
                result["raised"], result["raised_layer"] = step - BAD_STEP, exc.layer
                break
            finally:
                if fixed_batch is not None:
                    shape.batch = fixed_batch
            if step == BAD_STEP:
                bad_issued = time.perf_counter()
            if step < BAD_STEP:
                continue
            event = prof.snapshot().first_nonfinite
            if event is not None and result["detected"] is None:
                result["detected"] = step - BAD_STEP
                result["seconds_to_detected"] = time.perf_counter() - bad_issued
                result["event"] = f"{event.phase}, step {event.step}"
            if event is not None and event.layer == PRODUCER and result["named"] is None:
                result["named"] = step - BAD_STEP
                result["seconds_to_named"] = time.perf_counter() - bad_issued
        synchronize(device)
        prof.flush()
        event = prof.snapshot().first_nonfinite
        result["after_flush"] = (
            None if event is None else f"{event.layer}, {event.phase}, step {event.step}"
        )
        result["held_back"] = prof.snapshot().held_back_updates
        result["weights_finite"] = all_finite(shape)
    finally:
        prof.detach()
        poison.remove()
    return result


def sync_cost(device: torch.device, full: bool, rounds: int, steps: int) -> dict:
    """Step time with nonfinite_sync over without, interleaved rounds, one model each."""
    runs = {}
    for label, sync in (("off", False), ("on", True)):
        shape = shapes.build("gpt", device, full=full)
        prof = hookprof.attach(shape.model, **SETTINGS, nonfinite_sync=sync)
        for _ in range(5):  # warm-up
            shape.step()
        runs[label] = (shape, prof)
    per_round: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for r in range(rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for label in order:
                shape, _ = runs[label]
                synchronize(device)
                start = time.perf_counter()
                for _ in range(steps):
                    shape.step()
                synchronize(device)
                per_round[label].append((time.perf_counter() - start) / steps)
    finally:
        for _, prof in runs.values():
            prof.detach()
    ratios = [on / off for on, off in zip(per_round["on"], per_round["off"])]
    return {
        "step_ms_off": statistics.median(per_round["off"]) * 1e3,
        "step_ms_on": statistics.median(per_round["on"]) * 1e3,
        "paired_ratio": statistics.median(ratios),
        "rounds": rounds,
        "steps": steps,
    }


def fmt(steps: int | None) -> str:
    return "never" if steps is None else f"+{steps}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="the issue's sizes (a GPU)")
    parser.add_argument(
        "--after", type=int, default=60, help="steps run after the bad one, at least"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=5.0,
        help="seconds after the bad step to go on until the producer is named",
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument(
        "--lag",
        type=int,
        default=0,
        help="on the CPU: emulate a device this many optimizer steps behind the host",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="JSON results (default bench/results/nonfinite_latency[_lagK].json)",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        suffix = f"_lag{args.lag}" if args.lag else ""
        args.out = os.path.join(paths.HERE, "results", f"nonfinite_latency{suffix}.json")
    if args.lag:
        return main_emulated(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    where = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"hookprof nonfinite latency: torch {torch.__version__}, {where}, "
        f"{time.strftime('%Y-%m-%d')}, GPT shape {'full' if args.full else 'narrow'}; "
        f"NaN in {PRODUCER}'s forward at unsampled step {BAD_STEP}"
    )
    out = {}
    # fused AdamW holds a bad update back on the device (found_inf); the for-loop one cannot
    # without nonfinite_sync: both, as docs/nonfinite.md's table has a column for each
    for fused in (True, False) if device.type == "cuda" else (None,):
        if fused is not None:
            print(f"AdamW fused={fused}", flush=True)
        results = [
            one_policy(name, overrides, device, args.full, args.after, args.deadline, fused=fused)
            for name, overrides in POLICIES
        ]
        print_rows(results)
        out[f"fused={fused}" if fused is not None else "shape's optimizer"] = results
    cost = sync_cost(device, args.full, args.rounds, args.steps)
    print(
        f"nonfinite_sync=True: step {cost['step_ms_on']:.2f} ms vs {cost['step_ms_off']:.2f} ms, "
        f"paired ratio {cost['paired_ratio']:.3f} ({cost['rounds']} rounds x {cost['steps']} steps)"
    )
    write(
        args.out,
        {
            "device": where,
            "torch": torch.__version__,
            "full": args.full,
            "policies": out,
            "nonfinite_sync_cost": cost,
        },
    )
    return 0


def main_emulated(args: argparse.Namespace) -> int:
    """--lag K: every policy with fused and with for-loop AdamW, on the emulated device."""
    from support.lagging_device import lagging_device  # a test helper, only here

    torch.set_num_threads(1)
    print(
        f"hookprof nonfinite latency: torch {torch.__version__}, CPU with a device emulated "
        f"{args.lag} steps behind the host (tests/support/lagging_device.py), {time.strftime('%Y-%m-%d')}, "
        f"GPT shape narrow; NaN in {PRODUCER}'s forward at unsampled step {BAD_STEP}"
    )
    out = {}
    for fused in (True, False):
        print(f"AdamW fused={fused}")
        results = []
        for name, overrides in POLICIES:
            with lagging_device(args.lag):
                results.append(
                    one_policy(
                        name,
                        overrides,
                        torch.device("cpu"),
                        False,
                        args.after,
                        args.deadline,
                        fused=fused,
                    )
                )
        print_rows(results)
        out[f"fused={fused}"] = results
    write(
        args.out,
        {
            "device": "cpu, emulated lag",
            "lag": args.lag,
            "torch": torch.__version__,
            "policies": out,
        },
    )
    return 0


def write(path: str, document: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
    print(f"written {path}")


def print_rows(results: list[dict]) -> None:
    print(
        f"{'policy':26} {'detected':>9} {'named':>6} {'seconds':>15} {'raised':>7} "
        f"{'raised layer':>14} {'held back':>9} {'weights':>8}"
    )
    for r in results:
        to_named = "/".join(
            "-" if r[k] is None else f"{r[k]:.2f}"
            for k in ("seconds_to_detected", "seconds_to_named")
        )
        raised = "-" if r["raised"] is None and "raise" not in r["policy"] else fmt(r["raised"])
        stopped = r["raised"] is not None  # the loop ended at the raise: nothing to look at after
        detected, named = ("-", "-") if stopped else (fmt(r["detected"]), fmt(r["named"]))
        print(
            f"{r['policy']:26} {detected:>9} {named:>6} {to_named:>15} {raised:>7} "
            f"{str(r['raised_layer'] or '-'):>14} {r.get('held_back', 0):>9} "
            f"{'finite' if r.get('weights_finite') else 'NaN':>8}"
        )
        print(f"{'':26} after flush(): {r.get('after_flush')}")


if __name__ == "__main__":
    sys.exit(main())
