"""Host copies of a checkpoint's tensors, taken at one step while training goes on: what a save in the background
writes from (`anyseek.checkpoint.background`).

    host = HostBuffers()
    state_host = host.copy_tree(state, "optim")   # same structure; every tensor (a DTensor: its local shard) copied
    host.synchronize()                            # the device copies have landed: `state_host` may be read

One buffer per tensor name, kept from one save to the next: a 16B model's training state on 4 GPUs is ~46 GB a rank,
and allocating (and page-locking) that at every save would cost more than the copy itself. Buffers for GPU tensors
are page-locked (pinned) with cudaHostRegister on an ordinary allocation, as torch.distributed.checkpoint's stager
does: the device copies into them at full speed and asynchronously, and the pinned allocator's rounding of every
block up to a power of two (up to 2x the memory) is avoided. The copies are queued on the current stream, before
anything the caller queues after them: the optimizer step that follows cannot change what they copy.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class HostBuffers:
    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.pinned: set[str] = set()  # the names whose buffer is page-locked
        self._queued = False  # device copies queued since the last synchronize

    def copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t`'s values in the host buffer kept under `name` (made, or remade when its shape or dtype changed)."""
        t = t.detach()
        buf = self._buffer(name, t.shape, t.dtype, t.is_cuda)
        fast = t.is_cuda and name in self.pinned
        buf.copy_(t, non_blocking=fast)
        self._queued |= fast
        return buf

    def copy_tree(self, tree: Any, name: str = "") -> Any:
        """`tree` (dicts, lists and tuples of tensors and plain values) with every tensor copied (`copy`), named by
        its path; a DTensor becomes a DTensor of the same mesh and placements over the host copy of its local shard
        (what torch.distributed.checkpoint writes: this rank's shard and where it sits)."""

        def leaf(path: str, t: torch.Tensor):
            if type(t) is not torch.Tensor and _is_dtensor(t):
                from torch.distributed.tensor import DTensor

                return DTensor(self.copy(path, t.to_local()), t._spec, requires_grad=False)
            return self.copy(path, t)

        return _map_tensors(tree, name, leaf)

    def _buffer(self, name: str, shape: torch.Size, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = torch.empty(shape, dtype=dtype, device="cpu")
            self.pinned.discard(name)
            if cuda and buf.nbytes and _pin(buf):
                self.pinned.add(name)
            self.buffers[name] = buf
        return buf

    def specs(self, tree: Any, name: str = "") -> list[tuple[str, torch.Size, torch.dtype, bool]]:
        """(name, shape, dtype, on a GPU) of every buffer `copy_tree(tree, name)` would use (a DTensor: its local
        shard), for `reserve`."""
        out = []

        def leaf(path: str, t: torch.Tensor) -> None:
            t = t.to_local() if type(t) is not torch.Tensor and _is_dtensor(t) else t
            out.append((path, t.shape, t.dtype, t.is_cuda))

        _map_tensors(tree, name, leaf)
        return out

    def reserve(self, specs: list[tuple[str, torch.Size, torch.dtype, bool]]) -> None:
        """Make (and page-lock) the buffers of `specs` ahead of the first copy: a 16B model's 43 GiB a rank took
        52 s to allocate and pin at its first save on 4 H200s, the training loop waiting. One buffer at a time,
        so that a thread doing this lets the training loop run between them."""
        for name, shape, dtype, cuda in specs:
            self._buffer(name, shape, dtype, cuda)

    def synchronize(self) -> None:
        """Wait for the device copies queued by `copy`: afterwards the buffers hold the values."""
        if self._queued:
            torch.cuda.synchronize()
            self._queued = False

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


def _map_tensors(tree: Any, name: str, leaf) -> Any:
    """`tree` with every tensor t at path p replaced by leaf(p, t); dicts, lists and tuples rebuilt, other values
    kept. Paths are "/"-joined keys and indices after `name`."""
    if isinstance(tree, dict):
        return {k: _map_tensors(v, f"{name}/{k}", leaf) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, f"{name}/{i}", leaf) for i, v in enumerate(tree))
    return leaf(name, tree) if isinstance(tree, torch.Tensor) else tree


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor  # (here: a one-process run never imports torch.distributed)

    return isinstance(t, DTensor)


def _pin(buf: torch.Tensor) -> bool:
    """Page-lock `buf`'s memory until it is freed; False where the driver refuses (the buffer stays pageable: copies
    into it are then slower and synchronous, nothing else changes)."""
    cudart, ptr = torch.cuda.cudart(), buf.data_ptr()
    if int(cudart.cudaHostRegister(ptr, buf.nbytes, 0)) != 0:
        return False
    fin = weakref.finalize(buf, cudart.cudaHostUnregister, ptr)  # (before its memory is freed)
    fin.atexit = False  # (never after the CUDA context is gone)
    return True
