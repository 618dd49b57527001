"""`anyseek train` over the GPUs of one machine: one process, then torchrun with 1..N ranks; prints one markdown table.

    python benchmarks/scale.py --data DIR [--config small] [--gpus 1,2,4] [--steps 60] [--tokens 8192]
                               [--variants ",--train.cuda_graphs=false"] [--out DIR]
    python benchmarks/scale.py --data DIR --config 16B --gpus 4 --no-single --set "--parallel.ep=4" --profile 20:3

Each row is a whole training run (a fresh process group per run, its own output folder under a temporary directory):
tokens/s is the median of what the trainer itself logs for the steps after the first third (all ranks together: each
rank takes --tokens per step), the loss is that of the last step. A run that has not ended after --timeout seconds
gets SIGABRT (Python's faulthandler then prints every thread's stack into its log) and is reported as hung, with the
log's tail under --out. --variants: override sets tried for every rank count ("" = the defaults), comma-separated,
each a space-separated list of --section.key=value. --set: overrides for every run (e.g. a 16B proxy with fewer
layers: "--model.num_hidden_layers=8"). --profile START:COUNT: every run also writes `train.profile`'s trace and
step breakdown (train/profile.py), and the breakdowns of every rank are printed after the table (profiles.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def env_line(device: str) -> str:
    import torch

    what = (torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available()
            else platform.processor() or platform.machine())
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    return (f"{what} x {gpus} visible, PyTorch {torch.__version__}, {platform.system()}, "
            f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")


def _logged(out: Path, steps: int) -> float:
    """When the run's metrics.jsonl last changed, if its last training step is logged there; else 0."""
    metrics = out / "metrics.jsonl"
    if not metrics.exists() or f'"step": {steps},' not in metrics.read_text():
        return 0.0
    return time.monotonic() - (time.time() - metrics.stat().st_mtime)


def _family(pid: int) -> list[int]:
    """pid and every process descended from it (from /proc: torch's elastic agent may start its ranks in sessions
    of their own, out of reach of a signal to torchrun's process group)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie has let go of its GPU memory: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop(proc: subprocess.Popen, sig: int) -> None:
    """Signal every process of the run (torchrun and its ranks, found by descent, and its process group), then wait
    until none is left, so that the next run finds the GPUs' memory free (16B's ranks outlived torchrun at stop 46
    and held 98.9 GiB; at stop 47 they outlived a signal to its group and the next run ran out of memory)."""
    family = _family(proc.pid)
    for p in family:
        with contextlib.suppress(OSError):
            os.kill(p, sig)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, sig)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and any(_alive(p) for p in family if p != proc.pid):
        if time.monotonic() > deadline - 60:
            for p in family:
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
        time.sleep(1)
    with contextlib.suppress(OSError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(3)  # (the driver's teardown of the ranks' contexts)


def run_one(name: str, cmd: list[str], out: Path, timeout: float, log_dir: Path | None, steps: int = 0) -> dict:
    """One training run: its exit, and its metrics summarized. A run stopped at the timeout after logging all its
    `steps` was in its end-of-run save (16B's takes minutes): its numbers stand."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd + ["--out", str(out)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        code, t0 = None, time.monotonic()
        while code is None:
            try:
                code = proc.wait(5)
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 > timeout:
                    _stop(proc, signal.SIGABRT)  # (its stacks in the log)
                    code = "hung"
                elif steps and 0 < _logged(out, steps) < time.monotonic() - 30:
                    _stop(proc, signal.SIGKILL)  # every step logged: the end-of-run save is not timed
                    code = "0 (stopped in the final save)"
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if not ln.startswith("frame #")]
        # the run's own account (anyseek's lines: graphs, dispatch, settling, overflows) first, then the tail (C++
        # stack frames left out: at stop 47 they filled the kept tail and hid which step failed)
        told = [ln for ln in lines[:-200] if ln.startswith("anyseek") or "dispatch" in ln or "graph" in ln][-120:]
        (log_dir / f"{name}.log").write_text("\n".join(told + ["[...]"] * bool(told) + lines[-200:]) + "\n")
    rows = []
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    later = [r for r in train if r["step"] > max(r["step"] for r in train) // 3] if train else []
    return {"name": name, "exit": code, "steps": len(train),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later) if later else float("nan"),
            "loss": train[-1]["loss"] if train else float("nan"),
            "loss_tail": statistics.mean(r["loss"] for r in train[-max(1, len(train) // 10):]) if train else float("nan"),
            "mfu": statistics.median(r.get("mfu", float("nan")) for r in later) if later else float("nan"),
            "ep_peak": [(r["step"], r["ep_peak_rows"], r["ep_capacity"]) for r in train if "ep_peak_rows" in r],
            "profiles": {p.stem: p.read_text() for p in sorted((out / "profile").glob("rank*.md"))}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a prepared data folder (anyseek prepare)")
    p.add_argument("--config", default="small")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo ranks (a smoke test)")
    p.add_argument("--gpus", default="1,2", help="rank counts for torchrun")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--variants", default=",--train.cuda_graphs=false")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before it counts as hung")
    p.add_argument("--out", default=None, help="folder for the table and each run's log tail")
    p.add_argument("--set", default="", help="space-separated --section.key=value overrides for every run")
    p.add_argument("--no-single", action="store_true", help="skip the one-process run (a model no GPU holds)")
    p.add_argument("--profile", default="", help="START:COUNT: profile these steps of every run (train.profile)")
    args = p.parse_args()

    common = ["--config", args.config, f"--data.path={args.data}", f"--data.tokens_per_batch={args.tokens}",
              f"--data.max_seqlen={args.seqlen}", f"--train.max_steps={args.steps}", "--train.eval_every=1000000",
              "--train.save_every=1000000", "--train.sample_tokens=0", "--train.tensorboard=false",
              "--train.log_every=1", f"--train.device={args.device}", *args.set.split()]  # fmt: skip
    if args.profile:
        common.append(f"--train.profile={args.profile}")
    log_dir = Path(args.out) / "logs" if args.out else None
    runs = [] if args.no_single else [("one process", 0, "", [sys.executable, "-m", "anyseek", "train", *common])]
    for n in (int(g) for g in args.gpus.split(",")):
        for variant in args.variants.split(","):
            extra = variant.split()
            runs.append((f"torchrun x{n}" + (f" {variant}" if variant else ""), n, variant,
                         [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                          "-m", "anyseek", "train", *common, *extra]))  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, n, variant, cmd) in enumerate(runs):
            r = run_one(f"run{i}", cmd, Path(tmp) / f"run{i}", args.timeout, log_dir, args.steps)
            r.update(label=name, ranks=n)
            results.append(r)
            print(f"{name}: {r['tokens_per_s']:,.0f} tokens/s, exit {r['exit']}", file=sys.stderr, flush=True)
    base = results[0]["tokens_per_s"] if not args.no_single else float("nan")
    lines = [f"`anyseek train --config {args.config} {args.set}`, {args.tokens} tokens per rank per step, "
             f"{args.steps} steps, {env_line(args.device)}", "",
             "| run | ranks | tokens/s (all ranks) | per rank | MFU | vs one process | loss at the last step "
             "| mean loss, last tenth of the steps | exit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in results:
        per = r["tokens_per_s"] / max(r["ranks"], 1)
        lines.append(f"| {r['label']} | {r['ranks'] or '-'} | {r['tokens_per_s']:,.0f} | {per:,.0f} | "
                     f"{r['mfu']:.1%} | {r['tokens_per_s'] / base:.2f}x | {r['loss']:.4f} | {r['loss_tail']:.4f} | "
                     f"{r['exit']} |")
    for r in results:
        if r["ep_peak"]:  # the fixed-shape dispatch's C against what the fullest pair of ranks needed, step by step
            peaks = [n for _, n, _ in r["ep_peak"]]
            lines.append(f"\n{r['label']}: expert dispatch, most rows a pair of ranks needed: median "
                         f"{statistics.median(peaks):,.0f}, max {max(peaks):,.0f}, at the last step {peaks[-1]:,.0f} "
                         f"(C {r['ep_peak'][-1][2]:,.0f}; settling needs <= C / 1.25)")
    table = "\n".join(lines)
    profiles = "\n\n".join(f"### {r['label']}, {rank}\n\n{text}" for r in results
                           for rank, text in r["profiles"].items())  # fmt: skip
    print(table + ("\n\n" + profiles if profiles else ""))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "scale.md").write_text(table + "\n")
        if profiles:
            (Path(args.out) / "profiles.md").write_text(profiles + "\n")


if __name__ == "__main__":
    main()
