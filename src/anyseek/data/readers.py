"""Readers of one file each: bytes -> documents (`str`), wikitext still to clean (`Raw`), or `Skip`s.

Every reader reports what it cannot use as `Skip(reason, where)` with the file and line (or row, item, key), and
stops with `SourceError` only when the file as a whole is unusable (a missing parquet column, JSON that does not
parse). Documents are stripped of surrounding whitespace; empty ones are skips.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from anyseek.data.compressed import DAMAGE_ERRORS, damage_reason, open_binary, read_bytes

TEXT_FIELDS = ("text", "content", "extract", "body", "article", "document")
_BLOCK_RE = re.compile(rb"\r?\n[ \t]*\r?\n")


class SourceError(ValueError):
    """A source that cannot be used at all; the message names the file (and line or key) and the fix."""


@dataclass(frozen=True)
class Skip:
    """Input that did not become a document: `reason` is a short key, `where` names the file and line."""

    reason: str
    where: str


@dataclass(frozen=True)
class Raw:
    """A document that still needs the source's cleaner (wikitext); `where` names it for the skip count."""

    text: str
    where: str


def as_document(text: str, where: str) -> str | Skip:
    text = text.strip()
    return text if text else Skip("empty_document", where)


def decode_utf8(data: bytes, where_file: Path, first_line: int = 1) -> str | Skip:
    try:
        return data.decode("utf-8-sig" if data[:3] == b"\xef\xbb\xbf" else "utf-8")  # a BOM is not text
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        return Skip("invalid_utf8", f"{where_file}:{line}")


def read_txt(path: Path, txt_mode: str) -> Iterator[str | Skip]:
    data, damage = read_bytes(path)
    if damage:  # keep the complete blocks before the damage; a whole-file document is incomplete, so skipped
        yield Skip("damaged_compressed_file", damage)
        if txt_mode == "file":
            return
        data = data[: data.rfind(b"\n\n") + 1] if b"\n\n" in data else b""
    if not data.strip():
        yield Skip("empty_file", str(path))
        return
    if txt_mode == "file":
        text = decode_utf8(data, path)
        yield text if isinstance(text, Skip) else as_document(text, f"{path}:1")
        return
    line, pos = 1, 0
    for m in [*_BLOCK_RE.finditer(data), None]:
        end = m.start() if m else len(data)
        block = data[pos:end]
        if block.strip():
            text = decode_utf8(block, path, line)
            yield text if isinstance(text, Skip) else as_document(text, f"{path}:{line}")
        if m:
            line += data.count(b"\n", pos, m.end())
            pos = m.end()


def pick_field(keys, text_column: str | None, where: str) -> str:
    """The text field of a record: `text_column` if given, else the first of TEXT_FIELDS present."""
    if text_column:
        return text_column
    for name in TEXT_FIELDS:
        if name in keys:
            return name
    raise SourceError(f"{where}: no text field among {sorted(keys)[:20]}; name it with --text-column")


def read_record(rec, column: str | None, where: str) -> tuple[str | Skip, str | None]:
    """One JSON/parquet record -> (document or Skip, the text column chosen)."""
    if isinstance(rec, str):
        return as_document(rec, where), column
    if not isinstance(rec, dict):
        return Skip("not_a_record", where), column
    column = column or pick_field(rec.keys(), None, where)
    if column not in rec:
        return Skip("missing_text_field", where), column
    value = rec[column]
    if value is None:
        return Skip("null_text", where), column
    if not isinstance(value, str):
        return Skip("non_string_text", where), column
    return as_document(value, where), column


def read_jsonl(path: Path, text_column: str | None) -> Iterator[str | Skip]:
    column, seen, lineno = text_column, False, 0
    with open_binary(path) as f:
        lines = enumerate(f, 1)
        while True:
            try:
                lineno, raw = next(lines)
            except StopIteration:
                break
            except DAMAGE_ERRORS as e:  # the records before the damage are kept
                yield Skip("damaged_compressed_file", f"{damage_reason(path, e)} after line {lineno}")
                return
            if not raw.strip():
                continue
            seen, where = True, f"{path}:{lineno}"
            text = decode_utf8(raw, path, lineno)
            if isinstance(text, Skip):
                yield text
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                yield Skip("malformed_json", where)
                continue
            doc, column = read_record(rec, column, where)
            yield doc
    if not seen:
        yield Skip("empty_file", str(path))


def read_json(path: Path, text_column: str | None) -> Iterator[str | Skip]:
    data, damage = read_bytes(path)
    if damage:
        if _first_line_is_json(data):  # JSON lines in a .json file: line by line, keeping what is complete
            yield from read_jsonl(path, text_column)
        else:
            yield Skip("damaged_compressed_file", damage)
        return
    if not data.strip():
        yield Skip("empty_file", str(path))
        return
    text = decode_utf8(data, path)
    if isinstance(text, Skip):
        yield text
        return
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        first = text.lstrip().split("\n", 1)[0]
        try:
            json.loads(first)
        except json.JSONDecodeError:
            raise SourceError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
        yield from read_jsonl(path, text_column)  # JSON lines in a .json file
        return
    if isinstance(obj, dict):
        if obj and all(isinstance(v, dict) for v in obj.values()):
            records = [(f"{path}:key {k!r}", v) for k, v in obj.items()]
        else:
            records = [(str(path), obj)]
    elif isinstance(obj, list):
        records = [(f"{path}:item {i}", v) for i, v in enumerate(obj)]
    else:
        raise SourceError(f"{path}: expected a JSON list or object of records, got {type(obj).__name__}")
    column = text_column
    for where, rec in records:
        doc, column = read_record(rec, column, where)
        yield doc


def _first_line_is_json(data: bytes) -> bool:
    first = data.lstrip().split(b"\n", 1)[0]
    try:
        json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return b"\n" in data.strip()


def read_parquet(path: Path, text_column: str | None) -> Iterator[str | Skip]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise SourceError(f"{path}: not a readable parquet file ({e})") from e
    names = pf.schema_arrow.names
    column = pick_field(names, text_column, str(path))
    if column not in names:
        raise SourceError(f"{path}: no column {column!r}; columns are {names}")
    row = 0
    for batch in pf.iter_batches(batch_size=2048, columns=[column]):
        for value in batch.column(0).to_pylist():
            where = f"{path}:row {row}"
            row += 1
            if value is None:
                yield Skip("null_text", where)
            elif not isinstance(value, str):
                yield Skip("non_string_text", where)
            else:
                yield as_document(value, where)
    if row == 0:
        yield Skip("empty_file", str(path))


def read_xml(path: Path) -> Iterator[str | Skip]:
    from anyseek.data.wikitext import iter_pages

    n = 0
    for page in iter_pages(path):
        n += 1
        where = f"{path}:{page.line} ({page.title})" if page.title else f"{path}:{page.line}"
        yield Skip(page.skip, where) if page.skip else Raw(page.text, where)
    if n == 0:
        yield Skip("empty_file", str(path))


@dataclass
class Source:
    """A resolved SPEC: `items()` streams its documents (a fresh pass per call); `description` goes into the
    manifest, `fingerprint` identifies the inputs (files with size and mtime) for idempotent re-runs."""

    spec: str
    description: dict
    fingerprint: dict
    items: Callable[[], Iterator[str | Raw | Skip]]
    cleaner: Callable[[list[str]], list[str]] | None = None
    total_bytes: int | None = None
    extra: dict = field(default_factory=dict)
