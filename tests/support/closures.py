"""Closure steps, `optimizer.step(closure)` with the forward and backward inside the closure:
the loop, a hand-written sharpness-aware optimizer (SAM) as closure optimizers are written,
and the closure optimizers the NaN-guard tests run (LBFGS, SAM)."""

from __future__ import annotations

import torch

from support.models import loss_of


def closure_loop(
    model,
    opt,
    steps: int,
    injector=None,
    *,
    hide_nonfinite: bool = False,
    skip_steps: frozenset = frozenset(),
    stop_before: int | None = None,
    closure_returns_loss: bool = True,
) -> list:
    """`opt.step(closure)` each step, the closure doing zero_grad, forward and backward.
    `hide_nonfinite`: the reference's own skip (a non-finite evaluation leaves no gradient,
    which every torch.optim optimizer takes as "leave this parameter and its state alone").
    Returns what each opt.step returned, with what its closure returned first."""
    g = torch.Generator().manual_seed(0)
    returned = []
    for step in range(1, steps + 1):
        batch = model.batch(g)
        if step == stop_before:
            return returned
        if step in skip_steps:
            continue
        calls = [0]
        results = []

        def closure(step=step, batch=batch, calls=calls, results=results):
            calls[0] += 1
            if injector is not None:
                injector.step = (step, calls[0])
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, batch)
            loss.backward()
            if hide_nonfinite and not torch.isfinite(loss):
                for p in model.parameters():
                    p.grad = None
            results.append(loss)
            return loss if closure_returns_loss else None

        out = opt.step(closure)
        returned.append((results[0], out))
    return returned


class SharpnessAware(torch.optim.Optimizer):
    """SAM (Foret et al., 2021) as closure optimizers are written: evaluate at w, climb to
    w + rho * g / |g|, evaluate there, come back, and take a momentum SGD step with the
    gradient found up there. Like torch.optim, it leaves a parameter without a gradient alone."""

    def __init__(self, params, lr: float = 0.05, rho: float = 0.05, momentum: float = 0.9):
        super().__init__(params, dict(lr=lr, rho=rho, momentum=momentum))

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            loss = closure()
        with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        climbs = []
        if with_grad:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in with_grad])
            )
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        climb = p.grad * (group["rho"] / (norm + 1e-12))
                        p.add_(climb)
                        climbs.append((p, climb))
        with torch.enable_grad():
            closure()
        for p, climb in climbs:
            p.sub_(climb)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = p.grad.clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
        return loss


OPTIMIZERS = {
    "lbfgs": lambda m: torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=4),
    "lbfgs strong_wolfe": lambda m: torch.optim.LBFGS(
        m.parameters(), lr=0.5, max_iter=4, line_search_fn="strong_wolfe"
    ),
    "sam": lambda m: SharpnessAware(m.parameters()),
}
