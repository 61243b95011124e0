"""Bytes of the run report page (docs/report.md, "Hand-written SVG, not a charting library"):
a demo run's page, a page at the history's limits, and the page's own script and style.

    python bench/report_size.py
"""

from __future__ import annotations

import gzip
import math
import random

import paths  # noqa: F401  (first: the hookprof under test, HOOKPROF_ROOT's or this checkout's)

from hookprof.view.report_html import render
from hookprof.view.report_script import CSS, SCRIPT
from support.rendered import demo_run


def demo_document(steps: int, nan_at: int, sample_every: int) -> dict:
    prof, _ = demo_run(steps, nan_at, sample_every=sample_every)  # the report tests' run
    try:
        return prof.report_document()
    finally:
        prof.detach()


def at_the_limits(doc: dict, points: int = 512, layers: int = 64, table: int = 500) -> dict:
    """`doc` with a full history (512 points, 64 layers' series: publish/history.py's limits)
    and 500 exported layers (Config.max_layers), noisy values: the largest page there is."""
    rng = random.Random(0)
    steps = [float(128 * (k + 1)) for k in range(points)]
    walk = lambda: [math.exp(rng.gauss(0, 1)) for _ in steps]  # noqa: E731
    hist = dict(
        doc["history"],
        stride=128,
        points={
            "step": steps,
            "wall_time": steps,
            "step_seconds": [0.1 + rng.random() / 10 for _ in steps],
            "loss": walk(),
            "grad_norm": walk(),
            "nonfinite_steps": [0.0] * points,
            "samples": [128.0] * points,
            "steps": [128.0] * points,
        },
    )
    hist["layers"] = [
        {
            "name": f"blocks.{k}.mlp.c_proj",
            "forward_seconds": walk(),
            "backward_seconds": walk(),
            "grad_norm": walk(),
        }
        for k in range(layers)
    ]
    # every step's series at its limits (publish/every_step.py): the 512 latest steps and a
    # lead-up of 289 elsewhere at full resolution, 512 bands
    full_steps = [float(s) for s in (*range(20_000, 20_289), *range(65_024, 65_536))]
    band_cols = {}
    for col in ("loss", "grad_norm", "step_seconds"):
        values = walk()  # (512: one per point)
        band_cols.update(
            {
                f"{col}_min": [v * 0.5 for v in values],
                f"{col}_max": [v * 2 for v in values],
                f"{col}_mean": values,
                f"{col}_n": [127.0] * 512,
                f"{col}_bad": [0.0] * 512,
            }
        )
    hist["every_step"] = {
        "full": {
            "step": full_steps,
            "loss": [math.exp(rng.gauss(0, 1)) for _ in full_steps],
            "grad_norm": [math.exp(rng.gauss(0, 1)) for _ in full_steps],
            "step_seconds": [0.1 + rng.random() / 10 for _ in full_steps],
        },
        "bands": {
            "first": [float(127 * k + 1) for k in range(512)],
            "last": [float(127 * (k + 1)) for k in range(512)],
            **band_cols,
        },
        "stride": 128,
        "incident": 20_256,
    }
    base = doc["layer_totals"][0]
    totals = [
        dict(
            base, name=f"blocks.{k // 4}.layer{k % 4}", forward_calls=points, backward_calls=points
        )
        for k in range(table)
    ]
    return dict(doc, steps=points * 128, history=hist, layer_totals=totals, layers_total=table)


def main() -> None:
    rows = []
    for title, doc in [
        ("DemoNet, 60 steps, every step sampled, NaN at 40", demo_document(60, 40, 1)),
        ("DemoNet, 80 steps, every 5th sampled, NaN at 50", demo_document(80, 50, 5)),
    ]:
        rows.append((title, render([doc]).encode()))
    rows.append(
        (
            "at the limits: 512 points, 801 steps + 512 bands, 64 layers' series, 500 rows",
            render([at_the_limits(doc)]).encode(),
        )
    )
    rows.append(("the page's script and style alone", (CSS + SCRIPT).encode()))
    width = max(len(t) for t, _ in rows)
    print(f"{'page':<{width}}  {'bytes':>9}  {'gzip':>8}")
    for title, body in rows:
        print(f"{title:<{width}}  {len(body):>9,}  {len(gzip.compress(body)):>8,}")


if __name__ == "__main__":
    main()
