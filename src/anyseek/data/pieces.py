"""Packing: a window of a document stream -> token ids, next-token targets and segment boundaries.

A rank's epoch is a stream of documents in a fixed order; a micro-batch is the window [pos, pos + N) of that
stream. Documents cut by the window's edges become pieces; a piece longer than `max_seqlen` is cut again into
segments of at most `max_seqlen`. Every segment gets its own cu_seqlens entry, so attention never crosses a cut.
Targets are the next token of the same document even across a cut (nothing is lost by splitting); the last token of
a document (the end-of-document token) has target -100.

Shapes: N tokens in the window, P pieces, B segments.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from anyseek.constants import IGNORE_INDEX
from anyseek.data.shards import SplitData


@dataclass
class Pieces:
    """Parts of documents in stream order: document `doc_P`, tokens [start_P, stop_P) of it."""

    doc_P: np.ndarray  # int64
    start_P: np.ndarray  # int64
    stop_P: np.ndarray  # int64


def window(order_D: np.ndarray, starts_D: np.ndarray, ends_D: np.ndarray, pos: int, n: int) -> Pieces:
    """The pieces covering stream positions [pos, pos + n) (pos + n <= ends_D[-1]); starts_D / ends_D are the
    stream positions where the documents of order_D begin and end."""
    first = int(np.searchsorted(ends_D, pos, side="right"))
    last = int(np.searchsorted(ends_D, pos + n, side="left"))  # the document holding position pos + n - 1
    doc_start = starts_D[first : last + 1]
    start = np.maximum(pos - doc_start, 0)
    stop = np.minimum(pos + n, ends_D[first : last + 1]) - doc_start
    return Pieces(order_D[first : last + 1], start, stop)


def assemble(data: SplitData, pieces: Pieces, max_seqlen: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Pieces -> (input_ids int64 [N], targets int64 [N], cu_seqlens int32 [B+1], longest segment)."""
    parts, ends, after = [], [], []
    total = 0
    for d, a, b in zip(pieces.doc_P.tolist(), pieces.start_P.tolist(), pieces.stop_P.tolist()):
        doc = data.document(d)
        parts.append(doc[a:b])
        total += b - a
        ends.append(total)
        after.append(int(doc[b]) if b < len(doc) else IGNORE_INDEX)
    input_ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    targets = np.empty_like(input_ids)
    targets[:-1] = input_ids[1:]
    ends_P = np.asarray(ends, np.int64)
    if len(ends_P):
        targets[ends_P - 1] = after  # a piece's last token: the document's real next token, or -100
    cu = segment_bounds(ends_P, max_seqlen)
    longest = int(np.diff(cu).max()) if len(cu) > 1 else 0
    return input_ids, targets, cu.astype(np.int32), longest


def segment_bounds(ends_P: np.ndarray, max_seqlen: int) -> np.ndarray:
    """Piece ends -> cu_seqlens [B+1] with every segment at most max_seqlen long."""
    bounds = np.concatenate([[0], ends_P]).astype(np.int64)
    lens = np.diff(bounds)
    if len(lens) == 0 or lens.max() <= max_seqlen:
        return bounds
    extra = [np.arange(s + max_seqlen, e, max_seqlen) for s, e in itertools.pairwise(bounds) if e - s > max_seqlen]
    return np.sort(np.concatenate([bounds, *extra]))
