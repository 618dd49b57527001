"""Checkpoints written while training goes on: the state of step N is copied into host memory, and a thread writes
the step-N folder from that copy while the next steps run.

    saver = BackgroundSaver(env)                       # once per run (under torchrun: collective, a gloo group)
    staged_s = saver.start(out_dir, step, model, optimizer, train_state, run_config, tokenizer_files, keep_last,
                           masters=..., adapters=...)  # returns once the copy is taken
    ...                                                # train on; the optimizer may change the live tensors
    path = saver.wait()                                # step-N complete; or the write's OSError, raised here

What blocks the caller is `start`: the device -> host copy of every tensor the folder holds (into pinned buffers kept
from one save to the next, `anyseek.checkpoint.host`), the few small records, and under torchrun one gather of every
rank's loader state and random streams. Everything else (serializing, writing, fsync, sha256, checkpoint.json, the
rename into place, pruning) runs in the thread, and writes exactly the files a synchronous save writes: the same
writers (`folder.write_snapshot`, `sharded.write_sharded`) on the same snapshot.

Kill safety is the synchronous save's: the folder is assembled in a hidden staging folder and renamed into place
after checkpoint.json, so a process killed during the background write leaves the previous complete checkpoint as
the newest one (`checkpoint.latest`, `--resume`), and the next run removes the staging folder.

Several ranks: every rank's thread writes its shards, and the commit (hashes gathered, checkpoint.json, the rename)
needs them all, so the threads run collectives. They run them on a gloo group of their own, made by `__init__` on
every rank (`anyseek.distributed.env.side_group`): the main thread's collectives on the default group go on
meanwhile, and NCCL's communicators must not be driven from two threads. (A file-based handshake, rank 0 polling
for the other ranks' "done" files, would need no group but would add polling, its own timeouts and a second way for
every rank to learn the outcome; the gloo group gives both with the existing `agree` logic.) A failure on any rank
is the same OSError on every rank, so the caller's decisions agree.

One save at a time: `start` refuses while one is in flight (the host buffers are the one copy); the caller waits
first. Why a thread, not a process: the staged tensors stay in this process (nothing to share or send), a failure
comes back as the exception itself, and the heavy parts (file writes, fsync, sha256) release the GIL.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from anyseek.checkpoint import folder
from anyseek.checkpoint.adapters import Adapters
from anyseek.checkpoint.host import HostBuffers
from anyseek.distributed.env import DistEnv, side_group

SIDE_TIMEOUT_S = 3600  # a background collective waits this long for the other ranks' writes (minutes of disk time)


class BackgroundSaver:
    def __init__(self, env: DistEnv | None = None, timeout_s: float = SIDE_TIMEOUT_S):
        """Under torchrun (`env.active`) a collective: every rank makes the gloo group its thread will use."""
        self.env = env or DistEnv()
        self.side = side_group(self.env, timeout_s)
        self.host = HostBuffers()
        self.step: int | None = None  # the save in flight (or finished and not yet waited for)
        self.write_s = 0.0  # how long the thread took to write it, once it has
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Path | None, BaseException | None] = (None, None)
        self._reserving: threading.Thread | None = None  # `prepare`'s thread

    def start(self, out_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              train_state: dict[str, Any], run_config: dict[str, Any], tokenizer_files: list[Path], keep_last: int,
              *, masters=None, adapters: Adapters | None = None) -> float:
        """Copy step-N's state into host memory and start writing `out_dir/step-{step}` from it (the arguments
        are `checkpoint.save`'s); return the seconds the copy took. Under torchrun a collective."""
        if self.step is not None:
            raise RuntimeError(f"the background save of step {self.step} was not waited for")
        t0 = time.perf_counter()
        self.reserved()  # the buffers `prepare` makes: the rest of the time they take
        if self.env.active:
            from anyseek.checkpoint import sharded  # (torch.distributed.checkpoint: only where sharded)

            if adapters is not None:
                raise ValueError("LoRA checkpoints are written by one process (their adapters), not sharded")
            snap = sharded.snapshot_sharded(step, model, optimizer, train_state, run_config, tokenizer_files,
                                            self.env, masters, host=self.host)
            write = lambda: sharded.write_sharded(out_dir, snap, keep_last, self.side)
        else:
            snap = folder.snapshot(step, model, optimizer, train_state, run_config, tokenizer_files, adapters,
                                   host=self.host)
            write = lambda: folder.write_snapshot(out_dir, snap, keep_last)
        self.host.synchronize()
        self.step, self._outcome = step, (None, None)
        self._thread = threading.Thread(target=self._write, args=(write,), name=f"anyseek-save-{step}", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, masters=None) -> None:
        """Make the host buffers of the saves to come in a thread, while training goes on (a run's first save
        otherwise allocates and page-locks them with the loop waiting: 52 s for 16B on 4 H200s). Several processes
        only (the one-process folder is laid out at the save), once the optimizer's state exists; not a collective."""
        if not self.env.active or self._reserving is not None or self.host.buffers:
            return
        from anyseek.checkpoint import sharded

        specs = self.host.specs(sharded.state_tree(model, optimizer, masters))
        self._reserving = threading.Thread(target=self.host.reserve, args=(specs,), name="anyseek-save-buffers",
                                           daemon=True)
        self._reserving.start()

    def reserved(self) -> float:
        """Wait for `prepare`'s buffers (none in the making: at once); the seconds waited."""
        t0 = time.perf_counter()
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        return time.perf_counter() - t0

    def reserving(self) -> bool:
        """Whether `prepare`'s thread is still making the buffers."""
        return self._reserving is not None and self._reserving.is_alive()

    def _write(self, write) -> None:
        t0 = time.perf_counter()
        try:
            self._outcome = (write(), None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread by `wait`
            self._outcome = (None, e)
        self.write_s = time.perf_counter() - t0

    def running(self) -> bool:
        """Whether the thread is still writing."""
        return self._thread is not None and self._thread.is_alive()

    def succeeded(self) -> bool:
        """Whether the save in flight has finished and written its folder (no waiting)."""
        return self.step is not None and not self.running() and self._outcome[1] is None

    def wait(self) -> Path | None:
        """Block until the save in flight is complete: its folder (None when there is none), or the exception its
        write raised (an OSError for a failed write: full disk, read-only folder; every rank the same)."""
        if self.step is None:
            return None
        self._thread.join()
        (path, error), self.step, self._thread = self._outcome, None, None
        self._outcome = (None, None)
        if error is not None:
            raise error
        return path
