"""Who am I among the ranks: process-group setup from torchrun's environment, and the few collectives the trainer
needs (sums of small tensors, a barrier, one object from rank 0), on the default group or a side group.

    env = init_from_torchrun("cpu", timeout_s=600)   # DistEnv(rank=0, world_size=1) when not under torchrun
    all_reduce_sum(load_LE, env)                      # in place; a no-op for one process
    side = side_group(env, timeout_s=3600)            # the same ranks over a gloo group, for a background thread

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; we read only those. A plain `python -m
anyseek train` has none of them and never touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """rank / world_size / local_rank of this process; `active` when a process group is up (even of one rank).
    The collectives below run on `group` (None: the default group; `side_group`: a gloo group of its own)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    active: bool = False
    device: str = "cpu"  # where collective buffers live: the rank's GPU under NCCL, else the CPU
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_from_torchrun(device_type: str, backend: str = "auto", timeout_s: float = 600) -> DistEnv:
    """Start the default process group from torchrun's variables (once); DistEnv() when not launched by torchrun.
    On CUDA each process takes the GPU of its LOCAL_RANK. `timeout_s` bounds every collective, so a dead rank makes
    the others fail with an error instead of hanging."""
    if not launched_by_torchrun():
        return DistEnv()
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistEnv(rank, world, local, active=True, device=f"cuda:{local}" if backend == "nccl" else "cpu")


def side_group(env: DistEnv, timeout_s: float) -> DistEnv:
    """`env` over a new gloo group of the same ranks, for collectives from a second thread (a checkpoint written in
    the background) while the main thread runs its own on the default group: collectives of one group must come from
    one thread in one order on every rank, and NCCL's from a second thread are not safe at all. Gloo runs on the CPU,
    which is where such a thread's tensors are. Collective: every rank calls it at the same point. `env` itself when
    there is no process group."""
    if not env.active:
        return env
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dataclasses.replace(env, device="cpu", group=group)


SHUTDOWN_TIMEOUT_S = 60.0


def shutdown_process_group(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
    """End of a run: release the process group (if one was started). True once it is released (or there was none);
    False if `destroy_process_group` has not returned after timeout_s (NCCL's teardown can hang, e.g. while CUDA
    graphs that captured its collectives are alive: pytorch/pytorch#115388): the caller then leaves without it.
    An error raised by the teardown is raised here."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    done, failed = threading.Event(), []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            failed.append(e)
        done.set()

    threading.Thread(target=destroy, name="anyseek-shutdown", daemon=True).start()
    if not done.wait(timeout_s):
        return False
    if failed:
        raise failed[0]
    return True


def all_reduce_sum(t: torch.Tensor, env: DistEnv, group: Any = None) -> torch.Tensor:
    """Sum `t` over every rank (of `group`), in place; returns it. No-op for one process."""
    if env.active and env.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def barrier(env: DistEnv) -> None:
    if env.active and env.world_size > 1:
        dist.barrier(group=env.group)


def all_gather_json(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order (as UTF-8 bytes in tensors: nothing is pickled)."""
    if not env.active or env.world_size == 1:
        return [obj]
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=env.device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=env.device) for _ in range(env.world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=env.device), group=env.group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=env.device)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(env.world_size)]
    dist.all_gather(out, padded, group=env.group)
    return [json.loads(bytes(o[: int(s.item())].tolist()).decode()) for o, s in zip(out, sizes)]


def broadcast_json(obj: Any, env: DistEnv) -> Any:
    """Rank 0's JSON-able `obj` on every rank."""
    return all_gather_json(obj, env)[0]


def agree(error: BaseException | None, env: DistEnv) -> None:
    """Collective: raise on every rank when any rank failed, so that all ranks take the same branch next (a rank that
    went on alone would wait forever in the next collective). The failing rank re-raises its own exception; the
    others raise an OSError with the same errno (a full disk stays a full disk for the trainer's save logic) or a
    RuntimeError, naming the rank. One process: raises `error` if there is one."""
    if not env.active or env.world_size == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else {"type": type(error).__name__, "errno": getattr(error, "errno", None),
                                       "strerror": getattr(error, "strerror", None) or str(error),
                                       "filename": str(getattr(error, "filename", None) or "") or None}
    everyone = all_gather_json(mine, env)
    if error is not None:
        raise error
    rank, first = next(((r, d) for r, d in enumerate(everyone) if d is not None), (None, None))
    if first is None:
        return
    if first["errno"] is not None:
        raise OSError(first["errno"], f"{first['strerror']} (on rank {rank})", first["filename"])
    raise RuntimeError(f"rank {rank} failed: {first['type']}: {first['strerror']}")
