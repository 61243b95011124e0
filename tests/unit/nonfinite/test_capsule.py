"""The incident capsule (issue 31): what a real run's capsule holds, compared with values
computed apart from hookprof; the size cap; the device behind the host; a capsule_dir that
cannot be written; the per-process limit; nothing at all without an incident. Replaying in
a subprocess: tests/system/test_replay_cli.py."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import threading

import pytest
import torch
from prometheus_client import generate_latest
from torch import nn

import hookprof
from hookprof import _testing
from hookprof.nonfinite import capsule, reproduce
from support.capsules import capsule_of, local_producer_capsule
from support.first_nan import UNSAMPLED, Mlp, Overflow, TransientPoison, fused_sgd, loss_of, run


def opened(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)  # no user class needed


def part(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def test_overflowing_row_saves_the_producer_its_inputs_output_and_weights_before_the_update(
    tmp_path,
):
    r, path = capsule_of(Overflow(at=5), tmp_path, keep_attached=True)
    try:
        assert re.fullmatch(
            rf"hookprof-capsule-Mlp-rank0-step5-{os.getpid()}\.pt", os.path.basename(path)
        )
        assert os.path.dirname(path) == str(tmp_path)
        capsule = opened(path)
        assert capsule["view"]["form"] == "producer"
        producer = capsule["producer"]
        assert producer["name"] == "fc1" and producer["module_type"] == "Linear"
        fc1 = part(producer["pickle"])  # pickled whole: nn.Linear is importable
        assert isinstance(fc1, nn.Linear) and not fc1._forward_hooks and not fc1._forward_pre_hooks
        (x,), kwargs = part(producer["inputs"])
        # the bad row, as the scenario made it from fc1's weights before the update
        assert torch.equal(x[0], 3e38 * torch.sign(fc1.weight[0]))
        assert torch.isfinite(fc1.weight).all()
        assert not torch.isfinite(r.model.fc1.weight).all()  # record: the NaN update landed later
        expected = nn.functional.linear(x, fc1.weight, fc1.bias)
        assert (
            torch.equal(part(producer["output"]), expected) and not torch.isfinite(expected).all()
        )
        assert producer["input_dtypes"] == ["float32"] and producer["output_dtypes"] == ["float32"]
        assert (
            torch.equal(producer["cpu_rng"], producer["cpu_rng"])
            and producer["cpu_rng"].dtype == torch.uint8
        )
        view = capsule["view"]
        assert view["event"]["layer"] == "fc1" and view["event"]["replay"] == "reproducible"
        assert view["event"]["capsule"] == path
        assert (view["step"], view["rank"], view["policy"], view["device"]) == (
            5,
            0,
            "record",
            "cpu",
        )
        assert view["weights_intact"] is True and view["updates_since_forward"] == 0
        assert (
            view["torch_version"] == torch.__version__
            and view["hookprof_version"] == hookprof.__version__
        )
        assert view["modes"] == {"grad_enabled": True, "autocast": {}}
        assert view["dtypes"]["parameters"] == {k: "float32" for k in r.model.state_dict()}
        assert "fc1" in view["summary"]
        # the snapshot, the counter and the info metric carry it
        assert r.snapshot.capsules_written == 1 and r.snapshot.first_nonfinite.capsule == path
        page = generate_latest(r.prof.registry).decode()
        assert re.search(r"hookprof_capsules_written_total\{[^}]*\} 1\.0", page)
        assert f'path="{path}"' in page
        assert f"capsule: {path}" in r.prof.report()
    finally:
        r.prof.detach()


def test_the_log_line_and_the_exception_give_the_path(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        r, path = capsule_of(Overflow(at=5), tmp_path / "warn", policy="warn")
    assert sum(f"capsule written to {path}" in rec.getMessage() for rec in caplog.records) == 1
    _testing.forget_capsules_written()
    r, path = capsule_of(Overflow(at=5), tmp_path / "raise", policy="raise")
    assert r.error is not None and f"capsule written to {path}" in str(r.error)


def test_transient_fault_saves_the_forward_inputs_and_the_whole_model(tmp_path):
    r, path = capsule_of(TransientPoison(at=7), tmp_path)
    capsule = opened(path)
    assert capsule["view"]["form"] == "model" and capsule["view"]["event"]["replay"] == "transient"
    assert "producer" not in capsule and capsule["forward"]["entry"] is None
    model = part(capsule["model"]["pickle"])
    (x,), _ = part(capsule["forward"]["inputs"])
    assert x.shape == (8, 8) and torch.isfinite(x).all()
    # the poison's counter was pickled as training left it: 7 calls (the replay's own call is
    # put back, as every plain number and tensor attribute is: replay.forward_again)
    assert model.poison.calls == 7
    assert reproduce.replay(path, say=lambda line: None) == reproduce.NOT_REPRODUCED


def test_model_above_the_size_cap_keeps_inputs_and_a_hash_of_each_parameter(tmp_path):
    before: dict[str, str] = {}

    class Watched(TransientPoison):
        def before_step(self, step, model, inputs):
            if step == self.at:  # the weights the bad forward used, hashed apart from hookprof
                before.update(
                    {
                        k: hashlib.sha256(
                            v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                        ).hexdigest()
                        for k, v in model.state_dict().items()
                    }
                )
            return inputs

    r, path = capsule_of(Watched(at=7), tmp_path, capsule_max_bytes=64)
    capsule = opened(path)
    assert capsule["view"]["form"] == "inputs and hashes"
    assert "model" not in capsule and capsule["hashes"] == before
    assert any("capsule_max_bytes=64" in why for why in capsule["view"]["left_out"])
    (x,), _ = part(capsule["forward"]["inputs"])
    assert x.shape == (8, 8)
    lines = []
    assert reproduce.replay(path, say=lines.append) == reproduce.NOT_LOADED
    assert len(lines) == 1 and "holds no weights" in lines[0] and "capsule_max_bytes" in lines[0]


def test_producer_class_not_importable_gets_a_state_dict_and_exit_2(tmp_path):
    gain, path = local_producer_capsule(tmp_path)
    producer = opened(path)["producer"]
    assert producer["name"] == "scale" and "pickle" not in producer
    assert producer["class"].endswith("local_producer_capsule.<locals>.LocalExp")
    assert torch.equal(producer["state_dict"]["gain"], gain)  # the bad forward's, before its update
    lines = []
    assert reproduce.replay(path, say=lines.append) == reproduce.NOT_LOADED
    assert len(lines) == 1 and "LocalExp" in lines[0] and lines[0].startswith("could not load:")


@pytest.mark.parametrize("lag", [1, 3])
def test_capsule_from_a_device_behind_the_host(tmp_path, lag):
    """skip holds the fused update back; the late replay, some finite updates later, writes
    the capsule, which says its weights were not the bad forward's; and the training thread
    waits for the device no more than without a capsule (none). The publisher thread's waits
    are not compared: how many publishes run in a test is up to the clock (a CI flake)."""
    training = threading.current_thread().name
    plain = run(Overflow(at=5), lag=lag, policy="skip", steps=Overflow(at=5).steps(lag))
    r, path = capsule_of(Overflow(at=5), tmp_path, lag=lag, policy="skip")
    assert training not in plain.device_waits and training not in r.device_waits
    assert set(r.device_waits) <= {n for n in plain.device_waits} | {"hookprof-publisher-rank0"}
    view = opened(path)["view"]
    assert view["event"]["layer"] == "fc1" and view["form"] == "producer"
    assert view["weights_intact"] is False and view["updates_since_forward"] >= 1
    assert reproduce.replay(path, say=lambda line: None) == reproduce.REPRODUCED


def test_capsule_dir_not_writable_is_counted_said_once_and_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        r = run(
            Overflow(at=5), lag=0, policy="warn", steps=12, capsule_dir=str(blocker / "capsules")
        )
    assert r.snapshot.step == 12 and r.error is None
    assert r.snapshot.internal_errors == 1 and r.snapshot.capsules_written == 0
    assert r.snapshot.first_nonfinite.layer == "fc1" and r.snapshot.first_nonfinite.capsule is None
    said = [rec for rec in caplog.records if "incident capsule" in rec.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert not list(tmp_path.glob("**/*.pt")) and not list(tmp_path.glob("**/.*.tmp"))


def test_a_capsule_write_that_fails_inside_flush_is_in_that_flushs_snapshot(tmp_path):
    """Issue 39, item 6: the write made by flush() (record: the run ends at the bad step)
    failed, and the snapshot that flush() returned did not count it yet (a second flush did)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = run(
        Overflow(at=5),
        lag=0,
        policy="record",
        steps=5,
        capsule_dir=str(blocker / "capsules"),
        keep_attached=True,
    )  # r.snapshot: after run()'s one flush(), before any detach
    try:
        assert r.snapshot.first_nonfinite is not None and r.snapshot.first_nonfinite.capsule is None
        assert r.snapshot.internal_errors == 1 and r.snapshot.capsules_written == 0
    finally:
        r.prof.detach()


def test_at_most_capsule_max_count_per_process(tmp_path):
    paths = [
        run(
            Overflow(at=5),
            lag=0,
            policy="record",
            steps=8,
            capsule_dir=str(tmp_path),
            capsule_max_count=2,
        ).snapshot.first_nonfinite.capsule
        for _ in range(3)
    ]
    assert paths[0] and paths[1] and paths[2] is None
    assert len(list(tmp_path.glob("hookprof-capsule-*.pt"))) == 2


def test_no_incident_no_capsule_no_hook(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the replay was watched without an incident")

    monkeypatch.setattr(capsule.ReplayWatch, "__init__", never)  # a call would count a fault
    torch.manual_seed(0)
    model = Mlp()
    config = hookprof.Config(summary_at_exit=False, capsule_dir=str(tmp_path / "caps")).replace(
        **UNSAMPLED
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hookprof.attach(model, config=config) as prof:
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 8)).sum().backward()
            opt.step()
        prof.flush()
        assert prof.snapshot().capsules_written == 0 and prof.snapshot().internal_errors == 0
    assert not (tmp_path / "caps").exists()


def test_a_capsule_waiting_at_detach_is_written_then(tmp_path):
    """Under on_nonfinite="record" the capsule waits for its incident to settle (a later
    step end or flush()); a run that ends at the bad step and detaches without a flush
    would lose it: detach writes it."""
    scenario = Overflow(at=3)
    model = scenario.make_model()
    opt = fused_sgd(model)
    g = torch.Generator().manual_seed(1)
    config = hookprof.Config(summary_at_exit=False, capsule_dir=str(tmp_path)).replace(
        **{**scenario.settings, "on_nonfinite": "record"}
    )
    prof = hookprof.attach(model, config=config)
    for step in range(1, 4):  # the last step's forward overflows
        inputs, target = model.batch(g)
        inputs = scenario.before_step(step, model, inputs)
        opt.zero_grad(set_to_none=True)
        loss_of(model, model(inputs), target).backward()
        opt.step()
    prof.detach()  # no flush, no later step
    assert len(list(tmp_path.glob("hookprof-capsule-*.pt"))) == 1
    event = prof.snapshot().first_nonfinite
    assert event.phase == "forward" and event.step == 3 and event.capsule is not None


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_run_ending_while_the_policy_holds_for_the_replay_says_it_and_writes_the_capsule(
    tmp_path, caplog, policy
):
    """On a device 3 steps behind, the policy waits for the late replay to name the layer;
    a run whose last step is the bad one ends (detach, no later step end) while it waits:
    detach acts on it (under "raise" it says it, never raises out of detach) and writes the
    capsule. Before, neither the line nor the capsule came."""
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        r = run(Overflow(at=5), lag=3, policy=policy, steps=5, capsule_dir=str(tmp_path))
    assert r.error is None
    lines = [rec.getMessage() for rec in caplog.records if "step 5" in rec.getMessage()]
    assert len(lines) == 1 and "fc1" in lines[0] and "hookprof-capsule-" in lines[0]
    assert len(list(tmp_path.glob("hookprof-capsule-*.pt"))) == 1


def test_replay_says_when_the_producers_inputs_were_changed_in_place(tmp_path):
    """The capsule records whether the producer's inputs were changed in place after its
    call; `hookprof replay` says so next to its verdict (and only then)."""
    _, path = capsule_of(Overflow(at=5), tmp_path)
    for changed in (False, True):
        contents = torch.load(path, weights_only=True)
        contents["producer"]["inputs_changed_in_place"] = changed
        edited = str(tmp_path / f"edited-{changed}.pt")
        torch.save(contents, edited)
        lines = []
        assert reproduce.replay(edited, say=lines.append) == reproduce.REPRODUCED
        assert any("changed in place" in line for line in lines) is changed


def test_the_size_cap_and_the_dtypes_count_every_tensor_of_a_model():
    """A state_dict of 20 tensors (more than a hook's look at a call's first 8): the capsule's
    size, held against capsule_max_bytes, and its dtypes cover all of them (they covered 8:
    a large model was copied whole under a cap it exceeded)."""
    model = nn.Sequential(*(nn.Linear(10, 10) for _ in range(10)))
    model[3].half()
    state = model.state_dict()
    assert len(state) == 20
    assert capsule.tensor_bytes(state) == sum(t.numel() * t.element_size() for t in state.values())
    assert capsule.dtypes_of(state) == [str(t.dtype).removeprefix("torch.") for t in state.values()]


def test_a_capsule_without_weights_says_why_truly():
    """A capsule of an incident whose replay named another layer's producer holds neither
    that producer nor the model: `hookprof replay` blamed capsule_max_bytes for it (a 474 KB
    model against a 256 MiB cap, issue 38); it now says what the capsule says."""
    from hookprof.nonfinite.reproduce import CannotLoad, _target

    view = {
        "sizes": {"state_dict_bytes": 474112, "input_bytes": 4100, "max_bytes": 268435456},
        "left_out": ["the model (the replay found a producer other than the one named)"],
    }
    capsule = {"view": view, "forward": {"inputs": None, "entry": None}}
    with pytest.raises(CannotLoad) as raised:
        _target(capsule)
    assert "capsule_max_bytes" not in str(raised.value)
    assert "the replay found a producer other than the one named" in str(raised.value)
    capsule["hashes"] = {}  # left out for its size: that is said
    with pytest.raises(CannotLoad, match="capsule_max_bytes"):
        _target(capsule)


def test_a_capsules_copy_of_an_attached_model_keeps_no_hook_and_pickles():
    """hookprof's copies keep the user's hooks (an EMA copy must, step/copies.py); a capsule's
    keeps none: a loop's own hook, a local function, made the model fall back to a
    state_dict (found by the replay check's capsule, issue 43)."""
    model = Mlp()
    seen = []
    model.fc1.register_forward_hook(lambda m, a, out: seen.append(1))
    with hookprof.attach(model, port=0):
        copied = capsule.module_on_cpu(model)
        entry = capsule.module_entry(copied)
    assert "pickle" in entry, entry.get("not_pickled")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in copied.modules())
    assert model.fc1._forward_hooks  # the model's own are left alone
    rebuilt = torch.load(io.BytesIO(entry["pickle"]), weights_only=False)
    rebuilt(torch.randn(2, 8))
    assert seen == []
