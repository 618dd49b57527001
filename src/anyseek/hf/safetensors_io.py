"""Safetensors folders on disk: find the weight files, read their headers, read tensors, write shards.

Knows nothing of the model: names here are the checkpoint's own. Nothing is ever unpickled.
A folder holds either `model.safetensors` or shards listed by `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}`).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from anyseek.storage import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype tags -> torch dtypes (only the ones a checkpoint of ours can hold)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "F16": 2, "BF16": 2}
_ITEMSIZE.update({"I32": 4, "F32": 4, "I64": 8, "F64": 8})
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    name: str
    file: Path
    dtype: str  # safetensors tag, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header without reading tensor data.

    Raises CheckpointError naming `file` when the header is unreadable or the data it describes does not fit
    the file (a truncated download, a file that is not safetensors).
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: not a safetensors file ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{file}: corrupt safetensors header (header length {n} bytes, file is {size} bytes; "
                    "truncated, or not a safetensors file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header (invalid JSON: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    out: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors header entry for tensor {name!r}") from e
        numel = 1
        for s in shape:
            numel *= s
        if dtype in _ITEMSIZE and end - begin != numel * _ITEMSIZE[dtype]:
            raise CheckpointError(f"{file}: tensor {name!r} {dtype}{list(shape)} has {end - begin} bytes of data")
        out[name] = TensorInfo(name, file, dtype, shape)
        data_end = max(data_end, end)
    if 8 + n + data_end > size:
        raise CheckpointError(
            f"{file}: truncated safetensors file: its header describes {8 + n + data_end} bytes, the file has {size}"
        )
    return out


def scan_folder(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint in `folder` by name, from `model.safetensors` or the shards of the index."""
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.is_file():
        return read_header(single)
    if index.is_file():
        return _scan_index(index)
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    if pickles:
        raise CheckpointError(
            f"{folder}: holds only pickle weights ({', '.join(pickles[:3])}); anyseek never unpickles checkpoints. "
            "Convert them to safetensors first, e.g. with transformers: "
            "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder)"
        )
    raise CheckpointError(f"{folder}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE})")


def _scan_index(index: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{index}: not a valid index (need a JSON object with a 'weight_map')") from e
    headers: dict[str, dict[str, TensorInfo]] = {}
    for shard in sorted(set(weight_map.values())):
        file = index.parent / shard
        if not file.is_file():
            names = [k for k, v in weight_map.items() if v == shard]
            raise CheckpointError(
                f"{index}: lists shard {shard!r} (for {len(names)} tensors, e.g. {names[0]}), but {file} does not exist"
            )
        headers[shard] = read_header(file)
    out: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise CheckpointError(f"{index}: maps tensor {name!r} to {shard}, which does not contain it")
        out[name] = headers[shard][name]
    return out


class TensorReader:
    """Reads tensors by TensorInfo, keeping one memory-mapped handle per file open."""

    def __init__(self) -> None:
        self._handles: dict[Path, object] = {}

    def get(self, info: TensorInfo) -> torch.Tensor:

        try:
            if info.file not in self._handles:
                self._handles[info.file] = safe_open(str(info.file), framework="pt", device="cpu")
            return self._handles[info.file].get_tensor(info.name)
        except SafetensorError as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r}: {e}") from e

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> TensorReader:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_size(size: int | str) -> int:
    """'5GB' -> 5*10**9, '500MiB' -> 500*2**20, ints pass through (bytes)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", size.upper())
    if not m:
        raise ValueError(f"max_shard_size: cannot parse {size!r} (use bytes or e.g. '5GB', '500MiB')")
    unit = m.group(2) or "B"
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base ** "BKMGT".index(unit[0]))


def nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def write_shards(
    entries: list[tuple[str, int, Callable[[], torch.Tensor]]], folder: Path, max_shard_size: int | str
) -> None:
    """Write `entries` (name, nbytes, make tensor) into `folder`: one `model.safetensors` if all fit in
    `max_shard_size`, else `model-0000i-of-0000n.safetensors` shards plus the index. Tensors are made shard by
    shard, so at most one shard is held in memory."""
    limit = parse_size(max_shard_size)
    groups: list[list[tuple[str, int, Callable]]] = [[]]
    used = 0
    for entry in entries:
        if groups[-1] and used + entry[1] > limit:
            groups.append([])
            used = 0
        groups[-1].append(entry)
        used += entry[1]
    names = (
        [SINGLE_FILE]
        if len(groups) == 1
        else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    )
    weight_map: dict[str, str] = {}
    for fname, group in zip(names, groups):
        # clone: safetensors refuses tensors that share storage (expert slices, the MTP copies of the embedding)
        tensors = {name: _owned_cpu_copy(make()) for name, _, make in group}
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
        del tensors
    if len(groups) > 1:
        total = sum(e[1] for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _owned_cpu_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.copy_(t.detach())
