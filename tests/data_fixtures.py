"""Fixture builders for the data tests (synthetic enwiki dump, wikimedia-schema parquet, jsonl with bad lines).

Everything is written by the tests into tmp folders; no network, no real Wikipedia text.
"""

from __future__ import annotations

import bz2
import json
from pathlib import Path

HEADER = """<?xml version="1.0" encoding="utf-8"?>
<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">
  <siteinfo>
    <sitename>Wikipedia</sitename>
    <namespaces>
      <namespace key="0" case="first-letter" />
      <namespace key="1" case="first-letter">Talk</namespace>
      <namespace key="10" case="first-letter">Template</namespace>
    </namespaces>
  </siteinfo>
"""
FOOTER = "</mediawiki>\n"

ARTICLE = """{{Short description|A made-up river}}
{{Infobox river
| name = Quillow {{nowrap|River}}
| length = {{convert|12|km|mi}}
}}
The '''Quillow River''' is a short river in [[Examplestan|the republic]] of [[Examplestan]].<ref>{{cite web|url=https://x.example|title=Rivers}}</ref> It flows ''north''.<!-- editors: check -->
[[File:Quillow.jpg|thumb|right|The river in [[spring]]]]

== Course ==
The river rises near [[Mount Sample]]<ref name="a">Atlas, p. 3.</ref> and joins the [[Big River]].
{| class="wikitable"
|-
! Town !! Population
|-
| Northby || 1,200
|}
It is <b>calm</b> &amp; <span class="x">clean</span>.

=== Wildlife ===
* Trout
* Herons

=== Empty subsection ===
{{Main|Fish of Examplestan}}

== See also ==
* [[Other river]]

== References ==
<references />
[[Category:Rivers of Examplestan]]
[[fr:Quillow]]
"""


def page(title: str, text: str | None, ns: int | None = 0, redirect: str | None = None) -> str:
    from xml.sax.saxutils import escape

    parts = [f"  <page>\n    <title>{escape(title)}</title>\n"]
    if ns is not None:
        parts.append(f"    <ns>{ns}</ns>\n")
    parts.append("    <id>1</id>\n")
    if redirect:
        parts.append(f'    <redirect title="{escape(redirect)}" />\n')
    parts.append("    <revision>\n      <id>2</id>\n")
    if text is not None:
        parts.append(f'      <text bytes="{len(text)}" xml:space="preserve">{escape(text)}</text>\n')
    parts.append("    </revision>\n  </page>\n")
    return "".join(parts)


def dump_pages(n_extra: int = 0) -> list[str]:
    pages = [
        page("Quillow River", ARTICLE),
        page("Quillow", "#REDIRECT [[Quillow River]]", redirect="Quillow River"),
        page("Talk:Quillow River", "Is this river real? ~~~~", ns=1),
        page("Template:Infobox river", "{{{name}}}", ns=10),
        page("Empty page", None),
        page("Only a template", "{{Disambiguation}}"),
    ]
    pages += [
        page(f"Article {i}", f"'''Article {i}''' is number [[{i}]] in a list.\n\nSecond paragraph {i}.")
        for i in range(n_extra)
    ]
    return pages


def write_dump(path: Path, pages: list[str], header: bool = True, compress: bool = False) -> Path:
    text = (HEADER if header else "") + "".join(pages) + (FOOTER if header else "")
    data = text.encode()
    path.write_bytes(bz2.compress(data, compresslevel=1) if compress else data)  # 100 kB blocks
    return path


def write_multistream(path: Path, pages: list[str]) -> Path:
    """Like enwiki's multistream dumps: header, then pages in groups, then the footer, each its own bz2 stream."""
    streams = [HEADER, "".join(pages[:3]), "".join(pages[3:]), FOOTER]
    path.write_bytes(b"".join(bz2.compress(s.encode()) for s in streams))
    return path


def write_wikimedia_parquet(path: Path, texts: list[str | None]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(texts)
    table = pa.table({
        "id": [str(i) for i in range(n)],
        "url": [f"https://en.wikipedia.example/wiki?curid={i}" for i in range(n)],
        "title": [f"Title {i}" for i in range(n)],
        "text": texts,
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=3)
    return path


def write_jsonl_with_bad_lines(path: Path) -> Path:
    lines = [
        json.dumps({"text": "First good document."}).encode(),
        b'{"text": "unterminated',
        json.dumps({"title": "no text field"}).encode(),
        b"",
        json.dumps({"text": "Second good document, caf\u00e9."}).encode(),
        b'{"text": "bad byte \xff here"}',
        json.dumps({"text": "   "}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps([1, 2]).encode(),
        json.dumps({"text": "Third good document."}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def corpus(n: int, seed: int = 0) -> list[str]:
    """n varied synthetic documents (lengths from a few words to a few hundred)."""
    import random

    rng = random.Random(seed)
    words = [
        "the",
        "river",
        "of",
        "a",
        "town",
        "north",
        "old",
        "stone",
        "bridge",
        "king",
        "city",
        "sea",
        "war",
        "music",
        "art",
        "year",
        "people",
        "land",
        "long",
        "water",
    ]
    docs = []
    for i in range(n):
        k = rng.choice([3, 10, 40, 150, 400])
        body = " ".join(rng.choice(words) for _ in range(k))
        docs.append(f"Document {i}: {body.capitalize()}. Ünïcode ✓ {i * 7}.")
    return docs
