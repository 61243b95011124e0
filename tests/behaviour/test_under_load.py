"""hookprof under load and concurrency: 20 concurrent scrapers for 30 s while training runs,
and two models trained in two threads of one process with a profiler each."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch

import hookprof
from hookprof import _testing
from support.metrics import parse, samples, scrape
from support.models import DeepNet, MixedNet, mse_step, seeded, train
from support.paths import worker


@pytest.mark.slow
def test_20_scrapers_for_30_seconds_while_training():
    model = seeded(DeepNet)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    steps = 0
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        load = subprocess.Popen(
            [
                sys.executable,
                worker("load_scrapers.py"),
                prof.url,
                "--scrapers",
                "20",
                "--seconds",
                "30",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                prof.step(mse_step(model, opt, *model.batch(g)))
                steps += 1
            out, _ = load.communicate(timeout=60)
        finally:
            if load.poll() is None:
                load.kill()
                load.wait(timeout=10)
        prof.flush()
        final = parse(scrape(prof.url))
    report = json.loads(out)
    assert report["failures"] == [], report["failures"][:5]
    assert report["non_monotonic"] == [], report["non_monotonic"][:5]
    assert min(report["per_scraper"]) >= 10, report["per_scraper"]  # every scraper got through
    assert steps > 50
    assert samples(final, "hookprof_steps", "hookprof_steps_total") == {
        frozenset({"rank": "0"}.items()): steps
    }
    print(f"\n{report['scrapes']} scrapes by 20 scrapers in 30 s, {steps} training steps")


def test_two_models_in_two_threads_never_mix(every_step):
    models = {"deep": seeded(DeepNet), "mixed": seeded(MixedNet)}
    reference = {"deep": seeded(DeepNet), "mixed": seeded(MixedNet)}
    steps = {"deep": 15, "mixed": 9}
    train(reference["deep"], steps["deep"])
    train(reference["mixed"], steps["mixed"])

    profs = {name: hookprof.attach(m, **every_step) for name, m in models.items()}
    errors = []

    def run(name):
        try:
            train(models[name], steps[name], prof=profs[name], explicit_step=True)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in models]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        for name, prof in profs.items():
            prof.flush()
            snap = prof.snapshot()
            own = {layer.name for layer in prof.table.layers}
            assert set(snap.layers) == own
            assert snap.step == steps[name] and snap.sampled_steps == steps[name]
            f = parse(scrape(prof.url))
            exported = {
                dict(k)["layer"]
                for k in samples(
                    f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_count"
                )
            }
            called = {n for n, st in snap.layers.items() if st.forward_calls_total}
            assert exported == called and called <= own, name  # no layer of the other model
            normed = {dict(k)["layer"] for k in samples(f, "hookprof_layer_gradient_norm")}
            assert normed and normed <= own, name
            assert (
                samples(f, "hookprof_steps", "hookprof_steps_total")[
                    frozenset({"rank": "0"}.items())
                ]
                == steps[name]
            )
            # the last step's norms are this model's own gradients
            for layer in prof.table.layers:
                grads = [prof.table.params[i].grad for i in layer.param_indices]
                grads = [g_ for g_ in grads if g_ is not None]
                if grads:
                    expected = torch.linalg.vector_norm(
                        torch.cat([g_.reshape(-1) for g_ in grads])
                    ).item()
                    assert snap.layers[layer.name].grad_norm == pytest.approx(expected, rel=1e-5)
            calls = [s.forward_calls_total for s in snap.layers.values()]
            assert max(calls) > 0
    finally:
        for prof in profs.values():
            prof.detach()
    for name in models:
        for a, b in zip(reference[name].parameters(), models[name].parameters()):
            assert torch.equal(a, b), name


def test_the_page_is_rendered_once_per_change_not_per_scrape(every_step):
    import gzip
    import urllib.request

    model = seeded(DeepNet)
    with hookprof.attach(model, **every_step) as prof:
        train(model, 2, prof=prof, explicit_step=True)
        prof.flush()
        page = _testing.metrics_page(prof)
        first = scrape(prof.url)
        before = page.renders
        for _ in range(50):
            assert scrape(prof.url) == first  # nothing changed: the same bytes
        assert page.renders - before <= 2  # at most a refresh for max_age (1 s)
        train(model, 1, prof=prof, explicit_step=True)
        prof.flush()
        steps = samples(parse(scrape(prof.url)), "hookprof_steps", "hookprof_steps_total")
        assert steps == {frozenset({"rank": "0"}.items()): 3.0}  # a new snapshot: a new page

        request = urllib.request.Request(prof.url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.headers["Content-Encoding"] == "gzip"
            assert "hookprof_steps_total" in gzip.decompress(r.read()).decode()
        request = urllib.request.Request(
            prof.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            body = r.read().decode()
        assert body.endswith("# EOF\n") and "hookprof_steps_total" in body
