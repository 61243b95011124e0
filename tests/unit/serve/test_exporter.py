"""The exporter over real HTTP: every contract metric, values equal to the snapshot,
and an exposition promtool accepts."""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch

import hookprof
from hookprof.demo import InjectNonFinite
from support.binaries import promtool
from support.metrics import parse, samples, scrape
from support.models import DeepNet, MixedNet, seeded, train

# DESIGN.md's metric contract: name -> (type, label names). GPU metrics belong to the
# system collector and need NVML.
CONTRACT = {
    "hookprof_steps": ("counter", {"model", "rank"}),
    "hookprof_sampled_steps": ("counter", {"model", "rank"}),
    "hookprof_step_duration_seconds": ("histogram", {"model", "rank"}),
    "hookprof_last_step_timestamp_seconds": ("gauge", {"model", "rank"}),
    "hookprof_loss": ("gauge", {"model", "rank"}),
    "hookprof_gradient_norm": ("gauge", {"model", "rank"}),
    "hookprof_nonfinite_steps": ("counter", {"model", "rank", "phase"}),
    "hookprof_skipped_steps": ("counter", {"model", "rank"}),
    "hookprof_layer_forward_seconds": ("summary", {"model", "rank", "layer", "module"}),
    "hookprof_layer_backward_seconds": ("summary", {"model", "rank", "layer", "module"}),
    "hookprof_layer_gradient_norm": ("gauge", {"model", "rank", "layer"}),
    "hookprof_layer_nonfinite": ("counter", {"model", "rank", "layer", "phase"}),
    "hookprof_first_nonfinite_info": ("gauge", {"model", "rank", "layer", "phase", "step"}),
    "hookprof_layer_activation_zero_ratio": ("gauge", {"model", "rank", "layer"}),
    "hookprof_layer_activation_abs_max": ("gauge", {"model", "rank", "layer"}),
    "hookprof_layers": ("gauge", {"model", "rank"}),
    "hookprof_layers_exported": ("gauge", {"model", "rank"}),
    "hookprof_internal_errors": ("counter", {"model", "rank", "part"}),
    "hookprof_gradient_flagged_steps": ("counter", {"model", "rank", "kind"}),
    "hookprof_build_info": ("gauge", {"version", "torch_version"}),
}


@pytest.fixture(scope="module")
def nan_run():
    """DeepNet for 5 steps, every step sampled, blocks.1.fc output NaN at the last one."""
    model = seeded(DeepNet)
    inject = InjectNonFinite(model.blocks[1].fc, {5})
    prof = hookprof.attach(
        model, port=0, sample_every=1, min_sample_interval_s=0.0, activation_interval_s=0.0, rank=2
    )
    try:
        train(model, 5, prof=prof, explicit_step=True)
        prof.flush()
        text = scrape(prof.url)
    finally:
        prof.detach()
        inject.remove()
    return prof.snapshot(), text, model


def test_every_contract_metric_is_served(nan_run):
    snap, text, _ = nan_run
    families = parse(text)
    for name, (kind, labels) in CONTRACT.items():
        assert name in families, f"{name} missing from the exposition"
        family = families[name]
        assert family.type == kind, name
        assert family.samples, name
        for s in family.samples:
            assert set(s.labels) - {"le", "quantile"} == labels, (name, s.labels)
    assert "process_resident_memory_bytes" in families  # prometheus_client's own collector


def test_values_equal_the_snapshot(nan_run):
    snap, text, model = nan_run
    f = parse(text)
    r = {"rank": "2"}
    key = frozenset(r.items())
    assert samples(f, "hookprof_steps", "hookprof_steps_total") == {key: 5}
    assert samples(f, "hookprof_sampled_steps", "hookprof_sampled_steps_total") == {key: 5}
    assert samples(f, "hookprof_step_duration_seconds", "hookprof_step_duration_seconds_count") == {
        key: 5
    }
    assert samples(f, "hookprof_nonfinite_steps", "hookprof_nonfinite_steps_total") == {
        frozenset({**r, "phase": "forward"}.items()): 1,
        frozenset({**r, "phase": "backward"}.items()): 1,
        frozenset({**r, "phase": "loss"}.items()): 1,
    }
    assert snap.nonfinite_steps == {"forward": 1, "backward": 1, "loss": 1}
    assert samples(f, "hookprof_first_nonfinite_info") == {
        frozenset({**r, "layer": "blocks.1.fc", "phase": "forward", "step": "5"}.items()): 1
    }
    assert samples(f, "hookprof_layers") == {key: len(snap.layers)}
    fwd_count = samples(f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_count")
    fwd_sum = samples(f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_sum")
    for name, stats in snap.layers.items():
        labels = frozenset({**r, "layer": name, "module": stats.module}.items())
        assert fwd_count[labels] == stats.forward_calls_total == 5
        assert fwd_sum[labels] == pytest.approx(stats.forward_seconds_total)
    # forward: the NaN layer and everything after it; backward: every layer with a gradient
    nonfinite = samples(f, "hookprof_layer_nonfinite", "hookprof_layer_nonfinite_total")
    order = model.order()
    expected = {
        frozenset({**r, "layer": n, "phase": "forward"}.items()): 1
        for n in order[order.index("blocks.1.fc") :]
    }
    expected.update(
        {
            frozenset({**r, "layer": n, "phase": "backward"}.items()): 1
            for n in order
            if not n.endswith(".act")
        }
    )
    assert nonfinite == expected


def test_gradient_and_loss_values_on_a_healthy_run():
    model = seeded(MixedNet)
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        losses = train(model, 3, prof=prof, explicit_step=True)
        prof.flush()
        f = parse(scrape(prof.url))
        snap = prof.snapshot()
    r = frozenset({"rank": "0"}.items())
    assert samples(f, "hookprof_loss") == {r: pytest.approx(losses[-1].item())}
    all_grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert samples(f, "hookprof_gradient_norm")[r] == pytest.approx(
        torch.linalg.vector_norm(all_grads).item(), rel=1e-5
    )
    norms = samples(f, "hookprof_layer_gradient_norm")
    assert norms[frozenset({"rank": "0", "layer": "head"}.items())] == pytest.approx(
        snap.layers["head"].grad_norm
    )
    assert "hookprof_first_nonfinite_info" not in f


def test_promtool_accepts_the_exposition(nan_run):
    _, text, _ = nan_run
    tool = promtool()
    result = subprocess.run(
        [tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", (
        result.stdout + result.stderr
    )


def test_layer_names_that_need_escaping_still_parse():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.ModuleDict(
                {
                    'quo"te': torch.nn.Linear(4, 4),
                    "back\\slash": torch.nn.Linear(4, 4),
                    "ünï": torch.nn.Linear(4, 1),
                }
            )

        def forward(self, x):
            for m in self.inner.values():
                x = m(x)
            return x

    model = Odd()
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        prof.flush()
        f = parse(scrape(prof.url))
    layers = {dict(k)["layer"] for k in samples(f, "hookprof_layer_gradient_norm")}
    assert layers == {'inner.quo"te', "inner.back\\slash", "inner.ünï"}


def test_max_layers_keeps_top_by_time_and_every_nonfinite_layer():
    model = seeded(DeepNet, depth=8)

    def poison(step, m):  # one layer's gradient goes NaN at step 2
        if step == 2:
            m.blocks[6].fc.bias.grad[0] = float("nan")

    with hookprof.attach(
        model, port=0, sample_every=1, min_sample_interval_s=0.0, max_layers=5
    ) as prof:
        train(model, 2, on_step=poison)
        prof.flush()
        snap = prof.snapshot()
        f = parse(scrape(prof.url))
    assert samples(f, "hookprof_layers")[frozenset({"rank": "0"}.items())] == len(snap.layers) == 18
    exported = set(snap.exported_layers)
    bad = {n for n, s in snap.layers.items() if any(s.nonfinite.values())}
    assert bad == {"blocks.6.fc"}
    assert bad <= exported and len(exported) == 5
    rest = [n for n in snap.layers if n not in bad]
    time = {
        n: snap.layers[n].forward_seconds_total + snap.layers[n].backward_seconds_total
        for n in rest
    }
    assert exported - bad == set(sorted(rest, key=time.get, reverse=True)[:4])
    served = {
        dict(k)["layer"]
        for k in samples(
            f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_count"
        )
    }
    assert served == exported
    assert samples(f, "hookprof_layers_exported")[frozenset({"rank": "0"}.items())] == 5


def hand_built_snapshot() -> hookprof.Snapshot:
    """A snapshot written out by hand: what the exporter shows depends on nothing else."""
    from types import MappingProxyType

    layer = hookprof.LayerStats(
        name="blocks.0.fc",
        module="Linear",
        calls=2,
        forward_seconds=0.003,
        backward_seconds=0.005,
        grad_norm=1.5,
        forward_seconds_total=0.25,
        forward_calls_total=40,
        backward_seconds_total=0.5,
        backward_calls_total=20,
        forward_seconds_per_call_median=0.004,  # (the backward's not known yet: none)
        nonfinite=MappingProxyType({"forward": 0, "backward": 3}),
    )
    return hookprof.Snapshot(
        rank=3,
        step=20,
        sampled_steps=4,
        step_duration_buckets=((0.01, 5), (float("inf"), 20)),
        step_duration_sum=1.25,
        loss=0.75,
        grad_norm=2.5,
        nonfinite_steps=MappingProxyType({"forward": 0, "backward": 3, "loss": 0}),
        skipped_steps=1,
        layers=MappingProxyType({"blocks.0.fc": layer}),
        exported_layers=("blocks.0.fc",),
        first_nonfinite=hookprof.NonFiniteEvent("blocks.0.fc", "backward", 17),
    )


def test_a_hand_built_snapshot_renders_to_exactly_its_values():
    from prometheus_client import CollectorRegistry, generate_latest

    from hookprof.serve.exporter import SnapshotCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(hand_built_snapshot, "9.9", rank=3))
    f = parse(generate_latest(registry).decode())
    rank = {"rank": "3"}
    layer = {**rank, "layer": "blocks.0.fc", "module": "Linear"}
    key = lambda labels: frozenset(labels.items())  # noqa: E731
    assert samples(f, "hookprof_steps", "hookprof_steps_total") == {key(rank): 20}
    assert samples(f, "hookprof_sampled_steps", "hookprof_sampled_steps_total") == {key(rank): 4}
    assert samples(f, "hookprof_skipped_steps", "hookprof_skipped_steps_total") == {key(rank): 1}
    assert samples(f, "hookprof_loss") == {key(rank): 0.75}
    assert samples(f, "hookprof_gradient_norm") == {key(rank): 2.5}
    assert samples(f, "hookprof_step_duration_seconds", "hookprof_step_duration_seconds_count") == {
        key(rank): 20
    }
    assert samples(f, "hookprof_step_duration_seconds", "hookprof_step_duration_seconds_sum") == {
        key(rank): 1.25
    }
    assert samples(f, "hookprof_nonfinite_steps", "hookprof_nonfinite_steps_total") == {
        key({**rank, "phase": p}): v for p, v in (("forward", 0), ("backward", 3), ("loss", 0))
    }
    assert samples(f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_sum") == {
        key(layer): 0.25
    }
    assert samples(f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_count") == {
        key(layer): 40
    }
    assert samples(f, "hookprof_layer_backward_seconds", "hookprof_layer_backward_seconds_sum") == {
        key(layer): 0.5
    }
    # the recent median per call, as the summary's quantile 0.5; none where not known yet
    assert samples(f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds") == {
        key({**layer, "quantile": "0.5"}): 0.004
    }
    assert samples(f, "hookprof_layer_backward_seconds", "hookprof_layer_backward_seconds") == {}
    assert samples(f, "hookprof_layer_gradient_norm") == {
        key({**rank, "layer": "blocks.0.fc"}): 1.5
    }
    assert samples(f, "hookprof_first_nonfinite_info") == {
        key({**rank, "layer": "blocks.0.fc", "phase": "backward", "step": "17"}): 1.0
    }
    assert samples(f, "hookprof_build_info") == {
        key({"version": hookprof.__version__, "torch_version": "9.9"}): 1.0
    }


def test_a_snapshot_that_fails_to_render_leaves_a_valid_page_and_logs_once(caplog):
    from prometheus_client import CollectorRegistry, generate_latest

    from hookprof.serve.exporter import SnapshotCollector

    def broken():
        raise RuntimeError("injected")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(broken, "9.9", rank=3))
    with caplog.at_level(logging.ERROR, logger="hookprof"):
        pages = [generate_latest(registry).decode() for _ in range(3)]
    f = parse(pages[-1])
    assert set(f) == {"hookprof_publisher_thread_up", "hookprof_build_info"}
    assert samples(f, "hookprof_publisher_thread_up") == {frozenset({"rank": "3"}.items()): 1.0}
    assert sum("rendering the snapshot failed" in r.getMessage() for r in caplog.records) == 1
