"""`anyseek train --nproc-per-node N ...`: the one-machine shortcut for
`torchrun --standalone --nproc_per_node N -m anyseek train ...` (several machines: run torchrun yourself, see
docs/distributed.md).

torchrun runs here in a process of our own (`python -m anyseek.distributed.launch TORCHRUN_ARGS`) rather than as
`python -m torch.distributed.run`, for what it prints when a rank fails: each rank already says its error in one
line (`anyseek.cli`), and torchrun would follow it with its agent's log line and a ~40-line report (the launcher's
traceback and a table of every failed rank). Here that becomes one line naming the ranks, and the exit status is
the failed rank's own (2: a user error, 3: the run diverged), not torchrun's blanket 1.
"""

from __future__ import annotations

import os
import subprocess
import sys


def relaunch_with_torchrun(nproc_per_node: int, train_args: list[str]) -> int:
    """Run `anyseek train train_args` on nproc_per_node local processes; return the failed rank's exit code (0 when
    all succeed)."""
    if nproc_per_node < 1:
        raise SystemExit(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    torchrun = ["--standalone", f"--nproc_per_node={nproc_per_node}", "-m", "anyseek", "train", *train_args]
    print("launching: torchrun " + " ".join(torchrun), flush=True)
    return subprocess.call([sys.executable, "-m", "anyseek.distributed.launch", *torchrun])


def exit_code(exitcode: int) -> int:
    """A rank's exit status as a shell reports it: its own code, or 128 + N when signal N ended it."""
    return 128 - exitcode if exitcode < 0 else exitcode or 1


def _torchrun(argv: list[str]) -> int:
    """torchrun's `run` with its failure report cut to one line (see the module docstring)."""
    import logging

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # the agent's "failed (exitcode: ...) local_rank: ..." record: said below, once, in our words
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = torchrun.parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node not in ("1", 1):  # its 4-line banner, in one line
        logging.getLogger(torchrun.__name__).addFilter(lambda record: "OMP_NUM_THREADS" not in record.getMessage())
        print("note: each process runs with OMP_NUM_THREADS=1 (torchrun's default; set OMP_NUM_THREADS to change it)",
              file=sys.stderr, flush=True)
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        first, failure = e.get_first_failure()
        ranks = ", ".join(str(r) for r in sorted(e.failures))
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"anyseek train: rank{'s' if len(e.failures) > 1 else ''} {ranks} failed (first: rank {first}, {how}); "
              "the ranks' own errors are above", file=sys.stderr, flush=True)
        return exit_code(failure.exitcode)
    return 0


if __name__ == "__main__":
    raise SystemExit(_torchrun(sys.argv[1:]))
