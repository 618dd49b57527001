"""What a run reports: a progress line, metrics as JSONL (and TensorBoard when installed), peak FLOP/s for MFU."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

# Dense bf16 tensor-core peaks (no sparsity; fp32 accumulate), TFLOP/s, from the datasheets (half the sparse
# figure where only that is given). Matched against torch.cuda.get_device_name() in order, first hit wins: a
# pattern names whole words ("A10" is not "A100" nor "A10G"), and a SKU's variants come before its plain name,
# because the H100 PCIe (756) and NVL (835) run at lower clocks and power than the SXM part (989) whose name is
# just "NVIDIA H100 80GB HBM3".
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    (r"GH200", 989.0), (r"H200 NVL", 835.0), (r"H200", 989.0),
    (r"H100 NVL", 835.0), (r"H100 PCIe", 756.0), (r"H100", 989.0),
    (r"H800 PCIe", 756.0), (r"H800", 989.0), (r"H20", 148.0),
    (r"GB200", 2500.0), (r"B200", 2250.0), (r"B100", 1750.0),
    (r"RTX PRO 6000", 503.8), (r"RTX 6000 Ada", 364.2),
    (r"A100", 312.0), (r"A800", 312.0), (r"L40S", 362.0), (r"L40", 181.0), (r"L4", 121.0),
    (r"RTX A6000", 154.8), (r"A10", 125.0),
    (r"RTX 5090", 209.5), (r"RTX 5080", 112.6), (r"RTX 4090", 165.2), (r"RTX 4080", 97.5), (r"RTX 3090", 71.0),
]


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 TFLOP/s of the GPU called `device_name` (torch.cuda.get_device_name), None where unknown."""
    for key, tflops in PEAK_BF16_TFLOPS:
        words = r"\b" + r"\s+".join(re.escape(w) for w in key.split()) + r"\b"
        if re.search(words, device_name, flags=re.IGNORECASE):
            return tflops
    return None


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of the device, or None where unknown (CPUs: MFU is not reported, achieved FLOP/s is)."""
    if device.type != "cuda":
        return None
    tflops = peak_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


class MetricsLog:
    """Appends one JSON object per line to `metrics.jsonl`; mirrors scalars to TensorBoard when asked and installed
    (when asked and not installed, `log` says so once, at the start)."""

    def __init__(self, out_dir: Path, tensorboard: bool = True, log: Callable[[str], None] = print):
        self.path = out_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  kept open for the run, closed by close()
        self._tb = self._tensorboard(out_dir / "tensorboard", log) if tensorboard else None

    @staticmethod
    def _tensorboard(folder: Path, log: Callable[[str], None]):
        """A SummaryWriter on `folder`, or None (and one line saying why) where it cannot be had."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log("note: train.tensorboard is on but tensorboard is not installed: metrics go to metrics.jsonl only "
                "(pip install tensorboard, or --train.tensorboard=false to silence this)")
            return None
        try:
            return SummaryWriter(log_dir=str(folder))
        except Exception as e:  # noqa: BLE001  a bad install or an unwritable folder: the run goes on without it
            log(f"note: no TensorBoard events ({type(e).__name__}: {e}); metrics go to metrics.jsonl only")
            return None

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
    """One status line: step, loss, tokens/s, ETA. Redrawn in place on a terminal, printed every `every` steps else.

    `balance` (in `parts`) is the sequence-wise balance loss summed over the MoE layers, MTP's included (metrics.jsonl's
    `balance_loss`, the value the loss adds); with `balance_layers` (that count) the line shows it per layer, where
    1.0 is a perfectly even load and n_routed_experts / num_experts_per_tok every token on the same experts."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None, every: int = 10,
                 balance_layers: int = 0):
        self.total, self.start, self.every = total, start, every
        self.balance_layers = balance_layers
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
        extra = "".join(f" {self._part(name, value)}" for name, value in (parts or {}).items())
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} lm loss {loss:.4f}{extra} "
            f"{tokens_per_s:,.0f} tok/s ETA {eta}"
        )
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            self.stream.write(line + "\n")

    def _part(self, name: str, value: float) -> str:
        if name != "balance":
            return f"{name} {value:.4f}"
        if self.balance_layers:  # per MoE layer: 1.0 is even
            return f"balance {value / self.balance_layers:.3f}"
        return f"balance(sum) {value:.4f}"  # a sum over layers whose count this line was not given

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
