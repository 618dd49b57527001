"""Rough edges a new user hits on a fresh clone (issue 38): each CLI mistake gives one clear line, each surprise
(a context limit hit, a slow speculation, a run too big or too long for the machine) is said once."""

from __future__ import annotations

import pytest

from anyseek.cli import main


def cli(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `anyseek ARGS`; argparse's own errors (SystemExit) count as an exit code."""
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("args, needle", [
    (["--gpus", "0"], "argument --gpus: expected a whole number of GPUs >= 1, got 0"),
    (["--gpus", "-4"], "argument --gpus"),
    (["--gpus", "2.5"], "argument --gpus"),
    (["--tokens-per-gpu", "-5"], "argument --tokens-per-gpu"),
    (["--gpu-memory", "0"], "argument --gpu-memory"),
    (["--gpu-memory", "nan"], "argument --gpu-memory"),
])  # fmt: skip
def test_plan_refuses_numbers_that_make_no_sense(capsys, args, needle):
    rc, out, err = cli(capsys, "plan", *args)
    assert rc == 2 and needle in err and "Traceback" not in err and "suggested" not in out, (args, out, err)


def test_plan_still_plans(capsys):
    rc, out, err = cli(capsys, "plan", "--gpus", "2", "--tokens-per-gpu", "128")
    assert rc == 0 and "on 2 GPUs" in out and "128 tokens/GPU" in out and "suggested" in out, err
