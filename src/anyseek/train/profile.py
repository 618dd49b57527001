"""`train.profile = "START:COUNT"`: a torch.profiler trace of COUNT optimizer steps from step START on, every rank
its own, and the step's breakdown read from it (what the GPU did, what it waited for).

    out_dir/profile/rank{r}.json        the Chrome trace (chrome://tracing, https://ui.perfetto.dev)
    out_dir/profile/rank{r}.md          the breakdown below, per optimizer step

    GPU busy        the union of every kernel, copy and memset over all streams, of the window's wall time
    compute         kernels that are not NCCL's
    all-to-all      NCCL's all-to-all and send/receive kernels (expert parallelism's dispatch and combine)
    FSDP/other comm NCCL's all-gathers, reduce-scatters and all-reduces (FSDP2, the gradient norm, the loss)
    comm hidden     the part of the communication that ran while a compute kernel ran too (on another stream)
    GPU idle        wall time with nothing on the GPU: the host was late (launches, syncs) or waited for a peer
    host syncs      host time in calls that wait for the GPU (`.item()`, `.tolist()`, device-to-host copies)

A NCCL kernel's time includes its wait for the slowest peer: a rank whose all-to-all is long was often waiting for
another rank's compute (load imbalance), not moving bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

A2A_NAMES = ("alltoall", "sendrecv", "send", "recv")
COMM_NAMES = ("allgather", "reducescatter", "allreduce", "broadcast")
HOST_SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class StepProfiler:
    """Profiles optimizer steps [start, start + count): `before(step)` ahead of queueing step `step`, `close()` at
    the end of the run (writes what was recorded if the run ended inside the window)."""

    def __init__(self, window: tuple[int, int], out_dir: Path, rank: int, device: torch.device, log=print):
        self.start, self.count = window
        self.path = out_dir / "profile" / f"rank{rank}"
        self.device, self.log, self.prof = device, log, None
        self.first = None

    def before(self, step: int) -> None:
        if self.prof is None and self.first is None and step >= self.start:
            self._sync()
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.first = step
        elif self.prof is not None and step >= self.first + self.count:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        self._sync()
        self.prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        trace = self.path.with_suffix(".json")
        self.prof.export_chrome_trace(str(trace))
        self.prof = None
        table = breakdown(json.loads(trace.read_text()), self.count)
        self.path.with_suffix(".md").write_text(table.markdown() + "\n")
        self.log(f"profile of steps {self.first}-{self.first + self.count - 1}: {trace}\n{table.markdown()}")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass
class Breakdown:
    steps: int
    wall_ms: float
    busy_ms: float
    compute_ms: float
    a2a_ms: float
    comm_ms: float
    hidden_ms: float
    host_sync_ms: float
    top: list[tuple[str, float, int]]  # the GPU events that took longest in all: (name, ms, count)

    def markdown(self) -> str:
        n = max(self.steps, 1)
        rows = [("wall", self.wall_ms), ("GPU busy", self.busy_ms), ("compute", self.compute_ms),
                ("all-to-all", self.a2a_ms), ("FSDP/other comm", self.comm_ms),
                ("comm hidden under compute", self.hidden_ms), ("GPU idle", self.wall_ms - self.busy_ms),
                ("host syncs (host time)", self.host_sync_ms)]
        lines = ["| per optimizer step | ms | of wall |", "| --- | --- | --- |"]
        lines += [f"| {name} | {ms / n:.1f} | {ms / max(self.wall_ms, 1e-9):.0%} |" for name, ms in rows]
        lines += ["", "| GPU event (longest in all) | ms per step | calls per step |", "| --- | --- | --- |"]
        lines += [f"| {name[:90]} | {ms / n:.2f} | {count / n:g} |" for name, ms, count in self.top]
        return "\n".join(lines)


def breakdown(trace: dict, steps: int) -> Breakdown:
    """The window's totals (ms) from a Chrome trace of torch.profiler: GPU events by kind, their unions, host syncs."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kind = {id(e): _kind(e["name"]) for e in gpu}
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if kind[id(e)] == "compute"]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if kind[id(e)] != "compute"]
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime") and e["name"] in HOST_SYNCS]
    everything = [(e["ts"], e["ts"] + e["dur"]) for e in events]
    wall = (max(b for _, b in everything) - min(a for a, _ in everything)) if everything else 0.0
    ms = 1e-3
    return Breakdown(
        steps=steps,
        wall_ms=wall * ms,
        busy_ms=_length(_union(compute + comm)) * ms,
        compute_ms=_length(_union(compute)) * ms,
        a2a_ms=_length(_union([(e["ts"], e["ts"] + e["dur"]) for e in gpu if kind[id(e)] == "a2a"])) * ms,
        comm_ms=_length(_union([(e["ts"], e["ts"] + e["dur"]) for e in gpu if kind[id(e)] == "comm"])) * ms,
        hidden_ms=_length(_intersect(_union(compute), _union(comm))) * ms,
        host_sync_ms=_length(_union([(e["ts"], e["ts"] + e["dur"]) for e in host])) * ms,  # nested calls once
        top=_top(gpu, 12),
    )


def _top(gpu: list[dict], n: int) -> list[tuple[str, float, int]]:
    total: dict[str, list] = {}
    for e in gpu:
        t = total.setdefault(e["name"], [0.0, 0])
        t[0] += e["dur"] * 1e-3
        t[1] += 1
    return sorted(((k, ms, c) for k, (ms, c) in total.items()), key=lambda x: -x[1])[:n]


def _kind(name: str) -> str:
    low = name.lower().replace("_", "")
    if "nccl" not in low:
        return "compute"
    return "a2a" if any(k in low for k in A2A_NAMES) and not any(k in low for k in COMM_NAMES) else "comm"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Two sorted disjoint span lists -> their overlap."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)
