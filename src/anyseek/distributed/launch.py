"""`anyseek train --nproc-per-node N ...`: the one-machine shortcut for
`torchrun --standalone --nproc_per_node N -m anyseek train ...` (several machines: run torchrun yourself, see
docs/distributed.md)."""

from __future__ import annotations

import subprocess
import sys


def relaunch_with_torchrun(nproc_per_node: int, train_args: list[str]) -> int:
    """Run `anyseek train train_args` on nproc_per_node local processes; return torchrun's exit code."""
    if nproc_per_node < 1:
        raise SystemExit(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
           "-m", "anyseek", "train", *train_args]
    print("launching: " + " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd)
