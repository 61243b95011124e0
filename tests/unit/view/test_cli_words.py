"""Issue 41, item 3: a mistyped subcommand, flag or choice gets the nearest right word, in
the error argparse prints (exit status 2, as before)."""

from __future__ import annotations

import pytest

from hookprof.cli import main


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["tpo"], "(did you mean 'top'?)"),
        (["reprot"], "(did you mean 'report'?)"),
        (["top", "--oce"], "(--oce: did you mean --once?)"),
        (["top", "--sort", "shar"], "(did you mean 'share'?)"),
        (["demo", "--nan-at", "3", "--exitt"], "(--exitt: did you mean --exit?)"),
    ],
)
def test_a_mistyped_word_gets_the_nearest_right_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(hint), error


def test_a_word_near_nothing_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        main(["zzzzqqq"])
    assert "did you mean" not in capsys.readouterr().err


def test_the_demo_prints_the_per_layer_table_while_it_trains(capsys):
    """Issue 41, item 3: one terminal shows the per-layer table (--table SECONDS), not only
    loss lines; each table is up to its step (prof.report: it flushes first)."""
    code = main(
        [
            "demo",
            "--port",
            "0",
            "--steps",
            "30",
            "--table",
            "0.05",
            "--step-delay",
            "0.01",
            "--exit",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    tables = out.count("fwd ms/call")
    assert tables >= 3, out  # during training, and the last one after it
    steps = [
        int(line.split("step ")[1].split()[0])
        for line in out.splitlines()
        if line.startswith("rank 0")
    ]
    assert steps == sorted(steps) and steps[-1] == 30 and steps[0] < 30, steps


def test_the_demo_refuses_a_table_interval_that_is_no_number_of_seconds(capsys):
    assert main(["demo", "--port", "0", "--steps", "1", "--table", "-1", "--exit"]) == 2
    assert "--table -1.0: not a number of seconds >= 0" in capsys.readouterr().err
