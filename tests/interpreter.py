"""One harness for the Triton kernels' tests on the CPU: a test module's worker runs in a child process under
TRITON_INTERPRET=1, and its results come back as one JSON line.

A child process, because Triton reads the variable when it is imported: set in the test process it would leak into
every later test that imports triton. The worker is the module itself run as a script, so its cases and error
functions are the ones its GPU tests use. A test module follows this shape:

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

import json
import os
import subprocess
import sys
from pathlib import Path

PREFIX = "RESULTS "


def run_worker(path: str, timeout: float = 600) -> dict[str, dict]:
    """Run the test module at `path` as a script under the interpreter -> the results its worker reported. A child
    that fails or reports nothing fails the calling fixture (every test of the module) with its output's tail."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=timeout,
                          check=False)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    assert proc.returncode == 0 and lines, (
        f"interpreter worker {Path(path).name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
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
