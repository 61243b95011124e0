"""Issue 29 item 8: model surgery after attach() (a head added, LoRA adapters injected,
load_state_dict(assign=True)) puts Parameter objects in the model that hookprof did not see at
attach. Steps are still counted (the optimizer steps the model as it is now), and one notice
names the parameters the layer table does not cover and how to re-attach.

peft is not installed in the test environment: `inject_lora` does what
`peft.get_peft_model(model, LoraConfig(target_modules=[...]))` does to the model: the target
Linear becomes a module holding it as `base_layer` plus new low-rank `lora_A` / `lora_B`
Linears, every other parameter is frozen, and the returned wrapper calls the model's
`forward` directly (peft's LoraModel.forward), never through its root hooks."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import hookprof

NOTICE = "changed after attach()"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.heads = nn.ModuleList()  # heads added later are applied after `out`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.out(torch.relu(self.body(x)))
        for head in self.heads:
            x = head(x)
        return x


class LoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Linear, r: int = 2) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base_layer.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base_layer.out_features, bias=False)})
        nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class PeftLike(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model.forward(x)  # as peft's LoraModel: not through model.__call__


def inject_lora(model: Net) -> PeftLike:
    for p in model.parameters():
        p.requires_grad_(False)
    model.body = LoraLinear(model.body)
    return PeftLike(model)


def run(forward, params, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(params, lr=0.05)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(8, 8, generator=g)
        forward(x).pow(2).mean().backward()
        opt.step()


def said(caplog, snap) -> list[str]:
    """The notice, checked to be logged once and kept once in the snapshot."""
    lines = [r.getMessage() for r in caplog.records if NOTICE in r.getMessage()]
    kept = [n for n in snap.notices if NOTICE in n]
    assert len(lines) == 1 and kept == [lines[0].removeprefix("hookprof: ")]
    assert "prof.detach(); prof = hookprof.attach(model)" in kept[0]
    return kept


def after_surgery(caplog, surgery, steps: int):
    """Attach to a Net, operate on it (`surgery(model)` returns what the loop calls and the
    parameters its optimizer steps), train `steps` steps: the snapshot."""
    torch.manual_seed(0)
    model = Net()
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        with hookprof.attach(model, serve=False, sample_every=1) as prof:
            forward, params = surgery(model)
            run(forward, params, steps)
            prof.flush()
            snap = prof.snapshot()
    return snap


def add_head(model: Net):
    model.heads.append(nn.Linear(4, 3))
    return model, model.parameters()


def lora(model: Net):
    peft_model = inject_lora(model)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert len(trainable) == 2  # only the adapters: none of them known at attach
    return peft_model, trainable


def assign_state(model: Net):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new Parameter objects
    return model, model.parameters()


@pytest.mark.parametrize(
    "surgery, steps, new",
    [
        (
            add_head,
            3,
            "2 of its parameters that were not there at attach (heads.0.weight, heads.0.bias)",
        ),
        # 0 of 6 steps counted before
        (
            lora,
            6,
            "2 of its parameters that were not there at attach "
            "(body.lora_A.default.weight, body.lora_B.default.weight)",
        ),
        # 0 of 4 steps counted before
        (
            assign_state,
            4,
            "4 of its parameters that were not there at attach "
            "(body.weight, body.bias, out.weight, out.bias)",
        ),
    ],
    ids=["head added", "LoRA injected", "load_state_dict assign"],
)
def test_surgery_after_attach_counts_every_step_and_names_what_is_not_covered(
    caplog, surgery, steps, new
):
    snap = after_surgery(caplog, surgery, steps)
    assert snap.step == steps
    (notice,) = said(caplog, snap)
    assert f"an optimizer steps {new}" in notice


def test_unchanged_model_says_nothing(caplog):
    """The scan is for optimizers over parameters unknown at attach only: a plain run, and
    an optimizer over another model's parameters, say nothing and count what they did."""
    torch.manual_seed(0)
    model, other = Net(), Net()
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        with hookprof.attach(model, serve=False, sample_every=1) as prof:
            run(model, model.parameters(), 3)
            run(other, other.parameters(), 2)  # not this model's: no step of it
            prof.flush()
            snap = prof.snapshot()
    assert snap.step == 3
    assert not [n for n in snap.notices if NOTICE in n]
    assert not [r for r in caplog.records if NOTICE in r.getMessage()]
