"""One harness for the Triton kernels' tests on the CPU: a test module's worker runs in a child process under
TRITON_INTERPRET=1, and its results come back as one JSON line.

A child process, because Triton reads the variable when it is imported: set in the test process it would leak into
every later test that imports triton. In the child every floating tensor torch.empty and its kin make starts as
NaN (`_poison`; ANYSEEK_TEST_POISON=0 turns it off), so a kernel that leaves part of its output unwritten fails
its case instead of passing on a fresh allocation's zeros. The worker is the module itself run as a script, so its
cases and error functions are the ones its GPU tests use. A test module follows this shape:

    def _worker() -> None:  # in the child: every case -> {name: {"pass": bool, "table": [...]}}
        ...
        interpreter.report(results)

    @pytest.fixture(scope="module")
    def interp_results():
        return interpreter.run_worker(__file__)

    @pytest.mark.parametrize("name", [...every name the worker reports...])
    def test_interpreter(interp_results, name):
        interpreter.check(interp_results, name, "(grad, err, err_pt)")

    if __name__ == "__main__":
        _worker()
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

PREFIX = "RESULTS "
TIMEOUT_S = 600


_MAKERS: dict[str, object] = {}  # the unpoisoned allocators (`unpoison`)


def _poison() -> None:
    """In the child: every floating tensor that torch.empty / empty_like / empty_strided / Tensor.new_empty make
    starts as NaN. A fresh CPU allocation is zeros, which hides a kernel that leaves part of its output unwritten
    (on a GPU that memory holds whatever was there); NaN shows it."""
    import torch

    _MAKERS.update(empty=torch.empty, empty_like=torch.empty_like, empty_strided=torch.empty_strided,
                   new_empty=torch.Tensor.new_empty)  # fmt: skip

    def poisoned(make):
        def fn(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() and t.numel() else t

        return fn

    torch.empty, torch.empty_like, torch.empty_strided = map(poisoned, (torch.empty, torch.empty_like,
                                                                       torch.empty_strided))  # fmt: skip
    torch.Tensor.new_empty = poisoned(torch.Tensor.new_empty)


def unpoison() -> None:
    """The allocators as they were (a worker that counts the ops a step runs, which the NaN fills would add to)."""
    import torch

    if _MAKERS:
        torch.empty, torch.empty_like, torch.empty_strided = (_MAKERS["empty"], _MAKERS["empty_like"],
                                                               _MAKERS["empty_strided"])  # fmt: skip
        torch.Tensor.new_empty = _MAKERS["new_empty"]


if os.environ.get("ANYSEEK_INTERPRETER_CHILD") == "1" and os.environ.get("ANYSEEK_TEST_POISON", "1") == "1":
    _poison()  # (only in the worker's child: a whole test session run under TRITON_INTERPRET=1 keeps its allocators)


def _child(path: str, threads: int) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=str(threads), ANYSEEK_INTERPRETER_CHILD="1")
    return subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {TIMEOUT_S} s)"
    return proc.returncode, out, err


class _Ahead:
    """The workers `prefetch` runs one after another in a thread of the test process, on the CPU's second core, while
    the tests go on: path -> its outcome once done. A worker its test module asks for before the thread took it
    is run by the module itself (`run_worker`), so the two never wait on each other's queue."""

    def __init__(self, paths: list[str]):
        self.lock = threading.Lock()
        self.queue = list(paths)
        self.done: dict[str, tuple[int, str, str]] = {}
        self.events = {p: threading.Event() for p in paths}
        self.running: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name="interpreter-workers", daemon=True)
        atexit.register(self.stop)
        self.thread.start()

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.queue:
                    return
                path = self.queue.pop(0)
                self.running = _child(path, threads=1)
            self.done[path] = _finish(self.running)
            self.events[path].set()

    def claim(self, path: str) -> tuple[int, str, str] | None:
        """The outcome of `path` (waiting for it if the thread runs it); None when the caller must run it."""
        with self.lock:
            if path in self.queue:
                self.queue.remove(path)
                return None
        if path not in self.events:
            return None
        self.events[path].wait()
        return self.done[path]

    def stop(self) -> None:
        with self.lock:
            self.queue.clear()
            if self.running is not None and self.running.poll() is None:
                self.running.kill()


_ahead: _Ahead | None = None


def prefetch(paths: list[str]) -> None:
    """Start the interpreter workers of these test modules now, in the background, in this order (conftest.py does,
    for the modules a session will run: on 2 cores the single-threaded interpreter leaves one idle)."""
    global _ahead
    if _ahead is None and paths:
        _ahead = _Ahead([str(Path(p).resolve()) for p in paths])


def run_worker(path: str) -> dict[str, dict]:
    """Run the test module at `path` as a script under the interpreter (or take what `prefetch` ran) -> the results
    its worker reported. A child that fails or reports nothing fails the calling fixture (every test of the module)
    with its output's tail."""
    outcome = _ahead.claim(str(Path(path).resolve())) if _ahead is not None else None
    if outcome is None:
        outcome = _finish(_child(path, threads=2))
    code, out, err = outcome
    lines = [ln for ln in out.splitlines() if ln.startswith(PREFIX)]
    assert code == 0 and lines, f"interpreter worker {Path(path).name} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return json.loads(lines[-1][len(PREFIX):])


def report(results: dict[str, dict]) -> None:
    """The worker's last word: {case name: {"pass": bool, "table": what to show when it fails}} on one line."""
    print(PREFIX + json.dumps(results))


def check(results: dict[str, dict], name: str, columns: str) -> None:
    """Case `name` passed in the child; else fail with its table (`columns` names the table's columns)."""
    r = results[name]
    assert r["pass"], f"{name}: {columns} = {r['table']}"


def passes(table, atol: float = 1e-5) -> bool:
    """The 2x rule on a table of (what, err kernel, err torch): the kernel's error against the exact reference is
    at most twice PyTorch's at the same precision, plus `atol` (for errors at fp32 rounding)."""
    return all(err <= 2 * err_torch + atol for _, err, err_torch in table)
