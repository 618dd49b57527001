"""PackedLoader: packing invariants, targets across cuts, resume exactness, determinism, rank sharding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_fixtures import corpus

from anyseek.data.loader import PackedLoader
from anyseek.data.pieces import IGNORE_INDEX, segment_bounds
from anyseek.data.prepare import prepare
from anyseek.data.shards import open_split

T, S = 1000, 96  # tokens per batch, max segment length: small, so that cuts happen everywhere


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    (root / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus(160, seed=3)))
    prepare(str(root / "d.jsonl"), root / "out", vocab_size=300, val_fraction=0.2, progress=False)
    return root / "out"


def reference_stream(data_dir, split, order):
    """Tokens and targets of the documents in `order`, back to back, computed without the loader."""
    data = open_split(data_dir, split)
    ids = [data.document(d).astype(np.int64) for d in order]
    tgts = [np.append(x[1:], IGNORE_INDEX) for x in ids]
    starts = np.cumsum([0] + [len(x) for x in ids])[:-1]
    return np.concatenate(ids), np.concatenate(tgts), starts


def check_batch(b, tokens_per_batch=T, max_seqlen=S, full=True):
    n = b.num_tokens
    assert b.input_ids.dtype == torch.int64 and b.targets.dtype == torch.int64 and b.cu_seqlens.dtype == torch.int32
    assert b.targets.shape == b.input_ids.shape
    assert (n == tokens_per_batch) if full else (0 < n <= tokens_per_batch)
    cu = b.cu_seqlens.tolist()
    lens = np.diff(cu)
    assert cu[0] == 0 and cu[-1] == n and (lens > 0).all() and (lens <= max_seqlen).all()
    assert b.max_seqlen == lens.max() <= max_seqlen


def test_one_pass_equals_the_documents(data_dir):
    loader = PackedLoader(data_dir, "train", tokens_per_batch=T, max_seqlen=S, loop=False)
    batches = list(loader)
    assert len(batches) == len(loader) > 5
    for b in batches[:-1]:
        check_batch(b)
    check_batch(batches[-1], full=False)  # only the final pack may be short: no padding anywhere
    n_docs = open_split(data_dir, "train").num_docs
    ids, tgts, starts = reference_stream(data_dir, "train", range(n_docs))
    assert torch.equal(torch.cat([b.input_ids for b in batches]), torch.from_numpy(ids))
    # Targets survive every cut: a segment's last token still predicts its document's next token.
    assert torch.equal(torch.cat([b.targets for b in batches]), torch.from_numpy(tgts))
    assert (tgts == IGNORE_INDEX).sum() == n_docs  # exactly one unpredicted token (the eos) per document
    # No document crosses a pack boundary without being marked: every document start is a segment start.
    offset = 0
    for b in batches:
        cu = set(b.cu_seqlens.tolist())
        inside = starts[(starts >= offset) & (starts < offset + b.num_tokens)] - offset
        assert set(inside.tolist()) <= cu
        offset += b.num_tokens
    again = list(loader)  # a finished loop=False loader starts a new pass
    assert len(again) == len(batches) and torch.equal(again[0].input_ids, batches[0].input_ids)


def test_long_documents_are_split_at_max_seqlen():
    assert segment_bounds(np.array([5, 300, 310]), 100).tolist() == [0, 5, 105, 205, 300, 310]
    assert segment_bounds(np.array([100]), 100).tolist() == [0, 100]


def test_resume_at_exactly_the_next_token(data_dir):
    a = PackedLoader(data_dir, tokens_per_batch=T, max_seqlen=S, seed=7)
    it = iter(a)
    per_epoch = a.tokens_per_epoch
    k = per_epoch // T - 1  # stop just before an epoch boundary, so the resumed batches cross it
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(a.state_dict()))
    expected = [next(it) for _ in range(4)]
    b = PackedLoader(data_dir, tokens_per_batch=T, max_seqlen=S, seed=7)
    b.load_state_dict(state)
    got = [batch for _, batch in zip(range(4), b)]
    for x, y in zip(expected, got):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.targets, y.targets)
        assert torch.equal(x.cu_seqlens, y.cu_seqlens) and x.max_seqlen == y.max_seqlen
    assert b.state_dict()["epoch"] == 1
    # A different batch size after resuming still continues from the same token.
    c = PackedLoader(data_dir, tokens_per_batch=T * 3 // 2, max_seqlen=S, seed=7)
    c.load_state_dict(state)
    flat = torch.cat([x.input_ids for x in expected])
    got = torch.cat([batch.input_ids for _, batch in zip(range(2), c)])
    assert torch.equal(got, flat[: len(got)])


def test_epochs_are_deterministic_reshuffles(data_dir):
    a = PackedLoader(data_dir, tokens_per_batch=T, max_seqlen=S, seed=1)
    per_epoch = a.tokens_per_epoch
    whole = PackedLoader(data_dir, tokens_per_batch=per_epoch, max_seqlen=S, seed=1)
    e0, e1 = [b.input_ids for _, b in zip(range(2), whole)]
    assert not torch.equal(e0, e1)
    assert torch.equal(e0.sort().values, e1.sort().values)  # each epoch holds every document once
    first = next(iter(PackedLoader(data_dir, tokens_per_batch=T, max_seqlen=S, seed=1)))
    assert torch.equal(first.input_ids, e0[:T])
    other = next(iter(PackedLoader(data_dir, tokens_per_batch=T, max_seqlen=S, seed=2)))
    assert not torch.equal(first.input_ids, other.input_ids)
    check_batch(first)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_share_documents_disjointly(data_dir, world_size):
    data = open_split(data_dir, "val")
    total = int(data.doc_len.sum())
    streams = []
    for rank in range(world_size):
        loader = PackedLoader(data_dir, "val", tokens_per_batch=T, max_seqlen=S, rank=rank, world_size=world_size,
                              loop=False)  # fmt: skip
        streams.append(torch.cat([b.input_ids for b in loader]))
    assert sum(len(s) for s in streams) == total
    lens = loader.len_per_rank()
    assert len(lens) == world_size and lens[-1] == len(loader) == -(-len(streams[-1]) // T)
    assert torch.equal(torch.cat(streams).sort().values, torch.from_numpy(np.concatenate(
        [data.document(d) for d in range(data.num_docs)]).astype(np.int64)).sort().values)  # fmt: skip
    eos = 0
    assert sum(int((s == eos).sum()) for s in streams) == data.num_docs


def test_state_mismatch_and_bad_arguments(data_dir):
    a = PackedLoader(data_dir, tokens_per_batch=T, max_seqlen=S, seed=0)
    state = a.state_dict()
    b = PackedLoader(data_dir, tokens_per_batch=T, max_seqlen=S, seed=1)
    with pytest.raises(ValueError, match="'seed'"):
        b.load_state_dict(state)
    with pytest.raises(ValueError, match="rank"):
        PackedLoader(data_dir, rank=2, world_size=2)
    with pytest.raises(KeyError, match="no split 'test'"):
        PackedLoader(data_dir, "test")
    with pytest.raises(ValueError, match="fewer than world_size"):
        PackedLoader(data_dir, "val", world_size=10_000)


def test_batch_helpers(data_dir):
    b = next(iter(PackedLoader(data_dir, tokens_per_batch=T, max_seqlen=S)))
    cu = b.cu_seqlens.tolist()
    assert max(hi - lo for lo, hi in zip(cu, cu[1:])) == b.max_seqlen
    assert b.to("cpu").num_tokens == b.num_tokens and b.num_segments == len(cu) - 1
