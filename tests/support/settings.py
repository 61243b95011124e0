"""Config overrides most tests attach with. Fresh dicts where a test may add to them; the
constants are only ever spread (`**RARELY`), never changed."""

from __future__ import annotations

# every step sampled, at once, on a free port
EVERY_STEP = dict(port=0, sample_every=1, min_sample_interval_s=0.0)
# step 1 sampled only, however slow a loaded machine makes the steps
RARELY = dict(port=0, sample_every=1000, min_sample_interval_s=3600.0)


def every_step(**more) -> dict:
    """EVERY_STEP with activation statistics on every sampled step too, and `more` (the
    `every_step` fixture; a module marked `@pytest.mark.every_step(**more)` adds to it)."""
    return {**EVERY_STEP, "activation_interval_s": 0.0, **more}
