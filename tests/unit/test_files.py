"""Every file hookprof writes (hookprof/files.py): whole or not at all, never through a link,
never on another writer's temporary file. Through the writers users reach: the NaN dump
(nonfinite/incident.write_report), the run report (`prof.report(path)`: view/report_html.write)
and `hookprof report -o` (cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hookprof.nonfinite.incident import write_report
from hookprof.snapshot import NonFiniteEvent, Snapshot
from hookprof.view.report_html import render, write
from support.paths import ROOT, TESTS, worker

EVENT, SNAP = NonFiniteEvent(layer="fc", phase="forward", step=7), Snapshot(step=7)
PREVIOUS = "<html>the previous good report</html>"


def run_worker(*args: str, timeout: float = 120) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, TESTS]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    done = subprocess.run(
        [sys.executable, worker("file_fault_worker.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.returncode, done.stdout, done.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT ") :])


def leftovers(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


def test_a_report_is_written_whole_with_the_umasks_permissions(tmp_path):
    path = tmp_path / "run.html"
    old = os.umask(0o027)
    try:
        assert write(str(path), []) == str(path)
    finally:
        os.umask(old)
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>")
    assert len(page) == len(render([]))  # the same page (only its "made <time>" differs)
    assert path.stat().st_mode & 0o777 == 0o640  # 0o666 less the umask, as open(path, "w")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("how", ["report", "cli"])
def test_a_failed_report_leaves_the_previous_one_and_no_temporary_file(tmp_path, how):
    """A full disk: the page (865 bytes) may not grow past 512. Before: the previous report
    was truncated and 512 bytes of the new one were left in its place."""
    path = tmp_path / "run.html"
    path.write_text(PREVIOUS, encoding="utf-8")
    out = run_worker(how, str(path), "--fsize", "512")
    assert path.read_text(encoding="utf-8") == PREVIOUS
    assert leftovers(tmp_path) == []
    if how == "cli":
        assert out["rc"] == 1  # "cannot write run.html: File too large"
    else:
        assert out["error"] == 27  # EFBIG, raised to the caller of prof.report(path)


def test_a_symlink_planted_at_the_report_path_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("do not touch", encoding="utf-8")
    path = tmp_path / "run.html"
    path.symlink_to(victim)
    write(str(path), [])
    assert victim.read_text(encoding="utf-8") == "do not touch"
    assert not path.is_symlink() and "hookprof run report" in path.read_text(encoding="utf-8")


def test_symlinks_planted_at_every_predictable_temporary_name_are_never_followed(
    tmp_path, monkeypatch
):
    """Before: the dump's temporary file was `<path>.tmp`, opened without O_EXCL|O_NOFOLLOW,
    so a link planted there made hookprof overwrite the link's target. Now the name has the
    pid and 64 random bits; here the random bits are made predictable too, and a link is
    planted at the first name tried: it is never opened, another name is used."""
    victim = tmp_path / "victim"
    victim.write_text("do not touch", encoding="utf-8")
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()
    tokens = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr("secrets.token_hex", lambda n: next(tokens))
    base = f"hookprof-nonfinite-model-rank0-pid{os.getpid()}-step7.json"
    planted = [
        dump_dir / guess
        for guess in (
            base + ".tmp",
            f".{base}.{os.getpid()}.{'0' * 16}.tmp",
            "hookprof-nonfinite-rank0-step7.json.tmp",
        )
    ]  # the last: the name before issue 29
    for link in planted:
        link.symlink_to(victim)
    path = write_report(EVENT, SNAP, str(dump_dir), 0)
    assert victim.read_text(encoding="utf-8") == "do not touch"
    assert json.loads(open(path, encoding="utf-8").read())["incident"]["step"] == 7
    assert all(p.is_symlink() for p in planted)  # left as they were, never written through
    assert sorted(p.name for p in dump_dir.iterdir() if not p.is_symlink()) == [
        os.path.basename(path)
    ]


def test_three_processes_of_rank_0_dump_into_one_directory_without_a_failed_write(tmp_path):
    """Before: the three shared one `.tmp` name and failed hundreds of their writes
    (FileNotFoundError when another's os.replace took it), and all wrote one file."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, TESTS]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    go = tmp_path.parent / f"{tmp_path.name}.go"  # all three start writing together
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                worker("file_fault_worker.py"),
                "dumps",
                str(tmp_path),
                "1000",
                "--go",
                str(go),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = []
    try:
        for proc in procs:  # each says READY once imported (a bounded wait: the line or EOF)
            assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-3000:]
        go.touch()
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, (out, err[-3000:])
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [r["failed"] for r in results] == [0, 0, 0], [r["first_failure"] for r in results]
    # one file per process: the model, the rank, the pid and the step name it
    names = sorted(os.path.basename(r["paths"][0]) for r in results)
    assert names == sorted(
        f"hookprof-nonfinite-model-rank0-pid{r['pid']}-step7.json" for r in results
    )
    assert sorted(os.listdir(tmp_path)) == names  # and no temporary file left
    for name in names:
        assert json.loads((tmp_path / name).read_text())["incident"]["layer"] == "fc"


def test_concurrent_writers_of_one_path_each_write_whole(tmp_path):
    """Three processes writing one report path over and over: every write succeeds and the
    file is always one writer's page whole."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, TESTS]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    path = tmp_path / "run.html"
    code = (
        "import sys; from hookprof.files import write_atomic\n"
        "for i in range(300): write_atomic(sys.argv[1], sys.argv[2] * 5000)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path), letter],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for letter in "abc"
    ]
    seen = set()
    for _ in range(200):  # read while they write: always a whole page
        if path.exists():
            text = path.read_text()
            assert len(text) == 5000 and len(set(text)) == 1, (len(text), set(text))
            seen.add(text[0])
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        assert proc.returncode == 0, err[-3000:]
    assert path.read_text() in {c * 5000 for c in "abc"}
    assert leftovers(tmp_path) == []
