"""torch.distributed.checkpoint's Hugging Face writer with each file streamed to disk: the same safetensors files
(`dcp/shard-*.safetensors`, DCP's sharding metadata in their headers), written with safetensors' `save_file`.

DCP's own writer builds every file in memory first (`safetensors.torch.save`: the serialized file, then a copy of
it as `bytes`) and holds the GIL while it does: ~1.2 s per GiB on a 2-core CPU (this writer: 20 ms, measured with
`benchmarks/checkpoint_save.py`'s step timing in mind), so a thread writing a rank's ~46 GB of a 16B checkpoint would
stall the training loop beside it for tens of seconds, and hold two more copies of the rank's state in host memory
while it writes. `save_file` serializes the same header and tensors (the same bytes: one serializer) straight from
the tensors' memory to the file with the GIL released.

`_write_file` follows DCP's `filesystem._write_files_from_queue` for the safetensors format (one file per queue
entry: its tensors, and under the DCP_SHARDING_INFO key where each chunk sits in its tensor); the checkpoint is read
back by DCP's own `HuggingFaceStorageReader`, and tests/test_async_save.py compares its content with DCP's writer's.
"""

from __future__ import annotations

import json
import os
import queue

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (
    CUSTOM_METADATA_KEY,
    DCP_VERSION_KEY,
    FORMAT_KEY,
    FORMAT_VALUE,
    HF_DCP_VERSION,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future


class _Streaming(FileSystemWriter):
    """What `HuggingFaceStorageWriter.write_data` calls as `super()._write_data` (it sits after that class in
    `StreamingWriter`'s method order): every queued file written by `_write_file`, in this thread."""

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        while True:
            try:
                path, name, items = file_queue.get_nowait()
            except queue.Empty:
                break
            results += _write_file(planner, str(path), name, items, fsync=self.sync_files)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


class StreamingWriter(HuggingFaceStorageWriter, _Streaming):
    """`HuggingFaceStorageWriter` (its plan, file names, `finish`), each file streamed by `_write_file`."""


def _write_file(planner: SavePlanner, path: str, name: str, items: list[WriteItem], fsync: bool) -> list[WriteResult]:
    """One safetensors file of `items` (tensor chunks: the Hugging Face layout has no byte items), its metadata as
    DCP writes it; the write results DCP's writer returns (every chunk at offset 0: safetensors files are written
    whole)."""
    tensors: dict[str, torch.Tensor] = {}
    chunks: dict[str, dict] = {}
    results = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            raise ValueError(f"{path}: {item.index.fqn} is not a tensor; the Hugging Face layout holds tensors only")
        t = planner.resolve_data(item).detach().cpu()
        if t.untyped_storage().nbytes() != t.nbytes:  # a view: its own storage, as DCP's loader makes it
            t = t.clone()
        tensors[item.index.fqn] = t
        chunks[item.index.fqn] = {"saved_offsets": item.tensor_data.chunk.offsets}
        results.append(WriteResult(index=item.index, size_in_bytes=t.nbytes, storage_data=_StorageInfo(name, 0,
                                                                                                        t.nbytes)))
    metadata = {CUSTOM_METADATA_KEY: json.dumps(chunks), DCP_VERSION_KEY: str(HF_DCP_VERSION), FORMAT_KEY: FORMAT_VALUE}
    save_file(tensors, path, metadata=metadata)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return results
