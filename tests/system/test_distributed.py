"""Two ranks (torch.distributed, gloo, CPU): each serves base_port + LOCAL_RANK with its own
rank label, and DDP's gradients are read after the all-reduce."""

from __future__ import annotations

import pytest

from support.metrics import parse, samples
from support.ranks import run_two
from workers.dist_worker import run_rank


def test_two_ranks_serve_two_ports_with_rank_labels():
    steps = 4
    results, texts, base_port = run_two(run_rank, steps)
    assert results[0][0].endswith(f":{base_port}/metrics")
    assert results[1][0].endswith(f":{base_port + 1}/metrics")
    for rank, text in texts.items():
        f = parse(text)
        assert samples(f, "hookprof_steps", "hookprof_steps_total") == {
            frozenset({"rank": str(rank)}.items()): steps
        }
        layer_ranks = {dict(k)["rank"] for k in samples(f, "hookprof_layer_gradient_norm")}
        assert layer_ranks == {str(rank)}
    # different data per rank, identical gradients after DDP's all-reduce
    assert results[0][1] == results[1][1]
    with_params = {n: v for n, v in results[0][1].items() if not n.endswith(".act")}
    assert with_params and all(v > 0 for v in with_params.values())


def test_fsdp2_local_norms_combine_to_the_full_norms():
    from workers.dist_worker import run_fsdp_rank

    results, texts, _ = run_two(run_fsdp_rank, steps=4)
    (_, norms0, global0, full_layers, total, kind, steps0) = results[0]
    (_, norms1, global1, full_layers1, total1, _, steps1) = results[1]
    assert kind == "DTensor" and steps0 == steps1 == 4
    assert full_layers == full_layers1 and total == total1
    # each rank exports the norm of its own shard; sqrt(sum of squares over ranks) is the
    # full norm: in PromQL, sqrt(sum by (job, layer) (hookprof_layer_gradient_norm ^ 2))
    for layer, full in full_layers.items():
        combined = (norms0[layer] ** 2 + norms1[layer] ** 2) ** 0.5
        assert combined == pytest.approx(full, rel=1e-5), layer
    assert (global0**2 + global1**2) ** 0.5 == pytest.approx(total, rel=1e-5)  # = get_total_norm
    for rank, text in texts.items():
        exported = samples(parse(text), "hookprof_layer_gradient_norm")
        assert {dict(k)["rank"] for k in exported} == {str(rank)}
        by_layer = {dict(k)["layer"]: v for k, v in exported.items()}
        assert by_layer == pytest.approx(
            {n: v for n, v in (norms0 if rank == 0 else norms1).items() if v is not None}
        )


def test_hookprof_runs_no_collectives():
    """No torch.distributed collective anywhere in the package (DESIGN.md: Prometheus does
    the cross-rank aggregation)."""
    import pathlib
    import re

    import hookprof

    pattern = re.compile(
        r"\b(dist|distributed|funcol|c10d)\.(all_reduce|all_gather\w*|reduce_scatter\w*|"
        r"broadcast\w*|barrier|gather\w*|scatter\w*|send|recv|isend|irecv)\b"
        r"|\.(full_tensor|redistribute)\("
    )
    package = pathlib.Path(hookprof.__file__).parent
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(package.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == [], found


def test_compiled_ranks_never_rerun_their_forward_alone():
    """Several ranks: a sampled step's eager re-run (the per-layer statistics of a compiled
    model) is not made, as a forward run on one rank could start collectives the others never
    join; the steps are all counted."""
    from workers.dist_worker import run_compiled_rank

    results, _, _ = run_two(run_compiled_rank, steps=4)
    for rank in (0, 1):
        _, absmax, steps = results[rank]
        assert steps == 4
        assert set(absmax.values()) == {None}
