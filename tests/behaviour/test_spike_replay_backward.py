"""Issue 43 item 2's gradient comparison: a spike's replay runs the step's backward too.

The loop's loss is not the model's, so the replay's backward starts where the model ends:
from the gradient the step's own backward brought the model's output (kept by reference),
through the replayed forward's graph, with every layer's output gradient summed as the
backward computes it, and compared with the step's own sums in that order. A wrong value
made in the backward only (a fault of this test's own, in one layer's backward on the
spike's step) is not reproduced and named by the first layer whose output's gradient
differs, phase "backward"; spikes the data made are reproduced forward and backward, also
with a weight penalty the loop adds to its loss (a gradient path outside the model's output,
which the replay does not run and does not compare), activation checkpointing and Dropout;
the backward is left out, with its reason, where it cannot be replayed. Each is checked
against this test's own account: the fault it injected, its losses, and a bare run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookprof
from hookprof.integrity import spike_replay
from hookprof.view.report_html import render
from hookprof.view.summary import summary_text
from hookprof.view.table import from_metrics, header_lines
from support.metrics import parse, scrape
from support.rendered import Elements
from support.wrong_gradients import (
    Net,
    WeightFaultNet,
    _WrongGradient,
    _WrongWeightGradient,
)

AT = 90  # the spike's step (the rule judges from 50 steps of history on)
STEPS = 100
OFTEN = dict(port=0, sample_every=4, min_sample_interval_s=0.0, summary_at_exit=False)
ARMED = {**OFTEN, "spike_replay": True}


class Wide(nn.Module):
    """An output larger than the parameters: its gradient is not kept."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x)).repeat(1, 64)


def mse(model, x, y):
    return (model(x) - y).square().mean()


def train(
    make=Net,
    config=None,
    fault=None,
    penalty=0.0,
    before_backward=None,
    loss_of=mse,
    kept=None,
    updates_from=1,
    set_to_none=True,
    trained=None,
    at_step=None,
):
    """SGD on `make()`; `fault`: "backward" (fc2's backward on AT's own backward makes the
    gradient of its input wrong) or "data" (one of AT's targets); `penalty`: the loop adds that many
    times the parameters' squared norm to its loss; `before_backward(step)`: called before
    each step's backward; `loss_of(model, x, y)`: the loop's loss; `kept`: a list the loop
    appends each step's loss to, graph and all (as loops that keep their outputs do);
    `updates_from`: the first step whose update runs (a GradScaler's first skips);
    `set_to_none`: zero_grad's; `trained(model)`: the parameters the optimizer updates (all);
    `at_step(model, step)`: called as each step begins.
    Returns the losses and the global gradient norms (the test's own) and, with `config`,
    (snapshot, page text, document)."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD((trained or nn.Module.parameters)(model), lr=0.01)
    g = torch.Generator().manual_seed(1)
    prof = hookprof.attach(model, **config) if config is not None else None
    losses, norms = [], []
    try:
        for step in range(1, STEPS + 1):
            if at_step is not None:
                at_step(model, step)
            opt.zero_grad(set_to_none=set_to_none)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if fault == "data" and step == AT:  # (one wrong target: the loss spikes)
                y = y.clone()
                y[0] = y[0] * 100 + 50
            loss = loss_of(model, x, y)
            if kept is not None:
                kept.append(loss)
            if penalty:
                loss = loss + penalty * sum(p.square().sum() for p in model.parameters())
            _WrongGradient.armed["now"] = fault == "backward" and step == AT
            _WrongWeightGradient.armed["now"] = fault == "weights" and step == AT
            if before_backward is not None:
                before_backward(step)
            loss.backward()
            _WrongGradient.armed["now"] = False
            norms.append(
                torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
                .norm()
                .item()
            )
            if step >= updates_from:
                opt.step()
            if prof is not None:
                prof.step(loss)
            losses.append(loss.item())
        if prof is None:
            return (losses, norms), None
        prof.flush()
        return (losses, norms), (prof.snapshot(), scrape(prof.url), prof.report_document())
    finally:
        if prof is not None:
            prof.detach()


@pytest.fixture
def judged(monkeypatch):
    """The comparisons the publisher judged, by step (a spy on SpikeReplays.judge)."""
    seen: dict[int, spike_replay.SpikeComparison] = {}
    real = spike_replay.SpikeReplays.judge

    def judge(self, comparison, flags):
        seen[comparison.step] = comparison
        return real(self, comparison, flags)

    monkeypatch.setattr(spike_replay.SpikeReplays, "judge", judge)
    return seen


def test_a_wrong_value_made_in_the_backward_is_not_reproduced_and_named(judged):
    """fc2's backward makes the gradient of its input (act's output) wrong on the spike's
    own backward: the forward replays alike, the backward does not, first at act's output
    gradient; in the event, the metric the alert reads, top, the summary and the report.
    Training is what it is without hookprof, bit for bit."""
    bare, _ = train(fault="backward")
    norms = bare[1]  # (the test's own: step AT's gradient norm spikes, not its loss)
    assert norms[AT - 1] > 5 * max(norms[AT - 20 : AT - 1])
    watched, (snap, page, document) = train(config=ARMED, fault="backward")
    assert watched == bare
    first = snap.spikes["grad_norm_spike"].first
    assert (first.step, first.verdict) == (AT, "not_reproduced")
    assert (first.entered, first.entered_phase) == ("act", "backward")
    comparison = judged[AT]
    assert comparison.backward_off is None and comparison.backward_from is not None
    # the forward's outputs (fc1, act, fc2, act2, drop, head, the model's), then the
    # gradients in the order the backward computed them
    assert comparison.layers[: comparison.backward_from] == (
        "fc1",
        "act",
        "fc2",
        "act2",
        "drop",
        "head",
        "(root)",
    )
    # (head's output is the model's: its gradient is the one the replay starts from; drop,
    # with p=0, returns act2's output tensor itself, whose hooks run in the order placed)
    assert comparison.layers[comparison.backward_from : comparison.params_from] == (
        "head",
        "act2",
        "drop",
        "fc2",
        "act",
        "fc1",
    )
    # then the parameters' own gradients, the layer called last first
    assert comparison.params_off is None
    assert comparison.layers[comparison.params_from :] == (
        "head.weight",
        "head.bias",
        "fc2.weight",
        "fc2.bias",
        "fc1.weight",
        "fc1.bias",
    )
    said = "forward alike, first differing gradient: of act's output"
    assert_shown(snap, page, document, "act", "backward", said)


def assert_shown(snap, page, document, entered, phase, said):
    """Step AT's not-reproduced verdict, first at `entered` in `phase`, everywhere it is
    shown: the snapshot, the metric the alert reads, top, the summary, the JSON and HTML
    reports (`said`: how the views word where it differed)."""
    mismatch = snap.spike_mismatch
    assert (mismatch.step, mismatch.layer, mismatch.phase) == (AT, entered, phase)
    (info,) = parse(page)["hookprof_spike_mismatch_info"].samples
    assert (info.labels["layer"], info.labels["phase"], info.labels["step"]) == (
        entered,
        phase,
        str(AT),
    )
    (table,) = from_metrics(page)
    latest = f"(latest: step {AT}, {said})"
    assert any(latest in line for line in header_lines([table.header]))
    assert latest in summary_text(snap, "Net")
    event = document["spikes"]["grad_norm_spike"]["first"]
    assert (event["entered"], event["entered_phase"]) == (entered, phase)
    report = "".join(Elements(render([document])).text)
    assert f"the machine ({said})" in report


def test_a_wrong_value_made_in_a_weights_gradient_alone_is_not_reproduced_and_named(judged):
    """fc2's backward makes one row of its weight's gradient wrong on the spike's own
    backward, and every gradient it passes on right: the forward and every layer's output
    gradient replay alike, fc2.weight's gradient does not (before, this read as reproduced:
    the data). With every step sampled, so that a sampled step's own hook on the first
    layer's parameters is on them as the backward ends (it is hookprof's: compared all the
    same). Shown in the event, the metric the alert reads, top, the summary and the report;
    training bit for bit as without hookprof."""
    bare, _ = train(WeightFaultNet, fault="weights")
    norms = bare[1]  # (the test's own: step AT's gradient norm spikes)
    assert norms[AT - 1] > 5 * max(norms[AT - 20 : AT - 1])
    config = {**ARMED, "sample_every": 1}
    watched, (snap, page, document) = train(WeightFaultNet, config=config, fault="weights")
    assert watched == bare
    first = snap.spikes["grad_norm_spike"].first
    assert (first.step, first.verdict) == (AT, "not_reproduced")
    assert (first.entered, first.entered_phase) == ("fc2.weight", "parameter_gradient")
    comparison = judged[AT]
    assert comparison.backward_off is None and comparison.params_off is None
    said = "forward and output gradients alike, first differing: fc2.weight's gradient"
    assert_shown(snap, page, document, "fc2.weight", "parameter_gradient", said)
    assert snap.internal_errors == 0


def test_gradients_a_loop_leaves_in_grad_are_not_compared(judged):
    """Found by review: the parameters' .grad held more than the step's backward made, and a
    spike the data made was called not reproduced (a linear probe whose optimizer trains
    the head alone: the backbone's gradients add up, never zeroed). Only the parameters whose
    .grad was None as the backward began are compared; zero_grad(set_to_none=False) leaves
    none, which is said."""
    probe = dict(trained=lambda m: m.head.parameters())
    bare, _ = train(fault="data", **probe)
    watched, (snap, _, _) = train(config=ARMED, fault="data", **probe)
    assert watched == bare
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    comparison = judged[AT]
    assert comparison.params_off is None
    assert comparison.layers[comparison.params_from :] == ("head.weight", "head.bias")
    judged.clear()
    bare, _ = train(fault="data", set_to_none=False)
    watched, (snap, _, _) = train(config=ARMED, fault="data", set_to_none=False)
    assert watched == bare
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    comparison = judged[AT]
    assert comparison.backward_off is None  # (the layers' output gradients are)
    assert comparison.params_off.endswith(spike_replay.PARAMETERS_ACCUMULATED)


def test_a_parameter_frozen_mid_run_keeps_the_backward_verdict(judged):
    """Found by review: fc1.bias frozen at step 30 keeps a .grad of zeros
    (zero_grad(set_to_none=False)); the replay asked autograd for a gradient of a tensor that
    needs none, which raised and took the whole backward comparison with it, so a machine's
    fault in the backward was called reproduced. A parameter that needs no gradient is not
    taken, and a replay whose backward with the parameters raises runs it without them."""

    def freeze(model, step):
        if step == 30:
            model.fc1.bias.requires_grad_(False)

    bare, _ = train(fault="backward", set_to_none=False, at_step=freeze)
    watched, (snap, _, _) = train(config=ARMED, fault="backward", set_to_none=False, at_step=freeze)
    assert watched == bare
    first = snap.spikes["grad_norm_spike"].first
    assert (first.verdict, first.entered, first.entered_phase) == (
        "not_reproduced",
        "act",
        "backward",
    )


def test_a_parameter_frozen_after_the_spike_leaves_the_others_compared(judged):
    """Found by a second review: fc1.bias frozen as the step after the spike begins (its
    replay runs at that step's update) made the replay's backward raise, and every
    parameter's comparison went: fc2's wrong weight gradient was called reproduced. The
    frozen one is left out, the others compared."""

    def freeze(model, step):
        if step == AT + 1:
            model.fc1.bias.requires_grad_(False)

    bare, _ = train(WeightFaultNet, fault="weights", at_step=freeze)
    watched, (snap, _, _) = train(WeightFaultNet, config=ARMED, fault="weights", at_step=freeze)
    assert watched == bare
    first = snap.spikes["grad_norm_spike"].first
    assert (first.verdict, first.entered, first.entered_phase) == (
        "not_reproduced",
        "fc2.weight",
        "parameter_gradient",
    )
    assert "fc1.bias" not in judged[AT].layers[judged[AT].params_from :]


def _clamp(param):
    param.grad.clamp_(-1.0, 1.0)


def _clamp_after_accumulation(model, step):
    if step == 1:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_clamp)


def test_hooks_of_the_loops_on_parameters_leave_them_out(judged):
    """Found by review: a post-accumulate-grad hook that clamps .grad (it bites on a spike's
    large gradients only) made a spike the data made not reproduced; and a gradient hook the
    loop put on after the spike's step, before its replay, ran in the replay and changed its
    verdict. Either leaves the parameters out of that step's comparison, said; the hooks run
    as often as without hookprof."""
    bare, _ = train(fault="data", at_step=_clamp_after_accumulation)
    watched, (snap, _, _) = train(config=ARMED, fault="data", at_step=_clamp_after_accumulation)
    assert watched == bare
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert judged[AT].params_off == spike_replay.PARAMETER_HOOKS
    judged.clear()

    calls = {"bare": 0, "armed": 0}

    def hook_at_the_next_step(which):
        handles = []

        def at_step(model, step):
            for h in handles:
                h.remove()
            handles.clear()
            if step == AT + 1:
                for p in model.parameters():
                    handles.append(
                        p.register_hook(lambda g: calls.__setitem__(which, calls[which] + 1))
                    )

        return at_step

    bare, _ = train(fault="data", at_step=hook_at_the_next_step("bare"))
    watched, (snap, _, _) = train(
        config=ARMED, fault="data", at_step=hook_at_the_next_step("armed")
    )
    assert watched == bare
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert judged[AT].params_off == spike_replay.PARAMETER_HOOKS
    assert calls["armed"] == calls["bare"] == 6


@pytest.mark.parametrize(
    "make, penalty",
    [
        (Net, 0.0),
        (Net, 1e-3),  # a path into the weights outside the model's output: not compared
        (lambda: Net(checkpointed=True), 0.0),  # the backward recomputes fc2 and act2
        (lambda: Net(dropout=0.2), 0.0),  # the backward uses the forward's masks
    ],
    ids=["plain", "weight-penalty", "checkpointed", "dropout"],
)
def test_a_spike_the_data_made_is_reproduced_forward_and_backward(judged, make, penalty):
    bare, _ = train(make, fault="data", penalty=penalty)
    losses = bare[0]  # (the test's own: step AT's loss spikes)
    assert losses[AT - 1] > 5 * max(losses[AT - 20 : AT - 1])
    watched, (snap, _, _) = train(make, config=ARMED, fault="data", penalty=penalty)
    assert watched == bare
    first = snap.spikes["loss_spike"].first
    assert (first.step, first.verdict, first.entered) == (AT, "reproduced", None)
    assert snap.spike_replays["not_reproduced"] == 0 and snap.internal_errors == 0
    comparison = judged[AT]
    assert comparison.backward_off is None
    backward = comparison.layers[comparison.backward_from : comparison.params_from]
    assert set(backward) == {"head", "drop", "act2", "fc2", "act", "fc1"}
    if penalty:  # (the penalty's gradient reaches the parameters outside the model: said)
        assert comparison.params_from is None
        assert comparison.params_off.startswith(
            "a healthy step's replay (step 1) did not reproduce head.weight's gradient"
        )
        (said,) = [n for n in snap.notices if "the gradient of head.weight" in n]
        assert "weight penalty" in said
    else:
        assert comparison.params_off is None
        params = comparison.layers[comparison.params_from :]
        assert set(params) == {
            f"{m}.{p}" for m in ("fc1", "fc2", "head") for p in ("weight", "bias")
        }


def test_an_output_larger_than_the_parameters_compares_the_forward_only(judged):
    """The gradient of the model's output is kept only when no larger than the parameters
    (the replay's memory at most doubles): here the forward alone is compared, and said."""
    bare, _ = train(Wide, fault="data")
    losses, (snap, _, _) = train(Wide, config=ARMED, fault="data")
    assert losses == bare
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    comparison = judged[AT]
    assert comparison.backward_from is None
    assert comparison.backward_off == spike_replay.GRADIENT_TOO_LARGE


def test_a_fault_in_a_gradient_sum_leaves_the_forward_verdict(monkeypatch, judged):
    """hookprof's own part fails in the backward (one output gradient's sum on the spike's
    step cannot be read: a sparse gradient handed to it): the backward goes on unchanged, the
    fault is counted, and the replay compares the forward only, saying why."""
    from hookprof.step import output_sums

    bare, _ = train(fault="data")
    real, fail = output_sums.OutputSums._gradient, {"now": False}

    def gradient(self, grads, layer, grad):
        if fail["now"]:  # (the first gradient of step AT's own backward)
            fail["now"] = False
            grad = grad.to_sparse()
        return real(self, grads, layer, grad)

    def before_backward(step):
        fail["now"] = step == AT

    monkeypatch.setattr(output_sums.OutputSums, "_gradient", gradient)
    losses, (snap, _, _) = train(config=ARMED, fault="data", before_backward=before_backward)
    assert losses == bare
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert judged[AT].backward_off == spike_replay.GRADIENTS_PARTIAL
    assert snap.internal_errors == 1


def test_a_step_of_two_backwards_is_judged_on_its_forward(judged, monkeypatch):
    """Two backwards through the same outputs (retain_graph): the replay's one backward
    cannot give the same gradients, so the forward's verdict stands and the comparison says
    why (test_spike_replay.py's actor-critic loop, two losses through one forward, went
    from reproduced to not compared before it)."""
    real = torch.Tensor.backward

    def twice(self, *args, **kwargs):
        real(self, retain_graph=True)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", twice)
    bare, _ = train(fault="data")
    watched, (snap, _, _) = train(config=ARMED, fault="data")
    assert watched == bare
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert judged[AT].backward_off == spike_replay.SEVERAL_BACKWARDS


class LossInside(nn.Module):
    """Returns (loss, logits), as a model given its labels does (transformers' style): the
    loss is computed from the logits, so their gradients overlap."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, x, y):
        logits = self.net(x)
        return (logits - y).square().mean(), logits


class AuxLoss(Net):
    """Keeps a term of its hidden activation for the loop to add to its loss (a balance or
    KL term): a gradient into a layer's output that does not come through the model's."""

    def _middle(self, h):
        self.aux = h.square().mean()
        return super()._middle(h)


class Reentrant(Net):
    def forward(self, x):
        h = checkpoint(self._middle, self.act(self.fc1(x)), use_reentrant=True)
        return self.head(self.drop(h))


class InPlace(nn.Module):
    """Linear -> ReLU(inplace) -> Linear: the first layer's output is written over by the
    next (its gradient edge is the one the layer returned)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.head = nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.act(self.fc1(x)))


class InputGrad(nn.Module):
    """A parameter-free first layer, and an input that needs a gradient (adversarial
    training): the first layer's output needs one only because the input does."""

    def __init__(self):
        super().__init__()
        self.scale, self.fc1, self.head = nn.Tanh(), nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(self.scale(x))))


def _inside(model, x, y):
    return model(x, y)[0]


def _aux(model, x, y):
    return (model(x) - y).square().mean() + 1e-3 * model.aux


def _input_grad(model, x, y):
    return (model(x.requires_grad_()) - y).square().mean()


@pytest.mark.parametrize(
    "make, loss_of, off",
    [
        (LossInside, _inside, spike_replay.OUTPUTS_OVERLAP),
        (Reentrant, mse, "the replayed backward raised RuntimeError: When use_reentrant=True"),
        (InPlace, mse, None),
        (InputGrad, _input_grad, None),
    ],
    ids=["loss-inside", "reentrant-checkpoint", "in-place", "input-grad"],
)
def test_models_whose_backward_cannot_or_can_be_replayed(judged, make, loss_of, off):
    """Found by review: a (loss, logits) model got a false not_reproduced (each output's
    whole gradient fed at once counts the shared part twice); reentrant checkpointing refuses
    torch.autograd.grad and cost the spike its verdict. Now the backward is left out, said,
    and the forward's verdict stands; an in-place ReLU over a layer's output and an input
    that needs a gradient are compared."""
    bare, _ = train(make, fault="data", loss_of=loss_of)
    watched, (snap, _, _) = train(make, config=ARMED, fault="data", loss_of=loss_of)
    assert watched == bare
    first = snap.spikes["loss_spike"].first
    assert (first.step, first.verdict) == (AT, "reproduced")
    comparison = judged[AT]
    if off is None:
        assert comparison.backward_off is None and comparison.backward_from is not None
    else:
        # (said by the healthy step's check already: it could not replay the backward)
        assert comparison.backward_from is None and off in comparison.backward_off


def test_a_loop_that_adds_a_gradient_inside_the_model_compares_the_forward_only(judged):
    """Found by review: an auxiliary loss on a hidden activation reaches that layer's output
    gradient outside the model's output, which the replay does not run: every spike's
    backward blamed the machine. A healthy step is replayed first (step 1, once): its
    backward does not reproduce, so the run's spikes are judged on their forward, said once."""
    bare, _ = train(AuxLoss, fault="data", loss_of=_aux)
    watched, (snap, _, _) = train(AuxLoss, config=ARMED, fault="data", loss_of=_aux)
    assert watched == bare
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert judged[AT].backward_from is None
    assert judged[AT].backward_off.startswith("a healthy step's replay (step 1) did not")
    (said,) = [n for n in snap.notices if "healthy step's replay" in n]
    assert "its backward (first at the gradient of act's output)" in said  # (h: act's)


def test_the_replays_backward_runs_no_hook_on_a_parameter_and_keeps_no_gradient(judged):
    """Found by review: the replay's backward ran the loop's own parameter hooks once more
    per replay (and a sampled step's, which then timed the replay as its layer's backward);
    and a loop that keeps its losses kept every step's output gradient alive. Now no
    parameter's gradient is computed in a replay, and the kept gradients go with the step."""
    import gc

    calls = {"bare": 0, "armed": 0}

    def counting(which):
        class Counted(Net):
            def __init__(self):
                super().__init__()
                self.fc1.weight.register_hook(lambda g: calls.__setitem__(which, calls[which] + 1))

        return Counted

    every_step = {**ARMED, "sample_every": 1}
    train(counting("bare"), fault="data")
    kept: list = []
    _, (snap, _, _) = train(counting("armed"), config=every_step, fault="data", kept=kept)
    assert snap.spike_replays["reproduced"] >= 1
    assert calls["armed"] == calls["bare"] == STEPS
    # (so the parameters' own gradients, which the loop's hook would see again, are not
    # compared: said, the layers' output gradients are)
    spiked = judged[max(judged)]
    assert spiked.backward_off is None and spiked.params_off == spike_replay.PARAMETER_HOOKS
    assert any("parameter gradients could be compared" in n for n in snap.notices)
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) is spike_replay._OutputGradients]
    assert len(kept) == STEPS and len(alive) <= 1  # (the last step's, until it is judged)


def test_a_backward_only_difference_writes_no_capsule_that_would_replay_as_reproduced(tmp_path):
    """capsule_dir set: a capsule keeps the forward (`hookprof replay` runs the forward), so
    a spike whose backward alone differed gets none: its forward would replay alike, and the
    capsule would say "reproduced" of a step the replay did not reproduce."""
    _, (snap, _, _) = train(config={**ARMED, "capsule_dir": str(tmp_path)}, fault="backward")
    first = snap.spikes["grad_norm_spike"].first
    assert (first.verdict, first.entered_phase, first.capsule) == (
        "not_reproduced",
        "backward",
        None,
    )
    written = [torch.load(p, weights_only=True)["view"]["step"] for p in tmp_path.iterdir()]
    assert AT not in written and snap.internal_errors == 0


def test_steps_without_an_update_at_the_start_do_not_use_up_the_healthy_steps_check(judged):
    """Found by review: a GradScaler's first skipped steps (no optimizer hook: no replay can
    run them) used up the healthy step's three tries, and a machine's backward fault was
    then called reproduced. Such steps are no try."""
    _, (snap, _, _) = train(config=ARMED, fault="backward", updates_from=4)
    first = snap.spikes["grad_norm_spike"].first
    assert (first.verdict, first.entered, first.entered_phase) == (
        "not_reproduced",
        "act",
        "backward",
    )


def test_a_loss_term_added_after_the_check_is_caught_by_the_next_check(judged, monkeypatch):
    """Found by review: the healthy step's check ran once, so an auxiliary term the loop adds
    from step 10 on (after its warm-up) made the spike's backward blame the machine. A
    trusted backward is checked again every RECHECK_STEPS (1,000; 20 here)."""
    monkeypatch.setattr(spike_replay, "RECHECK_STEPS", 20)

    def aux_from_10(model, x, y):
        loss = (model(x) - y).square().mean()
        model.steps = getattr(model, "steps", 0) + 1
        return loss + 1e-3 * model.aux if model.steps >= 10 else loss

    _, (snap, _, _) = train(AuxLoss, config=ARMED, fault="data", loss_of=aux_from_10)
    assert snap.spikes["loss_spike"].first.verdict == "reproduced"
    assert judged[AT].backward_from is None
    assert judged[AT].backward_off.startswith("a healthy step's replay (step 2")


def test_every_step_a_touchy_rule_replays_in_a_healthy_run_reproduces_with_its_parameters(
    judged,
):
    """No false machine verdicts from the parameters' comparison on the loop most runs use:
    AdamW with weight decay, warm-up, clip_grad_norm_ after the backward, LayerNorm, every
    4th step sampled. The spike rules made touchy (z 1.5) so that the gate lets many healthy
    steps through: each is replayed and each must be reproduced, forward, output gradients
    and every parameter's gradient compared; training the same bit for bit."""
    import math

    def run(config):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh(),
            nn.Linear(64, 4),
        )  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        warm = 50
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        g = torch.Generator().manual_seed(3)
        target = torch.randn(16, 4, generator=g)
        prof = hookprof.attach(model, **config) if config is not None else None
        losses = []
        try:
            for _ in range(400):
                x = torch.randn(32, 16, generator=g)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), (x @ target).argmax(1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                schedule.step()
                if prof is not None:
                    prof.step(loss)
                losses.append(loss.item())
            if prof is None:
                return losses, None
            prof.flush()
            return losses, prof.snapshot()
        finally:
            if prof is not None:
                prof.detach()

    touchy = {**ARMED, "loss_spike_z": 1.5, "grad_norm_spike_z": 1.5}
    bare, _ = run(None)
    watched, snap = run(touchy)
    assert watched == bare and all(map(math.isfinite, bare))
    assert len(judged) >= 10  # (the gate let that many healthy steps through)
    assert snap.spike_replays["not_reproduced"] == 0 and snap.internal_errors == 0
    for comparison in judged.values():
        assert comparison.refused is None and comparison.backward_off is None
        assert comparison.params_off is None, comparison.params_off
        assert len(comparison.layers) - comparison.params_from == 8  # (3 Linear, 1 LayerNorm: w, b)
