"""What a run reports: a progress line, metrics as JSONL (and TensorBoard when installed), peak FLOP/s for MFU."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

# Dense bf16 tensor-core peaks (no sparsity), by substring of torch.cuda.get_device_name(); datasheet values.
PEAK_BF16_TFLOPS = [
    ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("B100", 1750.0), ("RTX PRO 6000", 503.8),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("A6000", 154.8), ("A10", 125.0),
    ("RTX 5090", 209.5), ("RTX 5080", 112.6), ("RTX 4090", 165.2), ("RTX 4080", 97.5), ("RTX 3090", 71.0),
]


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of the device, or None where unknown (CPUs: MFU is not reported, achieved FLOP/s is)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


class MetricsLog:
    """Appends one JSON object per line to `metrics.jsonl`; mirrors scalars to TensorBoard when available."""

    def __init__(self, out_dir: Path, tensorboard: bool = True):
        self.path = out_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                self._tb = None

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: ignore it
            pass
    return rows


class TrainProgress:
    """One status line: step, loss, tokens/s, ETA. Redrawn in place on a terminal, printed every `every` steps else."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None, every: int = 10):
        self.total, self.start, self.every = total, start, every
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.first: tuple[int, float] | None = None  # (step, time) of the first update: the ETA starts after warm-up

    def update(self, step: int, loss: float, tokens_per_s: float, parts: dict[str, float] | None = None) -> None:
        """loss: the language-model loss (what validation and the plot show); parts: other terms shown beside it."""
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)  # the first steps include compilation and allocator warm-up: not a rate
        done = step - self.first[0]
        eta = _hms((now - self.first[1]) / done * (self.total - step)) if done > 0 else "--:--"
        width = 24
        filled = int(width * step / max(self.total, 1))
        extra = "".join(f" {name} {value:.4f}" for name, value in (parts or {}).items())
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} lm loss {loss:.4f}{extra} "
            f"{tokens_per_s:,.0f} tok/s ETA {eta}"
        )
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            self.stream.write(line + "\n")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
