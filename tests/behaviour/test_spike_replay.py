"""Issue 43 item 2 for spikes: was it the data or the machine? (Config.spike_replay)

A spike made by the machine (a wrong value in one layer's output on the step's own forward:
a fault of the test's own, a forward hook registered before hookprof's, so that every hook
after it sees the wrong value as it would a failing device's) is replayed and not
reproduced; the same spike made by the data (the same wrong value in the batch) is
reproduced; so is one nobody injected (a learning rate 150x too large for one step). Each is
checked against this test's own account of the step: the fault it injected, and the losses
it saw. Training stays the same bit for bit, BatchNorm and Dropout included; on a device
behind the host the verdict comes too, with one wait per step on the training thread."""

from __future__ import annotations

import io
import threading

import pytest
import torch
from torch import nn

import hookprof
from hookprof.config import ConfigError
from hookprof.view.report_html import render
from hookprof.view.summary import summary_text
from hookprof.view.table import from_metrics, header_lines
from support.capsules import replay_in_new_process
from support.first_nan import Mlp
from support.lagging_device import lagging_device
from support.metrics import parse, scrape
from support.models import ReplayCheckNet
from support.rendered import Elements

AT = 90  # the spike's step (the rule judges from 50 steps of history on)
STEPS = 100
# drains often enough that the gate knows the window (a long run's sampled steps do this)
OFTEN = dict(port=0, sample_every=4, min_sample_interval_s=0.0, summary_at_exit=False)


def corrupt(t: torch.Tensor) -> torch.Tensor:
    """One row of `t` made wrong (a copy): x * 100 + 5."""
    out = t.clone()
    out[0] = out[0] * 100 + 5
    return out


def train(
    make=Mlp,
    config: dict | None = None,
    fault: str | None = None,
    lr_bump: float = 1.0,
    micro_batches: int = 1,
    at: str = "fc1",
    per_sample: dict | None = None,
    buffer: torch.Tensor | None = None,
):
    """SGD on `make()`; `fault`: "machine" (the output of layer `at`, "" for the model's own,
    on AT's own forward), "data" (AT's inputs), "targets" (AT's targets); `lr_bump`: the
    learning rate that many times larger at step AT. `per_sample`: a dict given each step's
    per-sample losses (by step), which prof.step gets too. Returns the losses and, with
    `config`, (snapshot, page text, document)."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    armed = {"now": False}

    def wrong_output(module, args, output):
        if armed["now"] and torch.is_grad_enabled():  # the step's own forward only
            armed["now"] = False
            return corrupt(output)
        return None

    if fault == "machine":
        model.get_submodule(at).register_forward_hook(wrong_output)
    prof = hookprof.attach(model, **config) if config is not None else None
    losses = []
    try:
        for step in range(1, STEPS + 1):
            for group in opt.param_groups:
                group["lr"] = 0.01 * (lr_bump if step == AT else 1.0)
            opt.zero_grad()
            for _ in range(micro_batches):
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
                if fault == "data" and step == AT:
                    x = corrupt(x)
                if fault == "targets" and step == AT:
                    y = corrupt(y)
                armed["now"] = step == AT
                sample_losses = (model(x) - y).square().mean(1)
                loss = sample_losses.mean()
                if buffer is not None:  # (the loop's own, written again each step before
                    sample_losses = buffer.copy_(sample_losses.detach())  # its update)
                loss.backward()
            opt.step()
            if per_sample is not None:
                per_sample[step] = sample_losses.detach().clone()
                per_sample["x", step] = x
            if prof is not None:
                prof.step(loss, sample_losses=sample_losses if per_sample is not None else None)
            losses.append(loss.item())
        if prof is None:
            return losses, None
        prof.flush()
        snap = prof.snapshot()
        return losses, (snap, scrape(prof.url), prof.report_document())
    finally:
        if prof is not None:
            prof.detach()


def replays(text: str) -> dict[str, float]:
    return {
        s.labels["result"]: s.value
        for s in parse(text)["hookprof_spike_replays"].samples
        if s.name == "hookprof_spike_replays_total"
    }


def test_a_spike_the_machine_made_is_not_reproduced():
    losses, (snap, page, _) = train(config={**OFTEN, "spike_replay": True}, fault="machine")
    assert losses[AT - 1] > 5 * max(losses[AT - 20 : AT - 1])  # (the test's own: a spike)
    loss_spike = snap.spikes["loss_spike"]
    assert (loss_spike.count, loss_spike.first.step) == (1, AT)
    assert loss_spike.first.verdict == "not_reproduced"
    assert snap.spikes["grad_norm_spike"].first.verdict == "not_reproduced"
    assert snap.spike_replays["not_reproduced"] == 1
    assert replays(page) == {k: float(v) for k, v in snap.spike_replays.items()}
    assert snap.internal_errors == 0 and snap.nonfinite_steps.get("forward", 0) == 0


@pytest.mark.parametrize("at, named", [("fc1", "fc1"), ("fc2", "fc2"), ("", "(root)")])
def test_the_layer_where_the_machines_wrong_value_entered_is_named(at, named):
    """Item 3: every layer's output summed on every step while armed; the replay's compared
    with them in call order names the layer the test corrupted (fc2: fc1 and act before it
    were alike; the model's own output, "(root)": every layer was alike), in the spike event,
    the metric the alert reads, top, the summary and the report."""
    _, (snap, page, document) = train(
        config={**OFTEN, "spike_replay": True}, fault="machine", at=at
    )
    # (the gradient norm spikes in all three; the loss not where row 0's value lands near
    # its own: x * 100 + 5 for x near -0.05)
    first = snap.spikes["grad_norm_spike"].first
    assert (first.step, first.verdict, first.entered) == (AT, "not_reproduced", named)
    if snap.spikes["loss_spike"].first is not None:
        assert snap.spikes["loss_spike"].first.entered == named
    mismatch = snap.spike_mismatch
    assert (mismatch.step, mismatch.layer, mismatch.deterministic) == (AT, named, False)
    (info,) = parse(page)["hookprof_spike_mismatch_info"].samples
    assert (info.labels["layer"], info.labels["step"], info.value) == (named, str(AT), 1.0)
    (when,) = parse(page)["hookprof_spike_mismatch_timestamp_seconds"].samples
    assert when.value == pytest.approx(mismatch.time)
    (table,) = from_metrics(page)
    line = f"{snap.spike_replays['reproduced']} reproduced (the data), 1 not reproduced "
    line += f"(the machine) (latest: step {AT}, "
    line += f"first differing output {named}'s)"
    assert any(line in x for x in header_lines([table.header]))
    assert line in summary_text(snap, "Mlp")
    assert document["spikes"]["grad_norm_spike"]["first"]["entered"] == named
    report = "".join(Elements(render([document])).text)
    assert f"the machine (first differing output {named}'s)" in report


def test_a_fault_in_the_layer_sums_leaves_the_verdict_without_a_layer(monkeypatch):
    """hookprof's own part fails (the layers' sums on the spike's step): counted, training
    the same, the spike still judged on the model's output, no layer claimed."""
    from hookprof.step import output_sums

    real, calls = output_sums.output_checksum, {"done": False}
    bare, _ = train(fault="machine")

    def failing(t):
        # the first output as wrong as the fault makes it (fc1's on step AT: x * 100 + 5);
        # not a count of calls, which the replays (the backward's calibration) move
        if not calls["done"] and t.is_floating_point() and t.abs().max() > 20:
            calls["done"] = True
            raise RuntimeError("injected")
        return real(t)

    monkeypatch.setattr(output_sums, "output_checksum", failing)
    losses, (snap, _, _) = train(config={**OFTEN, "spike_replay": True}, fault="machine")
    assert losses == bare
    first = snap.spikes["loss_spike"].first
    assert (first.verdict, first.entered) == ("not_reproduced", "(output)")
    assert snap.internal_errors == 1


def test_the_same_spike_made_by_the_data_is_reproduced():
    losses, (snap, page, document) = train(config={**OFTEN, "spike_replay": True}, fault="data")
    assert losses[AT - 1] > 5 * max(losses[AT - 20 : AT - 1])
    assert snap.spikes["loss_spike"].first.step == AT
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert snap.spike_replays["not_reproduced"] == 0 and snap.spike_replays["reproduced"] >= 1
    assert snap.spikes["loss_spike"].first.entered is None and snap.spike_mismatch is None
    assert "hookprof_spike_mismatch_info" not in parse(page)
    # what a person reads: top (from the page), the summary, the report
    (table,) = from_metrics(page)
    expected = (
        f"spike replays: {snap.spike_replays['reproduced']} reproduced (the data), "
        "0 not reproduced (the machine)"
    )
    assert expected in [x.strip() for x in header_lines([table.header])]
    assert expected in summary_text(snap, "Mlp")
    assert document["spikes"]["loss_spike"]["first"]["verdict"] == "reproduced"
    report = "".join(Elements(render([document])).text)
    assert "its replay reproduced it: the data" in report


def test_a_learning_rate_that_jumps_is_reproduced(tmp_path):
    """Nobody injected anything: a learning rate 150x too large for one step makes the next
    steps' loss spike (the test's own losses say so); the replay gives the same bits. With
    capsule_dir, one capsule: of the spike's first step (the steps after it stay past the
    limit, and would use up capsule_max_count: found by review)."""
    config = {**OFTEN, "spike_replay": True, "capsule_dir": str(tmp_path)}
    losses, (snap, _, _) = train(config=config, lr_bump=150.0)
    spike = snap.spikes["loss_spike"].first
    assert spike is not None and spike.step == AT + 1
    assert losses[AT] > 10 * max(losses[AT - 20 : AT - 1])
    assert losses[AT + 1] > 10 * max(losses[AT - 20 : AT - 1])  # (still past it after)
    assert spike.verdict == "reproduced"
    assert snap.spike_replays["not_reproduced"] == 0
    assert snap.capsules_written == 1 and [p.name for p in tmp_path.iterdir()] == [
        spike.capsule.rpartition("/")[2]
    ]


def test_a_reproduced_spike_leaves_the_last_capsule_slot_to_a_nan(tmp_path):
    config = {**OFTEN, "spike_replay": True, "capsule_dir": str(tmp_path), "capsule_max_count": 1}
    _, (snap, _, _) = train(config=config, lr_bump=150.0)
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert snap.capsules_written == 0 and not any(tmp_path.iterdir())
    assert any("leaves the last for a NaN" in n for n in snap.notices)


class Blocks(nn.Module):
    """fc1 -> block (its own fc and act, and a residual add of its own code) -> fc2. `fault`
    makes one value wrong on the step's own forward: "inside" in block.fc's forward (a
    layer wrapped, no hook of the test's), "residual" in the block's own add."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.block = Block()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.block(self.fc1(x)))


class FaultyLinear(nn.Linear):
    fault = {"now": None}

    def forward(self, x):
        out = super().forward(x)
        if FaultyLinear.fault["now"] == "inside" and torch.is_grad_enabled():
            FaultyLinear.fault["now"] = None
            out = corrupt(out)
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = FaultyLinear(16, 16)
        self.act = nn.ReLU()

    def forward(self, x):
        out = x + self.act(self.fc(x))
        if FaultyLinear.fault["now"] == "residual" and torch.is_grad_enabled():
            FaultyLinear.fault["now"] = None
            out = corrupt(out)
        return out


@pytest.mark.parametrize("fault, named", [("inside", "block.fc"), ("residual", "block")])
def test_a_wrong_value_made_in_a_layers_forward_or_in_a_containers_own_code(
    monkeypatch, fault, named
):
    """Found by review: with only the layers summed, a wrong value made by a container's own
    code (a residual add) showed first in the next layer's output, naming a layer that
    computed right. The containers are summed too: the innermost whose output differs is
    named."""
    original = torch.randn

    def randn(*args, **kwargs):  # the batch of step AT is drawn: arm the fault for it
        out = original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2 * AT - 1:  # (two draws a step: x, then y)
            FaultyLinear.fault["now"] = fault
        return out

    calls = {"n": 0}
    monkeypatch.setattr(torch, "randn", randn)
    _, (snap, _, _) = train(make=Blocks, config={**OFTEN, "spike_replay": True})
    first = snap.spikes["grad_norm_spike"].first
    assert (first.step, first.verdict, first.entered) == (AT, "not_reproduced", named)


class Switching(nn.Module):
    """Which head runs is Python state the replay cannot put back: its calls part."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act = nn.Linear(8, 16), nn.ReLU()
        self.fc2, self.fc2b = nn.Linear(16, 1), nn.Linear(16, 1)
        self.state = {"calls": 0}  # (in a dict: not put back by a replay, docs/integrity.md)

    def forward(self, x):
        self.state["calls"] += 1
        # (the replay: > AT + 1; +1: the replay of a healthy step, step 1, at step 2, which
        # sees whether this run's backward reproduces)
        head = self.fc2 if self.state["calls"] <= AT + 1 else self.fc2b
        return head(self.act(self.fc1(x)))


def test_a_replay_whose_calls_part_is_not_compared_and_writes_no_capsule(tmp_path):
    """Found by review: its capsule said "reproduced" on a truncated list of layers."""
    config = {**OFTEN, "spike_replay": True, "capsule_dir": str(tmp_path)}
    _, (snap, _, _) = train(make=Switching, config=config, fault="data")
    assert snap.spikes["loss_spike"].first.verdict == "not_compared"
    assert snap.capsules_written == 0 and not any(tmp_path.iterdir())


def test_sample_losses_written_again_before_the_replay_are_not_named():
    """A loop that writes each step's per-sample losses into one buffer has overwritten the
    spike's by the time it is replayed (the next update): no samples named, rather than
    another step's (found by review)."""
    own: dict = {}
    buffer = torch.empty(16)
    _, (snap, _, _) = train(
        config={**OFTEN, "spike_replay": True}, fault="data", per_sample=own, buffer=buffer
    )
    spike = snap.spikes["loss_spike"].first
    assert spike.verdict == "reproduced" and spike.suspects is None


@pytest.mark.parametrize("fault", ["targets", None])
def test_training_is_the_same_bit_for_bit(fault):
    """BatchNorm's buffers, Dropout's RNG and the weights are put back after each replay
    (BatchNorm evens out a wrong input row: wrong targets make this model's spike)."""
    bare, _ = train(ReplayCheckNet, None, fault)
    watched, (snap, _, _) = train(ReplayCheckNet, {**OFTEN, "spike_replay": True}, fault)
    assert watched == bare
    if fault == "targets":
        assert snap.spike_replays["reproduced"] >= 1
        assert snap.spikes["loss_spike"].first.verdict == "reproduced"


def test_on_a_device_behind_the_host():
    """The gate's flag is a device value: read as the next update begins, with one wait for
    it there, on the training thread (no other thread waits)."""
    with lagging_device(lag=3) as device:
        _, (snap, _, _) = train(config={**OFTEN, "spike_replay": True}, fault="machine")
    assert snap.spikes["loss_spike"].first.verdict == "not_reproduced"
    assert threading.main_thread().name in device.waits


def test_a_step_of_two_forwards_is_not_compared_with_its_reason():
    _, (snap, _, _) = train(config={**OFTEN, "spike_replay": True}, fault="data", micro_batches=2)
    assert snap.spikes["loss_spike"].first.verdict == "not_compared"
    assert snap.spike_replays["not_compared"] >= 1 and snap.spike_replays["reproduced"] == 0


def test_off_by_default_and_needs_spike_detection():
    _, (snap, page, _) = train(config=OFTEN, fault="machine")
    assert snap.spikes["loss_spike"].first.verdict is None and snap.spike_replays == {}
    assert "hookprof_spike_replays" not in parse(page)
    with pytest.raises(ConfigError, match="spike_replay"):
        hookprof.Config(spike_replay=True, spike_detection=False)


def test_a_not_reproduced_spike_writes_a_capsule_another_process_does_not_reproduce(tmp_path):
    """capsule_dir set: the machine's spike gets a capsule of its step (the weights from
    before its update, its batch, RNG and modules' state, both runs' output sums);
    `hookprof replay` agrees with the in-place replay against the step's own output (exit
    1). The steps after it whose loss stays past the rule's limit, reproduced, get one of
    their batch each (below); no other step does."""
    config = {**OFTEN, "spike_replay": True, "capsule_dir": str(tmp_path / "machine")}
    _, (snap, _, document) = train(config=config, fault="machine")
    spike = snap.spikes["loss_spike"].first
    assert spike.verdict == "not_reproduced" and spike.capsule is not None
    assert document["spikes"]["loss_spike"]["first"]["capsule"] == spike.capsule
    written = {
        c["view"]["step"]: c["view"]["event"]["replay"]
        for c in (torch.load(p, weights_only=True) for p in (tmp_path / "machine").iterdir())
    }
    assert snap.capsules_written == len(written) and written[AT] == "not_reproduced"
    assert all(
        step > AT and replay == "reproduced" for step, replay in written.items() if step != AT
    )
    capsule = torch.load(spike.capsule, weights_only=True)
    assert (capsule["view"]["kind"], capsule["view"]["step"]) == ("spike replay", AT)
    # every layer's output in call order, then the model's
    assert capsule["check"]["layers"] == ["fc1", "act", "fc2", ""]
    assert capsule["check"]["first"] == 0
    done = replay_in_new_process(spike.capsule, "--runs", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith(
        "not reproduced: 2 runs on cpu agree with the in-place replay and differ from the "
        "step's own outputs first at fc1"
    ), done.stdout


def test_a_data_spike_names_its_samples_of_largest_loss_and_gets_a_capsule_of_its_batch(
    tmp_path,
):
    """prof.step(loss, sample_losses=...): a reproduced spike names the samples of its batch
    with the largest loss (row 0, the one the test made wrong, first), against the test's own
    per-sample losses; with capsule_dir, the step past the rule's own limit gets a capsule
    of its batch and weights, which `hookprof replay` reproduces in a new process (exit 0)."""
    config = {**OFTEN, "spike_replay": True, "capsule_dir": str(tmp_path / "data")}
    own: dict = {}
    _, (snap, _, document) = train(config=config, fault="data", per_sample=own)
    spike = snap.spikes["loss_spike"].first
    assert (spike.step, spike.verdict, spike.entered) == (AT, "reproduced", None)
    top = own[AT].double().topk(5)
    assert [s.sample for s in spike.suspects] == top.indices.tolist()
    assert spike.suspects[0].sample == 0  # (the row the test corrupted)
    assert [s.loss for s in spike.suspects] == pytest.approx(top.values.tolist(), rel=1e-12)
    assert document["spikes"]["loss_spike"]["first"]["suspects"][0] == {
        "sample": 0,
        "loss": pytest.approx(top.values[0].item(), rel=1e-12),
    }
    report = "".join(Elements(render([document])).text)
    assert "its batch's samples of largest loss: sample 0 (" in report
    # the capsule: the spike's step (a neighbour past the limit may have one too)
    assert spike.capsule is not None and snap.capsules_written >= 1
    capsule = torch.load(spike.capsule, weights_only=True)
    assert capsule["view"]["event"]["replay"] == "reproduced" and capsule["check"]["first"] is None
    assert [s for s, _ in capsule["check"]["suspects"]] == top.indices.tolist()
    inputs = torch.load(io.BytesIO(capsule["forward"]["inputs"]), weights_only=True)
    assert torch.equal(inputs[0][0], own["x", AT])  # (the batch, row 0 as the test made it)
    done = replay_in_new_process(spike.capsule, "--runs", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        "reproduced: 2 runs on cpu give the step's own output bits at every layer"
    ), done.stdout
    assert any(line.startswith("the batch's samples of largest loss") for line in lines)


def test_sample_losses_that_are_not_any_get_a_clear_error():
    model = Mlp()
    with hookprof.attach(model, port=0, summary_at_exit=False, spike_replay=True) as prof:
        loss = model(torch.randn(4, 8)).sum()
        with pytest.raises(TypeError, match="sample_losses"):
            prof.step(loss, sample_losses=[1.0, 2.0])
        with pytest.raises(ValueError, match=r"shape \(\) and dtype torch.float32"):
            prof.step(loss, sample_losses=loss.detach())
        with pytest.raises(ValueError, match="torch.int64"):
            prof.step(loss, sample_losses=torch.arange(4))
        prof.step(loss, sample_losses=torch.ones(4))  # (steps go on)
        prof.flush()
        assert prof.snapshot().step == 1
    # without the spike replay they are not kept, and that is said once
    model = Mlp()
    with hookprof.attach(model, port=0, summary_at_exit=False) as prof:
        for _ in range(2):
            loss = model(torch.randn(4, 8)).sum()
            prof.step(loss, sample_losses=torch.ones(4))
        prof.flush()
        said = [n for n in prof.snapshot().notices if "sample_losses" in n]
        assert len(said) == 1 and "spike_replay" in said[0]


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.value = nn.Linear(16, 1)
        self.policy = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.value(h), self.policy(h)


def actor_critic(config: dict | None) -> tuple[list[float], object]:
    """One forward, two optimizers: the value head's update, then a backward through the
    trunk (whose graph was built before that update) and the others' update. A data spike
    at AT. (Found by review: a replay that wrote the parameters in place broke that second
    backward; a second optimizer's hook re-took the weights after the first had updated.)"""
    torch.manual_seed(0)
    model = ActorCritic()
    opt_value = torch.optim.SGD(model.value.parameters(), lr=0.01)
    opt_rest = torch.optim.Adam([*model.trunk.parameters(), *model.policy.parameters()], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    prof = hookprof.attach(model, **config) if config is not None else None
    losses = []
    try:
        for step in range(1, STEPS + 1):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if step == AT:
                x = corrupt(x)
            opt_value.zero_grad()
            opt_rest.zero_grad()
            value, logits = model(x)
            value_loss = (value - y).square().mean()
            value_loss.backward(retain_graph=True)
            opt_value.step()
            policy_loss = logits.logsumexp(-1).mean() + value.detach().mean()
            policy_loss.backward()
            opt_rest.step()
            if prof is not None:
                prof.step(value_loss)
            losses.append(value_loss.item())
        if prof is None:
            return losses, None
        prof.flush()
        return losses, prof.snapshot()
    finally:
        if prof is not None:
            prof.detach()


def test_two_optimizers_on_one_forward_train_the_same_and_reproduce():
    bare, _ = actor_critic(None)
    watched, snap = actor_critic({**OFTEN, "spike_replay": True})
    assert watched == bare
    assert snap.spikes["loss_spike"].first.step == AT
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert snap.spike_replays["not_reproduced"] == 0 and snap.internal_errors == 0


def test_a_forward_difference_whose_gradients_differ_too_gets_its_capsule(tmp_path):
    """Found by review: a capsule was skipped whenever the backward differed, also where the
    forward differed first (fc2's wrong output changes the gradients below it)."""
    config = {**OFTEN, "spike_replay": True, "capsule_dir": str(tmp_path)}
    _, (snap, _, _) = train(config=config, fault="machine", at="fc2")
    first = snap.spikes["grad_norm_spike"].first
    assert (first.verdict, first.entered, first.entered_phase) == (
        "not_reproduced",
        "fc2",
        "forward",
    )
    assert first.capsule is not None and snap.internal_errors == 0
