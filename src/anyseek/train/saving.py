"""The trainer's checkpoints: when step-N is written, in the background or not, and what a failed write means.

    saves = Saves(cfg, out_dir, par, device, tokenizer_files, log)
    saves.save(step, model, optimizer, train_state, periodic=True, masters=..., adapters=...)  # every save_every
    saves.poll()          # after each settled step: report a background save that has finished
    saves.save(step, ..., periodic=False)                                  # the end, a stop: complete on return
    saves.drain()         # leaving on an error: the save in flight completes (a failure is one warning)

`train.async_save` (auto: on with a CUDA device) writes the periodic checkpoints in the background
(`anyseek.checkpoint.BackgroundSaver`): the loop is blocked only while the state is copied to host memory ("saving
step-N in the background (staged in 0.8 s, ...)"), and "saved DIR/step-N" is logged once the folder is complete.
Before the next save starts the previous one must be complete (the loop waits, and says how long when it had to).
The final save and a stop's save are written at once, as without it: the run has nothing left to overlap them with.

A write that fails (full disk, read-only folder: an OSError, whichever library wrote, `anyseek.storage.os_error`)
means the same either way, only seen later in the background: a periodic save's failure is one warning line and
training goes on, until MAX_FAILED_SAVES fail in a row; a final save's failure raises SaveFailed. Other errors (a
bug, not the disk) propagate as they are. In one process a background save is reported at the first step after it
finished; under torchrun its "saved" line too (rank 0's), but its failure only at the next save or the end, which
every rank reaches at the same step (the ranks see the thread finish at different steps, and must decide alike).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from anyseek import checkpoint
from anyseek.train.config import RunConfig
from anyseek.train.preflight import describe_os_error


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (full disk, read-only folder); the message says why in one line."""


MAX_FAILED_SAVES = 3  # periodic saves that may fail in a row (training goes on) before the run stops
WAIT_NOTED_S = 0.1  # a wait for the previous background save longer than this is logged


def background(mode: str, device: torch.device) -> bool:
    """train.async_save: auto is on with a CUDA device (the copy to pinned host memory takes seconds where the write
    takes minutes; on the CPU the copy and the writer's thread compete with training for the same cores)."""
    return mode == "true" or (mode == "auto" and device.type == "cuda")


def _note(mode: str, on: bool, device: torch.device) -> str:
    """The run's line about its checkpoints."""
    if on:
        pinned = "pinned " if device.type == "cuda" else ""
        return (f"periodic ones in the background: the loop waits only while one is copied to {pinned}host memory "
                f"(train.async_save={mode})")
    why = "in the background with a CUDA device; true: here too" if mode == "auto" else "false"
    return f"written while the loop waits (train.async_save={'auto: ' if mode == 'auto' else ''}{why})"


@dataclass
class _InFlight:
    step: int
    periodic: bool
    announced: bool = False  # its "saved" line was logged (`poll`)


class Saves:
    def __init__(self, cfg: RunConfig, out_dir: Path, par, device: torch.device, tokenizer_files: list[Path],
                 log: Callable[[str], None]):
        """Under torchrun with background saves a collective (`BackgroundSaver` makes its gloo group)."""
        self.cfg, self.out_dir, self.par, self.log = cfg, Path(out_dir), par, log
        self.tokenizer_files = tokenizer_files
        self.failed = 0  # saves that failed in a row
        on = background(cfg.train.async_save, device)
        self.saver = checkpoint.BackgroundSaver(par.env) if on else None
        self.in_flight: _InFlight | None = None
        self.prepared = False  # `prepare` was asked
        self.note = _note(cfg.train.async_save, on, device)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any],
             periodic: bool, masters=None, adapters=None) -> Path | None:
        """Write step-N: its folder once complete (None while in the background, or after a tolerated failure)."""
        self.wait()  # the previous one first: one save at a time (its host buffers are this one's)
        args = (self.out_dir, step, model, optimizer, train_state, self.cfg.to_dict(), self.tokenizer_files,
                self.cfg.train.keep_last)
        if self.saver is None or not periodic:
            try:  # distributed: a failure on any rank raises OSError on every rank, so all decide alike below
                path = checkpoint.save(*args, env=self.par.env, masters=masters, adapters=adapters)
            except OSError as e:
                return self._failed(e, step, periodic)
            return self._saved(path)
        staged_s = self.saver.start(*args, masters=masters, adapters=adapters)
        self.in_flight = _InFlight(step, periodic)
        self.log(f"saving step-{step} in the background (staged in {staged_s:.1f} s, "
                 f"{self.saver.host.nbytes() / 2**30:,.2f} GiB of host buffers)")
        return None

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, masters=None) -> None:
        """After a step (the optimizer's state exists), once a run: the background saves' host buffers made in a
        thread now, not at the first save with the loop waiting (`BackgroundSaver.prepare`)."""
        if self.prepared:
            return
        self.prepared = True
        if self.saver is not None and self.cfg.train.save_every < self.cfg.train.max_steps:
            self.saver.prepare(model, optimizer, masters=masters)

    def poll(self) -> None:
        """Report a background save that has finished, without waiting (see the module's docstring)."""
        job = self.in_flight
        if job is None or self.saver.running():
            return
        if not self.par.env.active:
            self.wait()
        elif not job.announced and self.saver.succeeded():
            job.announced = True
            self.log(self._saved_line(self.out_dir / f"step-{job.step}", background=True))

    def wait(self) -> Path | None:
        """Block until the background save in flight is complete and report it: its folder, or None (none in
        flight, a tolerated failure); SaveFailed as `save`."""
        job, self.in_flight = self.in_flight, None
        if job is None:
            return None
        t0 = time.perf_counter()
        try:
            path = self.saver.wait()
        except OSError as e:
            return self._failed(e, job.step, job.periodic)
        waited = time.perf_counter() - t0
        if waited > WAIT_NOTED_S:
            self.log(f"waited {waited:.1f} s for the background save of step-{job.step} to finish")
        return self._saved(path, job)

    def abandon(self) -> None:
        """Leaving at once (a second Ctrl-C): forget the save in flight. Its thread dies with the process and leaves
        a staging folder, which the next run removes; the previous checkpoint stays the newest (kill-safe)."""
        self.in_flight = None

    def drain(self) -> None:
        """Leaving on an error: let the save in flight complete (the newest checkpoint is then the one it writes);
        its failure is one warning line, never raised over the error that ends the run."""
        job, self.in_flight = self.in_flight, None
        if job is None:
            return
        try:
            path = self.saver.wait()
        except Exception as e:  # noqa: BLE001 - the error that ends the run is the one to raise
            why = describe_os_error(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            self.log(f"warning: could not save step {job.step} in {self.out_dir}: {why}")
            return
        if not job.announced:
            self.log(self._saved_line(path, background=True))

    def _saved(self, path: Path, job: _InFlight | None = None) -> Path:
        self.failed = 0
        if job is None or not job.announced:
            self.log(self._saved_line(path, background=job is not None))
        return path

    def _saved_line(self, path: Path, background: bool) -> str:
        """"saved DIR/step-N": the folder is complete (what users and tests look for)."""
        return f"saved {path}" + (f" (written in the background in {self.saver.write_s:.1f} s)" if background else "")

    def _failed(self, e: OSError, step: int, periodic: bool) -> None:
        """A failed write: the staging folder is already gone; one warning line, or SaveFailed."""
        self.failed += 1
        why = f"could not save step {step} in {self.out_dir}: {describe_os_error(e)}"
        if periodic and self.failed < MAX_FAILED_SAVES:
            self.log(f"warning: {why}; training goes on and tries again at the next save")
            return
        raise SaveFailed(why) from None
