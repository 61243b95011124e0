"""Reading a /metrics page back: fetched over real HTTP, parsed with prometheus_client's own
parser, samples keyed by their labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        return response.read().decode()


def parse(text: str) -> dict:
    """name -> Metric (prometheus_client.parser), counters under their name without _total."""
    return {family.name: family for family in text_string_to_metric_families(text)}


ONE_MODEL = object()


def samples(families: dict, name: str, sample_name: str | None = None, *, model=ONE_MODEL) -> dict:
    """{frozenset(labels.items()): value} for one family's samples named sample_name
    ({} when the family is absent). Per-model series carry a `model` label: by default the
    page must hold a single model, whose label is left out of the keys (checked, so two
    models never collapse onto one key); `model="G"` keeps G's samples, label left out;
    `model=None` keeps every label."""
    sample_name = sample_name or name
    if name not in families:
        return {}
    out, models = {}, set()
    for s in families[name].samples:
        if s.name != sample_name:
            continue
        labels = dict(s.labels)
        if model is not None and "model" in labels:
            which = labels.pop("model")
            if model is ONE_MODEL:
                models.add(which)
            elif which != model:
                continue
        out[frozenset(labels.items())] = s.value
    assert len(models) <= 1, f"{name}: models {sorted(models)} on one page: pass model=..."
    return out


def errors_by_part(families: dict, rank: str = "0", *, model=ONE_MODEL) -> dict[str, float]:
    """{part: count} of hookprof_internal_errors_total for one rank (faults.PARTS: every part
    is on the page, 0 included)."""
    out = {}
    for labels, value in samples(
        families, "hookprof_internal_errors", "hookprof_internal_errors_total", model=model
    ).items():
        labels = dict(labels)
        if labels["rank"] == rank:
            out[labels["part"]] = value
    return out
