"""MediaWiki XML dumps -> plain prose.

`iter_pages(path)` streams the pages of an enwiki dump (`.xml`, `.xml.bz2`, multistream `.xml.bz2`, or a fragment
of `<page>` elements without the `<mediawiki>` header) and `clean_wikitext(text)` turns one page's wikitext into
plain prose with mwparserfromhell: templates, references, tables, file/image/category links, comments and HTML
markup removed; link, bold/italic and heading text kept.

Only articles are documents: namespace 0 and not a redirect. Everything else is reported as a skip with a reason,
so the manifest can count it. Line numbers are approximate (the line reached when the page closed).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from anyseek.data.compressed import DAMAGE_ERRORS, open_binary

# Namespaces of English Wikipedia, used when a page has no <ns> element and the dump has no <siteinfo>.
_DEFAULT_NAMESPACES = [
    "Talk", "User", "User_talk", "Wikipedia", "Wikipedia_talk", "WP", "File", "File_talk", "Image", "MediaWiki",
    "MediaWiki_talk", "Template", "Template_talk", "Help", "Help_talk", "Category", "Category_talk", "Portal",
    "Portal_talk", "Draft", "Draft_talk", "TimedText", "TimedText_talk", "Module", "Module_talk", "Special", "Media",
    "Book", "Education_Program", "Gadget", "Gadget_definition", "Topic",
]  # fmt: skip
# Link prefixes whose link is not prose (images, categories, interwiki/interlanguage links are dropped).
_DROP_LINK_PREFIXES = {"file", "image", "category", "media"}
_INTERLANG_RE = re.compile(r"^:?[a-z]{2,3}(-[a-z]+)?:")
# Tags whose content is not prose.
_DROP_TAGS = {
    "ref", "references", "table", "gallery", "math", "chem", "timeline", "imagemap", "score", "graph", "syntaxhighlight",
    "source", "pre", "templatedata", "mapframe", "maplink", "inputbox", "categorytree", "noinclude", "hiero", "ce",
    "style", "script", "code",
}  # fmt: skip
_BREAK_TAGS = {"br", "p", "div", "tr", "hr"}
_DROP_SECTIONS = {
    "references", "external links", "see also", "further reading", "notes", "notes and references", "bibliography",
    "sources", "citations", "footnotes", "works cited", "references and notes", "gallery", "explanatory notes",
}  # fmt: skip
_HEADING = "\x01"  # marks a heading line (followed by its level digit) until the final clean-up
_MAGIC_RE = re.compile(r"__[A-Z]+__")
_QUOTES_RE = re.compile(r"'{2,}")
_LEFTOVER_RE = re.compile(r"\{\{|\}\}|\[\[|\]\]")  # unbalanced markup the parser kept as text
_SPACES_RE = re.compile(r"[ \t\u00a0]+")
_EMPTY_PARENS_RE = re.compile(r"\(\s*[,;]?\s*\)")
_PAREN_OPEN_RE = re.compile(r"\(\s*(?:[,;]\s*)+")  # "( ; born 1900)" once the pronunciation template is gone
_PAREN_CLOSE_RE = re.compile(r"(?:\s*[,;])+\s*\)")
_REPEATED_SEP_RE = re.compile(r"([,;])(?:\s*[,;])+")
# Templates whose output is prose: name -> which positional parameter to keep ("all": joined with spaces).
_KEEP_TEMPLATES = {
    "nowrap": 1, "nobr": 1, "small": 1, "big": 1, "em": 1, "strong": 1, "var": 1, "abbr": 1, "sic": 1, "lang": 2,
    "transl": -1, "transliteration": -1, "nihongo": 1, "ill": 1, "interlanguage link": 1, "keypress": 1, "math": 1,
    "mvar": 1, "sub": 1, "sup": 1, "not a typo": 1, "proper name": 1, "noitalic": 1, "nastaliq": 1, "script": -1,
    "convert": "value unit", "cvt": "value unit", "circa": "c.", "c.": "c.",
}  # fmt: skip
_LITERAL_TEMPLATES = {"!": "|", "ndash": "–", "mdash": "—", "snd": " – ", "spaced ndash": " – ", "'": "'", "=": "=",
                      "nbsp": " ", "-": "", "shy": "", "zwsp": "", "dot": " · ", "middot": "·"}  # fmt: skip
_BLANKS_RE = re.compile(r"\n{3,}")


class WikiDumpError(ValueError):
    """The dump cannot be read at all (names the file)."""


@dataclass
class Page:
    """One <page> of a dump: `skip` is None for an article, else the reason it is not a document."""

    title: str
    text: str | None
    line: int
    skip: str | None = None


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _namespace_of(title: str, ns_text: str | None, prefixes: set[str]) -> int:
    if ns_text is not None and ns_text.strip().lstrip("-").isdigit():
        return int(ns_text)
    head, sep, _ = title.partition(":")
    return 1 if sep and head.replace(" ", "_").lower() in prefixes else 0


def _page_from(elem: ET.Element, line: int, prefixes: set[str]) -> Page:
    fields: dict[str, ET.Element] = {}
    for child in elem.iter():
        name = _local(child.tag)
        if name not in fields or name == "text":  # history dumps: the last revision's text
            fields[name] = child
    title = (fields["title"].text or "") if "title" in fields else ""
    ns_el = fields.get("ns")
    text_el = fields.get("text")
    text = text_el.text if text_el is not None else None
    if _namespace_of(title, ns_el.text if ns_el is not None else None, prefixes) != 0:
        return Page(title, None, line, "non_article_namespace")
    if "redirect" in fields or (text and text.lstrip()[:9].upper() == "#REDIRECT"):
        return Page(title, None, line, "redirect")
    if text is None or not text.strip():
        return Page(title, None, line, "page_without_text")
    return Page(title, text, line)


def iter_pages(path: str | Path, chunk_bytes: int = 1 << 16) -> Iterator[Page]:
    """Stream the pages of a MediaWiki XML dump. A truncated file ends the stream with a Page whose skip is
    "truncated_file" (the pages before it are kept). `line` is the line of the page's end tag."""
    path = Path(path)
    prefixes = {p.lower() for p in _DEFAULT_NAMESPACES}
    parser = ET.XMLPullParser(events=("start", "end"))
    depth, root, started, fragment, line = 0, None, False, False, 1
    try:
        with open_binary(path) as f:
            read = getattr(f, "read1", f.read)  # read1: the data before a truncation point still comes out
            while True:
                try:
                    data = read(chunk_bytes)
                except DAMAGE_ERRORS:  # truncated or corrupt .bz2 / .gz / .xz
                    yield Page("", None, line, "truncated_file")
                    return
                if not data:
                    break
                if not started:
                    started = True
                    head = data.lstrip()
                    if head.startswith(b"<?xml"):
                        head = head[head.index(b"?>") + 2 :].lstrip()
                    fragment = not head.startswith(b"<mediawiki")
                    if fragment:
                        parser.feed(b"<mediawiki>")  # a fragment of <page> elements: give it a root
                line += data.count(b"\n")
                parser.feed(data)
                for event, elem in parser.read_events():
                    name = _local(elem.tag)
                    if event == "start":
                        depth += 1
                        root = elem if root is None else root
                        continue
                    depth -= 1
                    if name == "namespace" and elem.text and elem.get("key", "0") != "0":
                        prefixes.add(elem.text.replace(" ", "_").lower())
                    elif name == "page":
                        yield _page_from(elem, line, prefixes)
                        root.clear()  # keep memory flat on multi-GB dumps
                    elif name == "siteinfo":
                        root.clear()
            if not started:
                return
            if depth > 1 or (depth == 1 and not fragment):  # the file stops mid-page
                yield Page("", None, line, "truncated_file")
                return
    except ET.ParseError as e:
        raise WikiDumpError(f"{path}: malformed XML near line {line} ({e})") from e
    if fragment:  # a fragment of <page> elements has no closing </mediawiki>
        try:
            parser.feed(b"</mediawiki>")
            parser.close()
        except ET.ParseError:
            yield Page("", None, line, "truncated_file")


def _node_text(nodes, out: list[str]) -> None:
    import mwparserfromhell.nodes as N

    for node in nodes:
        if isinstance(node, N.Text):
            out.append(node.value)
        elif isinstance(node, N.Wikilink):
            title = str(node.title).strip()
            prefix = title.lstrip(":").split(":", 1)[0].strip().lower() if ":" in title else ""
            if prefix in _DROP_LINK_PREFIXES or _INTERLANG_RE.match(title):
                continue
            if node.text is not None:
                _node_text(node.text.nodes, out)
            else:
                _node_text(node.title.nodes, out)
        elif isinstance(node, N.ExternalLink):
            if node.title is not None:
                _node_text(node.title.nodes, out)
        elif isinstance(node, N.Heading):
            out.append("\n\n")
            _node_text(node.title.nodes, out)
            out.append("\n")
        elif isinstance(node, N.Tag):
            tag = str(node.tag).strip().lower()
            if tag in _DROP_TAGS:
                continue
            if tag in _BREAK_TAGS:
                out.append("\n")
            if node.contents is not None:
                _node_text(node.contents.nodes, out)
        elif isinstance(node, N.HTMLEntity):
            try:
                out.append(node.normalize())
            except ValueError:
                pass
        elif isinstance(node, N.Template):
            out.append(_template_text(node))
        # Comment, Argument: dropped


def _template_text(node) -> str:
    """The prose a few common inline templates stand for ({{lang|fr|...}}, {{convert|12|km}}, {{nowrap|...}}); ""
    for every other template (infoboxes, citations, navigation boxes)."""
    name = str(node.name).strip().lower().replace("_", " ")
    if name in _LITERAL_TEMPLATES:
        return _LITERAL_TEMPLATES[name]
    keep = _KEEP_TEMPLATES.get(name)
    if keep is None and name.startswith("lang-"):
        keep = 1
    if keep is None:
        return ""
    args = []
    for param in node.params:
        if not param.showkey:
            part: list[str] = []
            _node_text(param.value.nodes, part)
            args.append("".join(part).strip())
    if not args:
        return ""
    if keep == "value unit":
        return " ".join(args[:2])
    if keep == "c.":
        return f"c. {args[0]}"
    index = keep - 1 if keep > 0 else len(args) + keep
    return args[index] if 0 <= index < len(args) else ""


def clean_wikitext(text: str) -> str:
    """Wikitext -> plain prose (may return "" when nothing is left). Sections that are lists of sources or links
    (References, External links, See also, ...) are dropped, and so are headings left without text."""
    try:
        import mwparserfromhell
        from mwparserfromhell.nodes import Heading
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError('XML dumps need mwparserfromhell: pip install "anyseek[data]"') from e
    out: list[str] = []
    skip_level = None
    for node in mwparserfromhell.parse(text).nodes:
        if isinstance(node, Heading):
            if skip_level is not None and node.level > skip_level:
                continue  # a subsection of a dropped section
            dropped = node.title.strip_code().strip().lower() in _DROP_SECTIONS
            skip_level = node.level if dropped else None
            if not dropped:
                out.append(f"\n\n{_HEADING}{node.level}")
                _node_text(node.title.nodes, out)
                out.append("\n")
        elif skip_level is None:
            _node_text([node], out)
    prose = _LEFTOVER_RE.sub("", _QUOTES_RE.sub("", _MAGIC_RE.sub("", "".join(out))))
    lines = []
    for line in prose.split("\n"):
        line = _EMPTY_PARENS_RE.sub("", _SPACES_RE.sub(" ", line))
        line = _REPEATED_SEP_RE.sub(r"\1", _PAREN_CLOSE_RE.sub(")", _PAREN_OPEN_RE.sub("(", line))).strip()
        line = line.replace(" ,", ",").replace(" .", ".")
        if line.startswith(("|", "!", "{|", "|}")):  # table rows the parser left as text
            continue
        lines.append(line)
    return _BLANKS_RE.sub("\n\n", "\n".join(_keep_headings_with_text(lines))).strip()


def _keep_headings_with_text(lines: list[str]) -> list[str]:
    """Drop heading lines (marked with their level) that no text follows before the next heading of their level."""
    kept = []
    for i, line in enumerate(lines):
        if not line.startswith(_HEADING):
            kept.append(line)
            continue
        level = line[1]
        for nxt in lines[i + 1 :]:
            if nxt.startswith(_HEADING) and nxt[1] <= level:
                break
            if nxt and not nxt.startswith(_HEADING):
                kept.append(line[2:].strip())
                break
    return kept


def clean_pages(texts: list[str]) -> list[str | None]:
    """Pool worker: clean a chunk of wikitext pages; None for a page the parser fails on (counted, not fatal)."""
    out: list[str | None] = []
    for text in texts:
        try:
            out.append(clean_wikitext(text))
        except (RecursionError, ValueError, TypeError, AttributeError, IndexError):
            out.append(None)
    return out
