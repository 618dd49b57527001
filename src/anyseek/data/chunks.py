"""Chunks of documents for prepare: read in source order, cleaned in a process pool when the source needs it,
and assigned to train or val by a keyed hash of their text."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator

from anyseek.data.sources import Raw, Skip, Source


def _clean_job(cleaner, texts: list[str], skips: list[Skip], wheres: list[str]) -> tuple[list[str], list[Skip]]:
    """Run a source's cleaner over one chunk; pages that come out empty (or that it fails on) become skips."""
    cleaned = cleaner(texts)
    for text, where in zip(cleaned, wheres):
        if not text:
            skips.append(Skip("empty_after_cleaning" if text is not None else "cleaning_failed", where))
    return [t for t in cleaned if t], skips


def _raw_chunks(src: Source, chunk_bytes: int = 1 << 20, chunk_docs: int = 4096):
    """(texts, skips, wheres) in source order; `wheres` names the texts of Raw items (empty for plain documents)."""
    texts, skips, wheres, size = [], [], [], 0
    for item in src.items():
        if isinstance(item, Skip):
            skips.append(item)
            continue
        if isinstance(item, Raw):
            wheres.append(item.where)
            item = item.text
        texts.append(item)
        size += len(item)
        if size >= chunk_bytes or len(texts) >= chunk_docs:
            yield texts, skips, wheres
            texts, skips, wheres, size = [], [], [], 0
    if texts or skips:
        yield texts, skips, wheres


def iter_chunks(src: Source, pool=None, window: int = 8) -> Iterator[tuple[list[str], list[Skip]]]:
    """(documents, skips) in source order; a source's cleaner runs in `pool` with at most `window` chunks queued."""
    if src.cleaner is None:
        for texts, skips, _ in _raw_chunks(src):
            yield texts, skips
        return
    if pool is None:
        for chunk in _raw_chunks(src):
            yield _clean_job(src.cleaner, *chunk)
        return
    pending: deque = deque()
    for chunk in _raw_chunks(src):
        pending.append(pool.apply_async(_clean_job, (src.cleaner, *chunk)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def val_mask(texts: list[str], val_fraction: float, key: bytes) -> tuple[list[bool], list[int], list[int]]:
    """Per document: goes to val?, utf-8 size; and the indexes of documents that are not valid Unicode."""
    threshold = int(val_fraction * (1 << 64))
    is_val, sizes, bad = [], [], []
    for i, text in enumerate(texts):
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from JSON escapes
            bad.append(i)
            data = b""
        digest = hashlib.blake2b(data, digest_size=8, key=key).digest()
        is_val.append(int.from_bytes(digest, "little") < threshold)
        sizes.append(len(data))
    return is_val, sizes, bad


def split_key(seed: int) -> bytes:
    return int(seed).to_bytes(8, "little", signed=True)
