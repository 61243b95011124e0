"""Every place hookprof reports a fault from is counted under a part of its own in
hookprof_internal_errors_total (faults.part_of), never under "other": found by reading the
package's source (the first argument of every `report`, `contain` and `guarded` call, and the
thread names the supervisor watches, whose faults read "<name> thread ...")."""

from __future__ import annotations

import ast
import pathlib

import hookprof
from hookprof.faults import PARTS, Faults, part_of

PACKAGE = pathlib.Path(hookprof.__file__).parent


def reported_wheres() -> dict[str, str]:
    """{where (an f-string's leading text), file:line} for every fault reported in the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name not in ("report", "contain", "guarded", "watch"):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                where = first.value
            elif isinstance(first, ast.JoinedStr) and isinstance(first.values[0], ast.Constant):
                where = first.values[0].value
            else:
                continue  # "{what} thread ...": `what` is a watched name, found as watch("...")
            found[where] = f"{path.relative_to(PACKAGE)}:{node.lineno}"
    return found


def test_every_reported_fault_has_a_part_of_its_own():
    wheres = reported_wheres()
    # the scan sees the package (a broken scan would find nothing and prove nothing)
    assert {
        "forward hook",
        "root forward hook",
        "publisher",
        "stall watch",
        "metrics server",
        "summary",
    } <= set(wheres)
    unclaimed = {w: at for w, at in wheres.items() if part_of(w) == "other"}
    assert unclaimed == {}


def test_faults_count_each_report_under_its_part_and_in_the_total():
    faults = Faults()
    for where in (
        "forward pre-hook",
        "forward hook",
        "layer statistic dead_ratio",
        "publisher thread (restart 1)",
        "nonfinite dump (/x/y.json)",
        "metrics server thread restart",
    ):
        faults.report(where, RuntimeError("injected"), disable=False)
    assert faults.errors == 6 == sum(faults.by_part.values())
    assert faults.by_part == {
        **dict.fromkeys(PARTS, 0),
        "layer hooks": 2,
        "layer statistics": 1,
        "publisher": 1,
        "nonfinite": 1,
        "metrics server": 1,
    }
