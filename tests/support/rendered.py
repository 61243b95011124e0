"""What hookprof renders for people, read back: the run report's HTML elements and chart
lines, numbers as table cells and charts write them (the report, `hookprof top`), and the
demo run the report tests render."""

from __future__ import annotations

import math
from html.parser import HTMLParser

import torch

import hookprof
from hookprof.demo import DemoNet, InjectNonFinite

NAN_STEP = 40
STEPS = 60


class Elements(HTMLParser):
    """Every start tag with its attributes, and the text of the page."""

    def __init__(self, page: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [
            a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items())
        ]


def line_of(el: Elements, svg: dict) -> dict:
    """The attributes of the line a chart (`svg`, one of el.find("svg")) draws."""
    seen = False
    for _tag, attrs in el.tags:
        if attrs is svg:
            seen = True
        elif seen and attrs.get("class") == "line":
            return attrs
    raise AssertionError("chart without a line")


def inside(el: Elements, svg: dict, tag: str, cls: str) -> list[dict]:
    """The `tag` elements of class `cls` inside one chart (`svg`, one of el.find("svg"))."""
    seen, found = False, []
    for t, attrs in el.tags:
        if attrs is svg:
            seen = True
        elif seen and t == "svg":
            break
        elif seen and t == tag and attrs.get("class") == cls:
            found.append(attrs)
    return found


def number(text: str) -> float | None:
    """A number as hookprof renders it: "-" is none, "NaN/Inf" a non-finite value (inf), a
    trailing % is dropped (top's shares)."""
    return None if text == "-" else math.inf if text == "NaN/Inf" else float(text.rstrip("%"))


def demo_run(steps: int = STEPS, nan_at: int = NAN_STEP, **overrides):
    """DemoNet trained with every step sampled; mlp.0 outputs NaN at `nan_at`. Returns the
    profiler (attached) and each step's loss as the loop saw it. Under on_nonfinite="raise"
    the loop ends where hookprof raised (the losses of the steps before it)."""
    torch.manual_seed(0)
    model = DemoNet()
    injector = InjectNonFinite(dict(model.named_modules())["mlp.0"], {nan_at}, count_calls=False)
    prof = hookprof.attach(
        model, **{"port": 0, "sample_every": 1, "min_sample_interval_s": 0.0, **overrides}
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    losses = []
    try:
        for step in range(1, steps + 1):
            injector.step = step
            tokens, labels = model.batch(generator)
            loss = torch.nn.functional.cross_entropy(model(tokens), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            prof.step(loss)
            losses.append(loss.item())
    except hookprof.NonFiniteError:
        if overrides.get("on_nonfinite") != "raise":
            raise
    prof.flush()
    return prof, losses
