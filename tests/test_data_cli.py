"""`anyseek prepare` and `anyseek data inspect` through the CLI dispatcher; hf: sources with a stand-in `datasets`."""

from __future__ import annotations

import json
import sys
import types

import pytest
from data_fixtures import corpus, dump_pages, write_dump

from anyseek.cli import main
from anyseek.data.shards import read_manifest


def test_prepare_then_inspect(tmp_path, capsys):
    dump = write_dump(tmp_path / "dump.xml", dump_pages(30))
    out = tmp_path / "out"
    rc = main(["prepare", "--source", str(dump), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.2",
               "--quiet"])  # fmt: skip
    assert rc == 0 and capsys.readouterr().out.strip() == str(out)
    m = read_manifest(out)
    assert m["skipped"]["redirect"] == 1
    assert main(["data", "inspect", str(out), "--docs", "2", "--max-chars", "80"]) == 0
    text = capsys.readouterr().out
    assert "train" in text and "val" in text and "redirect" in text and "non_article_namespace" in text
    assert "The Quillow River is a short river" in text  # a decoded document
    assert main(["data", "inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fingerprint"] == m["fingerprint"]


def test_cli_errors_are_short_and_named(tmp_path, capsys):
    assert main(["prepare", "--source", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "nope.jsonl: no such file or folder" in capsys.readouterr().err
    assert main(["data", "inspect", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["data"]) == 2


def test_txt_blank_line_mode_via_cli(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(corpus(30)))
    out = tmp_path / "out"
    assert main(["prepare", "--source", str(tmp_path / "a.txt"), "--out", str(out), "--vocab-size", "300",
                 "--txt-docs", "blank-line", "--val-fraction", "0", "--quiet"]) == 0  # fmt: skip
    m = read_manifest(out)
    assert m["documents"] == {"train": 30, "val": 0}
    assert main(["prepare", "--source", str(tmp_path / "a.txt"), "--out", str(out), "--vocab-size", "300",
                 "--txt-docs", "blank-line", "--val-fraction", "0", "--max-docs", "7", "--quiet"]) == 0  # fmt: skip
    m = read_manifest(out)
    assert m["documents"] == {"train": 7, "val": 0} and m["source"]["max_documents"] == 7


def test_hf_source_streams_records(tmp_path, monkeypatch):
    rows = [{"id": str(i), "title": f"T{i}", "text": d} for i, d in enumerate(corpus(40))] + [{"text": None}]

    class FakeStream:
        column_names = ("id", "title", "text")

        def __iter__(self):
            return iter(rows)

    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return FakeStream()

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr("anyseek.data.hf.check_online", lambda spec, timeout_s=3.0: None)
    from anyseek.data.prepare import prepare

    m = prepare("hf:wikimedia/wikipedia:20231101.en", tmp_path / "out", 300, progress=False)
    assert calls == [("wikimedia/wikipedia", "20231101.en", "train", True)]
    assert m["documents"]["train"] + m["documents"]["val"] == 40 and m["skipped"] == {"null_text": 1}
    assert m["source"]["dataset"] == "wikimedia/wikipedia" and m["source"]["text_column"] == "text"
    from anyseek.data.sources import SourceError

    with pytest.raises(SourceError, match="no column 'body'"):
        prepare("hf:wikimedia/wikipedia", tmp_path / "o2", 300, text_column="body", progress=False)
