"""Token shards on disk: the format `prepare` writes and the loader memory-maps.

DATA_DIR/
    manifest.json                 written last (atomically): what the shards hold; no manifest = not prepared
    tokenizer/                    tokenizer.json, tokenizer_config.json, special_tokens_map.json
    {split}-{k:05d}.bin           raw token ids, little-endian uint16 (vocab <= 65536) or uint32
    {split}-{k:05d}.idx.npy       int64 [D+1] document offsets into the .bin (doc i = tokens[off[i]:off[i+1]])

Every document ends with the end-of-document token, so the offsets are also the boundaries the model sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT = "anyseek-tokens-v1"
SHARD_TOKENS = 1 << 28  # 256M tokens (512 MB as uint16) per shard file


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends chunks of documents of one split to numbered shard files in `folder`."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._offsets: list[np.ndarray] = []
        self._tokens = 0

    def _open_next(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}"
        self._file = open(self.folder / f"{name}.bin", "wb")  # noqa: SIM115  closed in _close_current
        self._offsets, self._tokens = [np.zeros(1, np.int64)], 0
        self.shards.append({"tokens": f"{name}.bin", "offsets": f"{name}.idx.npy", "documents": 0, "num_tokens": 0})

    def _close_current(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        offsets = np.concatenate(self._offsets)
        np.save(self.folder / self.shards[-1]["offsets"], offsets, allow_pickle=False)
        self.shards[-1].update(documents=len(offsets) - 1, num_tokens=int(offsets[-1]))

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """tokens: ids [sum(lengths)] of several documents back to back (each ending with eos); lengths [D]."""
        if len(lengths) == 0:
            return
        if self._file is None or (self._tokens and self._tokens + len(tokens) > self.shard_tokens):
            self._close_current()
            self._open_next()
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._offsets.append(self._tokens + np.cumsum(lengths, dtype=np.int64))
        self._tokens += len(tokens)

    def close(self) -> dict:
        """Finish the last shard -> the split's manifest entry."""
        self._close_current()
        return {
            "documents": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["num_tokens"] for s in self.shards),
            "shards": self.shards,
        }


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{data_dir}: no {MANIFEST}; prepare the data first (`anyseek prepare --out DIR`)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}; prepare again")
    return manifest


def missing_files(data_dir: Path, manifest: dict) -> list[str]:
    """Shard files the manifest names that are absent or of the wrong size (empty when complete)."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    problems = []
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            bin_path, idx_path = data_dir / shard["tokens"], data_dir / shard["offsets"]
            if not bin_path.is_file() or bin_path.stat().st_size != shard["num_tokens"] * itemsize:
                problems.append(str(bin_path))
            if not idx_path.is_file():
                problems.append(str(idx_path))
    return problems


@dataclass
class SplitData:
    """One split, memory-mapped: document d is tokens[doc_shard[d]][doc_start[d] : doc_start[d] + doc_len[d]]."""

    tokens: list[np.ndarray]
    doc_shard: np.ndarray  # int32 [D]
    doc_start: np.ndarray  # int64 [D]
    doc_len: np.ndarray  # int64 [D]

    @property
    def num_docs(self) -> int:
        return len(self.doc_len)

    def document(self, d: int) -> np.ndarray:
        start = self.doc_start[d]
        return self.tokens[self.doc_shard[d]][start : start + self.doc_len[d]]


def open_split(data_dir: str | Path, split: str, manifest: dict | None = None) -> SplitData:
    data_dir = Path(data_dir)
    manifest = manifest or read_manifest(data_dir)
    if split not in manifest["splits"]:
        raise KeyError(f"{data_dir}: no split {split!r}; splits are {sorted(manifest['splits'])}")
    dtype = np.dtype(manifest["dtype"])
    tokens, shard_ids, starts, lens = [], [], [], []
    for k, shard in enumerate(manifest["splits"][split]["shards"]):
        n = shard["num_tokens"]
        path = data_dir / shard["tokens"]
        tokens.append(np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype))
        offsets = np.load(data_dir / shard["offsets"], allow_pickle=False)
        if len(offsets) != shard["documents"] + 1 or offsets[-1] != n:
            raise ValueError(f"{data_dir / shard['offsets']}: does not match the manifest; prepare again")
        shard_ids.append(np.full(len(offsets) - 1, k, np.int32))
        starts.append(offsets[:-1])
        lens.append(np.diff(offsets))
    if not tokens:
        empty = np.zeros(0, np.int64)
        return SplitData([], np.zeros(0, np.int32), empty, empty)
    return SplitData(tokens, np.concatenate(shard_ids), np.concatenate(starts), np.concatenate(lens))
