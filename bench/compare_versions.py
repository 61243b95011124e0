"""Has a change made hookprof slower? Overhead of two versions of hookprof, side by side.

    python bench/compare_versions.py --base HEAD                  # HEAD against the working tree
    python bench/compare_versions.py --base HEAD~3 --head HEAD --rounds 6 --out /tmp/cmp.json

The base (REV) is checked out into a temporary `git worktree`; the head is a directory (default:
the checkout this script lives in, uncommitted changes included) or a revision, which gets a
worktree of its own. Temporary worktrees are removed at the end, on failure and on Ctrl-C too.

Each round runs bench/overhead.py once per version, each in its own process with PYTHONPATH set
to that version's checkout, the base first in even rounds and the head first in odd ones, so
that drifts in the machine's speed fall on both alike (use an even number of rounds). Each
version runs its own bench/overhead.py when both have one. Printed per workload and
configuration: each version's median step time over rounds, new/old (ratio of those medians,
and the median of the per-round ratios with their range), and each version's ratio to "none"
(no hookprof) in its own process. The "none" row is the noise floor: it runs no hookprof code, so
its new/old is what two identical runs differ by on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in each child. Imports hookprof before overhead.py does and refuses to go on unless it
# came from the version under test: overhead.py puts its own checkout first on sys.path, and the
# venv has an editable install of /work/main, so a wrong import would pass silently. Once
# hookprof is in sys.modules its submodules load from the same package directory.
CHILD = r"""
import os, runpy, sys
root, script = os.path.realpath(sys.argv[1]), sys.argv[2]

def wrong_modules():
    return [f"{n}: {m.__file__}" for n, m in list(sys.modules.items())
            if (n == "hookprof" or n.startswith("hookprof.")) and getattr(m, "__file__", None)
            and not os.path.realpath(m.__file__).startswith(root + os.sep)]

import hookprof
print("HOOKPROF_FILE", os.path.realpath(hookprof.__file__), flush=True)
if wrong_modules():
    sys.exit(f"wrong hookprof imported, expected one under {root}: {wrong_modules()}")
sys.argv = [script] + sys.argv[3:]
try:
    runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code
if wrong_modules():
    sys.exit(f"overhead.py imported hookprof modules from elsewhere: {wrong_modules()}")
sys.exit(code)
"""


def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def add_worktree(rev: str, into: str) -> str:
    try:
        sha = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"not a commit in {ROOT}: {rev}") from None
    git("worktree", "add", "--detach", "--quiet", into, sha)
    return sha


def without(argv: list[str], *options: str) -> list[str]:
    """`argv` less each of `options` and its value ("--against REV" or "--against=REV"): a
    script's own command line, to pass on to the processes `alternate` starts."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(o + "=" for o in options)):
            out.append(arg)
    return out


def alternate(script: str, rev: str, rounds: int, args: list[str] = ()) -> dict[str, list]:
    """`script *args --json OUT` in its own process per version (`rev` in a temporary
    worktree, and the checkout `script` lives in) and round, alternating which goes first,
    with PYTHONPATH and HOOKPROF_ROOT set to that version: {rev: [each round's JSON],
    "this checkout": [...]}. The one way bench/ runs another version (bench/parts.py
    --against, bench/host_cost.py --against); the temporary worktree goes at the end."""
    tmp = tempfile.mkdtemp(prefix="hookprof-alternate-")
    base = os.path.join(tmp, "base")
    add_worktree(rev, base)
    runs: dict[str, list] = {rev: [], "this checkout": []}
    try:
        versions = [(rev, base), ("this checkout", ROOT)]
        for r in range(rounds):
            for label, root in versions if r % 2 == 0 else versions[::-1]:
                out = os.path.join(tmp, "out.json")
                env = dict(os.environ, HOOKPROF_ROOT=root, PYTHONPATH=root)
                subprocess.run(
                    [sys.executable, os.path.abspath(script), *args, "--json", out],
                    env=env,
                    check=True,
                )
                with open(out) as f:
                    runs[label].append(json.load(f))
        return runs
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base], cwd=ROOT, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def describe(path: str) -> str:
    """Commit of a directory, marked when it has uncommitted changes (or '?' outside git)."""
    try:
        sha = git("rev-parse", "HEAD", cwd=path)
        dirty = git("status", "--porcelain", "--untracked-files=no", cwd=path)
    except subprocess.CalledProcessError:
        return "?"
    return sha + (" + uncommitted changes" if dirty else "")


def run_overhead(label: str, checkout: str, script: str, args, out: str, scratch: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = checkout + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [
        sys.executable,
        "-c",
        CHILD,
        checkout,
        script,
        "--rounds",
        str(args.child_rounds),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--workloads",
        args.workloads,
        "--skip-many-layers",
        "--out",
        out,
    ]
    # cwd is the scratch directory: with -c, sys.path[0] is the cwd, and a checkout there would
    # import hookprof without PYTHONPATH's help and hide a PYTHONPATH that does not win
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    found = [
        line.split(" ", 1)[1] for line in p.stdout.splitlines() if line.startswith("HOOKPROF_FILE ")
    ]
    if p.returncode != 0 or not found:
        raise RuntimeError(
            f"{label}: overhead.py failed (exit {p.returncode}) in {checkout}\n"
            f"--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
        )
    with open(out) as f:
        data = json.load(f)
    keys = args.workloads.split(",")
    if len(data.get("workloads", [])) != len(keys):
        raise RuntimeError(
            f"{label}: {out} has {len(data.get('workloads', []))} workloads, expected {keys}"
        )
    return {
        "hookprof_file": found[0],
        "seconds": seconds,
        "workloads": {k: w for k, w in zip(keys, data["workloads"])},
    }


def summarise(runs: dict[str, list[dict]], workload: str) -> dict:
    old = [r["workloads"][workload] for r in runs["old"]]
    new = [r["workloads"][workload] for r in runs["new"]]
    out = {}
    for c in old[0]["step_ms"]:
        o = [r["step_ms"][c] for r in old]
        n = [r["step_ms"][c] for r in new]
        per_round = [b / a for a, b in zip(o, n)]
        # ratio to "none" in the same process: removes whatever makes one process as a whole
        # faster than another, leaving hookprof's own cost
        ox = [r["step_ms"][c] / r["step_ms"]["none"] for r in old]
        nx = [r["step_ms"][c] / r["step_ms"]["none"] for r in new]
        out[c] = {
            "old_ms": statistics.median(o),
            "new_ms": statistics.median(n),
            "ratio": statistics.median(n) / statistics.median(o),
            "paired_ratio": statistics.median(per_round),
            "round_ratio_min": min(per_round),
            "round_ratio_max": max(per_round),
            "old_x_none": statistics.median(ox),
            "new_x_none": statistics.median(nx),
            "x_none_paired_ratio": statistics.median(b / a for a, b in zip(ox, nx)),
        }
    return out


def print_table(key: str, name: str, s: dict, rounds: int) -> None:
    print(f"\n{key}: {name}; step time, median over {rounds} rounds")
    head = (
        f"{'configuration':<20} {'old ms':>8} {'new ms':>8} {'new/old':>8} {'paired':>7} "
        f"{'round range':>12} {'old xnone':>9} {'new xnone':>9} {'xnone new/old':>13}"
    )
    print(head)
    print("-" * len(head))
    for c, v in s.items():
        print(
            f"{c:<20} {v['old_ms']:8.2f} {v['new_ms']:8.2f} {v['ratio']:8.3f} {v['paired_ratio']:7.3f} "
            f"{v['round_ratio_min']:5.3f}-{v['round_ratio_max']:5.3f} {v['old_x_none']:9.3f} "
            f"{v['new_x_none']:9.3f} {v['x_none_paired_ratio']:13.3f}"
        )
    none = s["none"]
    print(
        f"noise: 'none' runs no hookprof code, yet new/old = {none['paired_ratio']:.3f} paired "
        f"(rounds {none['round_ratio_min']:.3f}-{none['round_ratio_max']:.3f}); read differences "
        f"smaller than that spread as noise"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="old version: a git revision")
    parser.add_argument(
        "--head",
        default=ROOT,
        help="new version: a directory or a git revision (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="overhead.py runs per version (default 4, keep it even)",
    )
    parser.add_argument("--workloads", default="mlp", help="passed to overhead.py (default mlp)")
    parser.add_argument(
        "--child-rounds", type=int, default=5, help="overhead.py --rounds (default 5)"
    )
    parser.add_argument("--steps", type=int, default=5, help="overhead.py --steps (default 5)")
    parser.add_argument("--warmup", type=int, default=5, help="overhead.py --warmup (default 5)")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args(argv)

    # SIGTERM should clean up like Ctrl-C does: turn it into an exception that unwinds through finally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scratch = tempfile.mkdtemp(prefix="hookprof-compare-")
    worktrees: list[str] = []
    try:
        versions = {}
        path = os.path.join(scratch, "old")
        worktrees.append(path)
        versions["old"] = {
            "spec": args.base,
            "checkout": path,
            "commit": add_worktree(args.base, path),
        }
        if os.path.isdir(args.head):
            path = os.path.abspath(args.head)
            versions["new"] = {"spec": args.head, "checkout": path, "commit": describe(path)}
        else:
            path = os.path.join(scratch, "new")
            worktrees.append(path)
            versions["new"] = {
                "spec": args.head,
                "checkout": path,
                "commit": add_worktree(args.head, path),
            }
        for v in versions.values():
            if not os.path.isfile(os.path.join(v["checkout"], "hookprof", "__init__.py")):
                raise SystemExit(f"no hookprof package in {v['checkout']}")

        # each version's own overhead.py if both have one, else the one that exists for both
        scripts = {
            k: os.path.join(v["checkout"], "bench", "overhead.py") for k, v in versions.items()
        }
        have = [s for s in scripts.values() if os.path.isfile(s)]
        if not have:
            raise SystemExit("neither version has bench/overhead.py")
        if len(have) == 1:
            scripts = {k: have[0] for k in scripts}
        for k, v in versions.items():
            v["overhead_py"] = scripts[k]
        with open(scripts["old"], "rb") as a, open(scripts["new"], "rb") as b:
            same_script = a.read() == b.read()

        print(
            f"# {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
            f"torch {importlib.metadata.version('torch')}, Python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs"
        )
        for k, v in versions.items():
            print(f"# {k}: {v['spec']} = {v['commit']} ({v['checkout']})")
        print(
            f"# {args.rounds} rounds; each runs bench/overhead.py --rounds {args.child_rounds} "
            f"--steps {args.steps} --warmup {args.warmup} --workloads {args.workloads} once per version"
        )
        if not same_script:
            print("# note: bench/overhead.py differs between the versions; each runs its own")

        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for i in range(args.rounds):
            for k in ("old", "new") if i % 2 == 0 else ("new", "old"):
                v = versions[k]
                r = run_overhead(
                    k,
                    v["checkout"],
                    v["overhead_py"],
                    args,
                    os.path.join(scratch, f"{k}-{i}.json"),
                    scratch,
                )
                if not r["hookprof_file"].startswith(os.path.realpath(v["checkout"]) + os.sep):
                    raise RuntimeError(
                        f"{k}: imported {r['hookprof_file']}, not the one in {v['checkout']}"
                    )
                runs[k].append(r)
                print(
                    f"round {i + 1}/{args.rounds} {k}: {r['seconds']:.0f} s, "
                    f"hookprof from {r['hookprof_file']}",
                    flush=True,
                )

        summary = {}
        for key in args.workloads.split(","):
            summary[key] = summarise(runs, key)
            print_table(
                key, runs["old"][0]["workloads"][key]["workload"], summary[key], args.rounds
            )
            # sampled steps cost more than others, so a version that samples more is slower for
            # that reason alone; sampling also follows the (per-configuration) clock, so counts
            # can differ by a step or so between any two runs
            sampled = {k: {} for k in runs}
            for k in runs:
                for r in runs[k]:
                    for c, (n, total) in (
                        r["workloads"][key].get("sampled_of_steps") or {}
                    ).items():
                        a, b = sampled[k].get(c, (0, 0))
                        sampled[k][c] = (a + n, b + total)
            print(
                "sampled steps, all rounds: "
                + ", ".join(
                    f"{c} old {n}/{t} new {'/'.join(map(str, sampled['new'].get(c, (0, 0))))}"
                    for c, (n, t) in sampled["old"].items()
                )
            )

        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                        "torch": importlib.metadata.version("torch"),
                        "cpus": os.cpu_count(),
                        "python": platform.python_version(),
                        "args": vars(args),
                        "versions": versions,
                        "summary": summary,
                        "runs": runs,
                    },
                    f,
                    indent=2,
                )
        return 0
    finally:
        for path in worktrees:
            subprocess.run(
                ["git", "worktree", "remove", "--force", path], cwd=ROOT, capture_output=True
            )
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
