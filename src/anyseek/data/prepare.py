"""`prepare`: a text source -> tokenizer + memory-mappable token shards + manifest.json.

Two passes over the source: (1) train a byte-level BPE on the first `tokenizer_train_bytes` of the training
documents (skipped when a tokenizer is given), (2) clean, split, encode and write every document. In pass 2 reading
runs in a background thread, XML cleaning in a process pool, encoding in the tokenizers' Rust thread pool: all cores.

Each document goes to "val" when a keyed hash of its text falls below `val_fraction`: deterministic for a seed,
independent of order and of the machine, and identical documents never straddle the split.

Everything is written to DIR/.prepare-tmp and moved in place at the end; manifest.json is written last and
atomically, and removed first when re-preparing, so no manifest ever points at partial shards. A second run with
the same inputs finds a complete manifest with the same fingerprint and returns it at once.
"""

from __future__ import annotations

import array
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from anyseek.data import shards as S
from anyseek.data import tokenizer as T
from anyseek.data.chunks import iter_chunks, split_key, val_mask
from anyseek.data.progress import PrepareProgress, prefetch
from anyseek.data.sources import Skip, Source, SourceError, default_cache_dir, limit_source, open_source

DEFAULT_TOKENIZER_TRAIN_BYTES = 256 << 20
_STAGING = ".prepare-tmp"
_SHARD_RE = re.compile(r"^(train|val)-\d{5}\.(bin|idx\.npy)$")
_EXAMPLES_PER_REASON = 5


class PrepareError(ValueError):
    pass


def default_out(source: str, vocab_size: int) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", source.replace("hf:", "hf-")).strip("_")[:80] or "data"
    return default_cache_dir() / f"{slug}-v{vocab_size}"


def prepare(
    source: str = "wiki-sample",
    out: str | Path | None = None,
    vocab_size: int = 4096,
    tokenizer: str | Path | None = None,
    text_column: str | None = None,
    val_fraction: float = 0.01,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
    *,
    txt_mode: str = "file",
    strict: bool = False,
    tokenizer_train_bytes: int = DEFAULT_TOKENIZER_TRAIN_BYTES,
    max_documents: int | None = None,
    force: bool = False,
) -> dict:
    """Prepare SOURCE into OUT (default: $ANYSEEK_CACHE/<source>-v<vocab>) and return the manifest.

    tokenizer: a tokenizer.json or Hugging Face tokenizer folder (else a byte-level BPE of `vocab_size` is trained).
    strict: stop at the first unusable input (naming file and line) instead of skipping and counting it.
    max_documents: read at most this many documents of the source (a quick look at a large one).
    force: prepare again even when a complete manifest with the same inputs exists.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if tokenizer is None and vocab_size < 260:
        raise PrepareError(f"vocab_size must be at least 260, got {vocab_size}")
    out = Path(out).expanduser() if out is not None else default_out(source, vocab_size)
    workers = max(1, workers or os.cpu_count() or 1)
    src = open_source(source, text_column=text_column, txt_mode=txt_mode)
    if max_documents is not None:
        src = limit_source(src, max_documents)
    inputs = _inputs(src, vocab_size, tokenizer, val_fraction, seed, tokenizer_train_bytes)
    fingerprint = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        done = _complete_manifest(out, fingerprint)
        if done is not None and not force:
            return done
        (out / S.MANIFEST).unlink(missing_ok=True)  # from here on the folder holds no valid data
        staging = out / _STAGING
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        log = PrepareProgress(progress)
        start = time.perf_counter()
        try:
            with _pool(src, workers) as pool:
                tok, tok_info = _tokenizer(src, pool, tokenizer, vocab_size, val_fraction, seed, tokenizer_train_bytes,
                                           log)  # fmt: skip
                specials = T.resolve_specials(tok, tok_info.pop("config", {}))
                T.save_tokenizer(tok, staging / T.TOKENIZER_DIR, specials, tok_info.pop("base_config", None))
                result = _encode_all(src, pool, tok, specials["eos_token_id"], staging, val_fraction, seed, strict, log)
        except BaseException:
            log.end_phase()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        manifest = _manifest(src, inputs, fingerprint, tok, specials, tok_info, result, staging, start)
        _commit(staging, out, manifest)
        summary = _summary(out, manifest)
        log.done(summary)
        if not progress:  # --quiet hides progress, never what was skipped or that a split is empty
            for line in summary.splitlines()[1:]:
                print(line, file=sys.stderr, flush=True)
        return manifest


def ensure_prepared(
    source: str = "wiki-sample", out: str | Path | None = None, vocab_size: int = 4096, **options
) -> Path:
    """Prepare once: returns OUT at once when it already holds a complete manifest for the same inputs."""
    out = Path(out).expanduser() if out is not None else default_out(source, vocab_size)
    try:
        prepare(source, out, vocab_size, **options)
    except SourceError:
        # The source is gone (say the sample package was uninstalled) but complete data prepared from it is here.
        if not _has_complete_data(out):
            raise
        print(f"anyseek: {source} cannot be opened; using the data already prepared in {out}", file=sys.stderr)
    return out


# --------------------------------------------------------------------------------------------- bookkeeping


def _inputs(src: Source, vocab_size, tokenizer, val_fraction, seed, train_bytes) -> dict:
    inputs = {"format": S.FORMAT, "source": src.fingerprint, "val_fraction": val_fraction, "seed": seed}
    if tokenizer is None:
        inputs["tokenizer"] = {"train_bpe": vocab_size, "train_bytes": train_bytes}
    else:
        path = Path(tokenizer).expanduser()
        folder = path if path.is_dir() else path.parent
        files = [path / "tokenizer.json"] if path.is_dir() else [path]
        files += [folder / n for n in T.TOKENIZER_FILES[1:] if (folder / n).is_file()]
        if not files[0].is_file():
            raise T.TokenizerError(f"{path}: no tokenizer.json (give a tokenizer.json file or a tokenizer folder)")
        inputs["tokenizer"] = {"files": {f.name: T.sha256_file(f) for f in files}}
    return inputs


def _check_out(out: Path) -> None:
    """Refuse a folder that holds something else: prepare replaces tokenizer/ and the shard files in it."""
    if not out.exists():
        return
    if not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a folder")
    ours = {S.MANIFEST, S.MANIFEST + ".tmp", T.TOKENIZER_DIR, _STAGING, ".prepare.lock"}
    foreign = [p.name for p in out.iterdir() if p.name not in ours and not _SHARD_RE.match(p.name)]
    if foreign and not (out / S.MANIFEST).exists() and not (out / ".prepare.lock").exists():
        raise PrepareError(f"{out}: not empty and not written by anyseek prepare (holds {sorted(foreign)[:5]}); "
                           "choose a new or empty folder")  # fmt: skip


def _has_complete_data(out: Path) -> bool:
    try:
        return not S.missing_files(out, S.read_manifest(out))
    except (FileNotFoundError, ValueError, KeyError):
        return False


def _complete_manifest(out: Path, fingerprint: str) -> dict | None:
    try:
        manifest = S.read_manifest(out)
    except (FileNotFoundError, ValueError):
        return None
    if manifest.get("fingerprint") != fingerprint or S.missing_files(out, manifest):
        return None
    if not all(f.is_file() for f in (out / T.TOKENIZER_DIR / n for n in T.TOKENIZER_FILES)):
        return None
    return manifest


@contextmanager
def _locked(out: Path):
    """One prepare per folder at a time (ranks of a job calling ensure_prepared together wait for the first)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; run prepare once before starting ranks
        yield
        return
    with open(out / ".prepare.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _pool(src: Source, workers: int):
    """A process pool for sources that need cleaning (XML dumps); None otherwise."""
    if src.cleaner is None or workers < 2:
        yield None
        return
    pool = multiprocessing.get_context().Pool(workers)
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join()


def _commit(staging: Path, out: Path, manifest: dict) -> None:
    keep = {s[k] for split in manifest["splits"].values() for s in split["shards"] for k in ("tokens", "offsets")}
    for old in out.iterdir():
        if _SHARD_RE.match(old.name) and old.name not in keep:
            old.unlink()
    shutil.rmtree(out / T.TOKENIZER_DIR, ignore_errors=True)
    for item in staging.iterdir():
        os.replace(item, out / item.name)
    staging.rmdir()
    tmp = out / (S.MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, out / S.MANIFEST)


# ------------------------------------------------------------------------------------------------ documents


def _tokenizer(src, pool, tokenizer, vocab_size, val_fraction, seed, train_bytes, log) -> tuple:
    if tokenizer is not None:
        tok, config = T.load_external(tokenizer)
        return tok, {"kind": "external", "path": str(tokenizer), "config": config, "base_config": config}
    key, seen = split_key(seed), [0]

    def batches():  # no prefetch thread: the trainer pulls from this generator while its own threads count words
        for texts, _ in iter_chunks(src, pool):
            is_val, sizes, bad = val_mask(texts, val_fraction, key)
            bad_set = set(bad)
            batch = [t for i, (t, v) in enumerate(zip(texts, is_val)) if not v and i not in bad_set]
            seen[0] += sum(sizes)
            log.update("tokenizer", sum(sizes))
            for i in range(0, len(batch), 1000):  # the trainer pipelines smaller batches better
                yield batch[i : i + 1000]
            if seen[0] >= train_bytes:
                return

    tok = T.train_bpe(batches(), vocab_size)
    log.end_phase()
    return tok, {"kind": "trained byte-level BPE", "trained_on_bytes": seen[0]}


def _encode_all(src, pool, tok, eos: int, staging: Path, val_fraction, seed, strict, log) -> dict:
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = S.token_dtype(vocab)
    typecode = "H" if dtype.itemsize == 2 else "I"
    writers = {s: S.ShardWriter(staging, s, dtype) for s in ("train", "val")}
    nbytes = {"train": 0, "val": 0}
    skipped: Counter = Counter()
    examples: list[dict] = []  # the first few of each reason
    key = split_key(seed)
    for texts, skips in prefetch(iter_chunks(src, pool)):
        is_val, sizes, bad = val_mask(texts, val_fraction, key)
        for i in reversed(bad):
            skips.append(Skip("invalid_unicode", f"{src.spec}: a document with lone surrogates"))
            del texts[i], is_val[i], sizes[i]
        for skip in skips:
            if strict:
                raise PrepareError(f"{skip.where}: {skip.reason.replace('_', ' ')} (strict mode)")
            skipped[skip.reason] += 1
            if skipped[skip.reason] <= _EXAMPLES_PER_REASON:
                examples.append({"reason": skip.reason, "where": skip.where})
        encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
        bufs = {"train": array.array(typecode), "val": array.array(typecode)}
        lens: dict[str, list[int]] = {"train": [], "val": []}
        for enc, v, size in zip(encodings, is_val, sizes):
            split = "val" if v else "train"
            ids = enc.ids
            bufs[split].extend(ids)
            bufs[split].append(eos)
            lens[split].append(len(ids) + 1)
            nbytes[split] += size
        for split, writer in writers.items():
            writer.add(np.frombuffer(bufs[split], dtype=dtype), np.asarray(lens[split], np.int64))
        log.update("encode", sum(sizes))
    log.end_phase()
    result = {s: w.close() for s, w in writers.items()}
    if result["train"]["documents"] == 0:
        raise PrepareError(f"{src.spec}: no training documents (skipped: {dict(skipped) or 'none'})")
    return {"splits": result, "text_bytes": nbytes, "skipped": dict(skipped), "examples": examples, "dtype": dtype}


def _manifest(src, inputs, fingerprint, tok, specials, tok_info, result, staging, start) -> dict:
    from anyseek import __version__

    splits = result["splits"]
    return {
        "format": S.FORMAT,
        "created_by": f"anyseek {__version__}",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": fingerprint,
        "source": src.description,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        **specials,
        "dtype": result["dtype"].name,
        "tokenizer": tok_info,
        "tokenizer_sha256": T.sha256_file(staging / T.TOKENIZER_DIR / "tokenizer.json"),
        "documents": {s: v["documents"] for s, v in splits.items()},
        "tokens": {s: v["tokens"] for s, v in splits.items()},
        "text_bytes": result["text_bytes"],
        "skipped": result["skipped"],
        "skipped_examples": result["examples"],
        "val_fraction": inputs["val_fraction"],
        "seed": inputs["seed"],
        "elapsed_s": round(time.perf_counter() - start, 2),
        "inputs": _short_inputs(inputs),
        "splits": splits,
    }


def _short_inputs(inputs: dict) -> dict:
    """The inputs for the manifest, with a long file list replaced by its count and hash."""
    files = inputs["source"].get("files")
    if not files or len(files) <= 100:
        return inputs
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
    return {**inputs, "source": {**inputs["source"], "files": {"count": len(files), "sha256": digest}}}


def _summary(out: Path, m: dict) -> str:
    skipped = sum(m["skipped"].values())
    head = (
        f"prepared {out}: {m['documents']['train']:,} train / {m['documents']['val']:,} val documents, "
        f"{m['tokens']['train']:,} / {m['tokens']['val']:,} tokens, vocab {m['vocab_size']}, {m['elapsed_s']} s"
    )
    lines = [head]
    if skipped:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(m["skipped"].items()))
        lines.append(f"skipped {skipped:,} inputs ({reasons}); see skipped_examples in manifest.json")
    if m["documents"].get("val", 0) == 0:
        lines.append("warning: the validation split is empty (too few documents for --val-fraction "
                     f"{m.get('inputs', {}).get('val_fraction', '?')}); training will run without validation")
    return "\n".join(lines)
