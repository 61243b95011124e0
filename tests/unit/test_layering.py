"""hookprof's layers, kept by a test: the table below is the documentation of the package's layout.

Every import of a hookprof module counts, wherever it is written: at the top of a module,
lazily inside a function, or under `if TYPE_CHECKING:`. A module may import modules of its own
layer and of any layer below it. Three things fail:
  - an import of a higher layer (a lower layer must not know who builds on it);
  - one feature package importing another (nonfinite, efficiency and phases are independent
    parts; what two of them share goes below them, what combines them sits above them);
  - an import cycle between hookprof modules, lazy and TYPE_CHECKING imports included.
A module that no row of LAYERS names fails too: add it to the table when you add it.

The checker itself is tests/support/layering.py (standard library only; it never imports
hookprof, so a broken graph is reported rather than crashing the test).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.layering import (
    Layer,
    collect_imports,
    cycles,
    layer_of,
    module_names,
    reaches,
    unclassified,
    upward,
)

HOOKPROF = Path(__file__).resolve().parents[2] / "hookprof"
HERE = "tests/unit/test_layering.py"

# lowest first. Members are top-level modules of hookprof/ or its subpackages (a subpackage's
# modules, at any depth, are in its row). "__init__" is hookprof/__init__.py: `import hookprof`.
LAYERS = (
    Layer(
        "foundations",
        (
            "_version",
            "config",
            "errors",
            "snapshot",  # the public surface's data types
            "faults",
            "notices",
            "layers",
            "tensors",
            "compiled",
            "distributed",
            "metrics_names",  # every exported name, label and unit (issue 27; may not exist yet)
            "files",  # the one atomic, no-follow writer of every file hookprof writes (issue 29)
            "handles",  # the one undo style: Handle, HandleGroup (issue 40)
        ),
    ),
    Layer("device", ("device",)),  # the only host<->device seam
    Layer("step", ("step",)),  # hooks, the sampled step's record, plan, gradients
    Layer("features", ("nonfinite", "efficiency", "phases", "integrity"), independent=True),
    Layer("publish", ("publish",)),  # the publisher thread: aggregate, history, the document
    Layer("serve", ("serve",)),  # the endpoint: httpd, exporter, server
    Layer("view", ("view",)),  # what a person reads: table, summary, top, report
    Layer(
        "wiring",
        (
            "__init__",
            "profiler",
            "step_events",  # the life of a step as calls to the parts (issue 40)
            "live",
            "disabled",
            "cli",
            "demo",
            "_testing",
            "integrations",
        ),
    ),
)

# imports that break a rule on purpose, each with its reason. Keep this list short: an entry
# that is no longer needed fails test_allowed_imports_are_still_needed.
EXCEPTIONS: dict[tuple[str, str], str] = {
    (
        "hookprof.snapshot",
        "hookprof.view.table",
    ): "str(snapshot) is public API and prints the per-layer table: a lazy import inside "
    "Snapshot.__str__, so the table's code loads only when a snapshot is printed",
}

ALLOWED = EXCEPTIONS

HOW_TO_FIX = (
    "To fix it: move what both need down to a layer both may import; or have the caller pass "
    "the collaborator in (a constructor argument), typed by a small Protocol in the lower "
    "module or a string annotation, instead of importing the higher one; or, when the lower "
    "module calls the higher one only to produce output, let the higher layer make that call. "
    f"Only if none of these can work, add (importer, imported) to EXCEPTIONS in {HERE} with "
    "the reason."
)


def may_import(layer: Layer) -> str:
    rank = LAYERS.index(layer)
    own = (
        f"its own package (not the other packages of '{layer.name}')"
        if layer.independent
        else f"its own layer ({layer.name})"
    )
    if rank == 0:
        return f"'{layer.name}' may import only {own}"
    below = ", ".join(lower.name for lower in LAYERS[:rank])
    return f"'{layer.name}' may import {own} and the layers below it: {below}"


def unclassified_messages(root: Path) -> list[str]:
    by_unit: dict[str, list[str]] = {}
    for module in unclassified(root, LAYERS):
        by_unit.setdefault(module.split(".")[1], []).append(module)
    return [
        f"{', '.join(modules)} in no layer. Add '{unit}' to the right row of LAYERS in {HERE} "
        "(lowest layer first): that table is the documentation of hookprof's layout, so every "
        "top-level module and subpackage is named there."
        for unit, modules in by_unit.items()
    ]


def upward_messages(root: Path, allowed=ALLOWED) -> list[str]:
    messages = []
    for imp, why in upward(collect_imports(root), LAYERS, allowed):
        layer = layer_of(imp.importer, LAYERS)[1]
        messages.append(
            f"{imp.where()}: {imp.importer} imports {imp.imported}: {why}. "
            f"{may_import(layer)} (LAYERS in {HERE}). {HOW_TO_FIX}"
        )
    return messages


def cycle_messages(root: Path, allowed=ALLOWED) -> list[str]:
    messages = []
    for cycle in cycles(collect_imports(root), allowed):
        chain = " -> ".join(f"{imp.importer} [{imp.where()}]" for imp in cycle)
        messages.append(
            f"import cycle: {chain} -> {cycle[0].importer}. Lazy and TYPE_CHECKING imports "
            "count: they still tie the modules together, and one of these modules knows about "
            f"code that should depend on it. Break one link. {HOW_TO_FIX}"
        )
    return messages


def test_every_module_is_in_the_table():
    messages = unclassified_messages(HOOKPROF)
    assert not messages, "\n\n".join(messages)


def test_no_module_imports_a_higher_layer_or_a_sibling_feature():
    messages = upward_messages(HOOKPROF)
    assert not messages, "\n\n".join(messages)


def test_no_import_cycle():
    messages = cycle_messages(HOOKPROF)
    assert not messages, "\n\n".join(messages)


def stale_allowed(root: Path, allowed: dict[tuple[str, str], str]) -> list[str]:
    """Allowed imports that are no longer written, or would break no rule if they were not
    allowed: the lists stay the exact record of what breaks the layout, and why."""
    imports = collect_imports(root)
    stale = []
    for edge, reason in allowed.items():
        written = [imp for imp in imports if imp.edge == edge]
        breaks_a_layer = bool(upward(written, LAYERS, ()))
        closes_a_cycle = reaches(imports, edge[1], edge[0], set(allowed) - {edge})
        if not written or not (breaks_a_layer or closes_a_cycle):
            stale.append(f"{edge[0]} -> {edge[1]} ({reason})")
    return stale


def test_allowed_imports_are_still_needed():
    stale = stale_allowed(HOOKPROF, ALLOWED)
    assert not stale, f"no longer needed: delete from EXCEPTIONS in {HERE}:\n" + "\n".join(stale)


def test_the_checker_reads_the_real_package():
    # the tests above pass vacuously if HOOKPROF points nowhere (say, after this file moves)
    assert (HOOKPROF / "__init__.py").is_file()
    names = set(module_names(HOOKPROF))
    assert {"hookprof", "hookprof.config", "hookprof.device.transfer"} <= names
    assert ("hookprof", "hookprof.config") in {imp.edge for imp in collect_imports(HOOKPROF)}


# ---------------------------------------------------------------- the test can fail


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    # the copy keeps the name hookprof so module names, EXCEPTIONS and PENDING still match
    target = tmp_path / "hookprof"
    shutil.copytree(HOOKPROF, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def add(copy: Path, module: str, code: str) -> None:
    # appended at the end, so the line numbers in messages about the untouched code stay put
    path = copy / module
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    path.write_text(old + "\n" + code + "\n", encoding="utf-8")


def new_messages(check, copy: Path, module: str, code: str) -> list[str]:
    # only what the added import causes: these tests prove the checker, whatever today's tree holds
    before = set(check(copy))
    add(copy, module, code)
    return [m for m in check(copy) if m not in before]


def only_message(messages: list[str], *names: str) -> str:
    assert len(messages) == 1, messages
    for name in names:
        assert name in messages[0], (name, messages[0])
    return messages[0]


def test_fails_when_device_imports_view(copy):
    found = new_messages(
        upward_messages, copy, "device/timing.py", "from hookprof.view import table"
    )
    text = only_message(found, "hookprof.device.timing", "hookprof.view.table")
    assert "hookprof/device/timing.py:" in text
    assert "layer 'device' imports the higher layer 'view'" in text
    assert "'device' may import its own layer (device) and the layers below it: foundations" in text


def test_fails_when_a_feature_package_imports_another(copy):
    # lazily, inside a function: still an import
    found = new_messages(
        upward_messages,
        copy,
        "efficiency/flops.py",
        "def _late():\n    import hookprof.phases.clock",
    )
    text = only_message(found, "hookprof.efficiency.flops", "hookprof.phases.clock")
    assert "'efficiency' and 'phases' are both in layer 'features'" in text


@pytest.mark.parametrize(
    "code, kind",
    [
        ("def _late():\n    from hookprof.device import transfer", "lazy (inside a function)"),
        (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from hookprof.device.transfer import peek",
            "under TYPE_CHECKING",
        ),
    ],
)
def test_fails_on_a_two_module_cycle(copy, code, kind):
    # transfer imports streams at the top; streams importing transfer back closes a cycle
    # inside one layer, which no layer rule catches
    layer_messages = upward_messages(copy)
    found = new_messages(cycle_messages, copy, "device/streams.py", code)
    text = only_message(found, "hookprof.device.streams", "hookprof.device.transfer")
    assert "hookprof/device/streams.py:" in text and kind in text
    assert "hookprof/device/transfer.py:" in text
    assert upward_messages(copy) == layer_messages  # only the cycle check catches this one


def test_fails_on_a_module_missing_from_the_table(copy):
    # a new file is a new module: add() creates it
    found = new_messages(
        unclassified_messages, copy, "newthing.py", '"""A module nobody placed."""'
    )
    text = only_message(found, "hookprof.newthing")
    assert f"Add 'newthing' to the right row of LAYERS in {HERE}" in text


def test_a_relative_import_of_a_submodule_is_resolved(copy):
    found = new_messages(upward_messages, copy, "device/timing.py", "from ..view import table")
    only_message(found, "hookprof.device.timing", "hookprof.view.table")


def test_an_allowed_import_that_breaks_nothing_is_reported_stale():
    allowed = {
        ("hookprof", "hookprof.config"): "downward: needs no exception",
        ("hookprof.config", "hookprof.cli"): "written nowhere",
    }
    assert stale_allowed(HOOKPROF, allowed) == [
        "hookprof -> hookprof.config (downward: needs no exception)",
        "hookprof.config -> hookprof.cli (written nowhere)",
    ]
