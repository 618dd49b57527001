"""`anyseek prepare`: turn a text source into token shards and a tokenizer (see docs/data.md)."""

from __future__ import annotations

import argparse
import os
import sys

from anyseek.data.prepare import DEFAULT_TOKENIZER_TRAIN_BYTES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default="wiki-sample",
                        help="wiki-sample (default), hf:NAME[:CONFIG], or a file, glob or folder of .txt/.jsonl/.json/"
                        ".parquet/.xml[.bz2]")  # fmt: skip
    parser.add_argument("--out", default=None, help="output folder (default: $ANYSEEK_CACHE/<source>-v<vocab>)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary to train (default 4096)")
    parser.add_argument("--tokenizer", default=None, help="use this tokenizer.json or tokenizer folder instead")
    parser.add_argument("--text-column", default=None, help="text field of JSON/parquet/HF records (default: text)")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for validation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    parser.add_argument("--workers", type=int, default=None,
                        help="cores to use: XML cleaning processes and encoding threads (default: all)")  # fmt: skip
    parser.add_argument("--txt-docs", choices=("file", "blank-line"), default="file",
                        help=".txt files: a document per file (default) or per blank-line-separated block")  # fmt: skip
    parser.add_argument("--tokenizer-train-mb", type=float, default=DEFAULT_TOKENIZER_TRAIN_BYTES / 2**20,
                        help="train the tokenizer on the first this many MB of text (default 256)")  # fmt: skip
    parser.add_argument("--max-docs", type=int, default=None, help="read at most this many documents of the source")
    parser.add_argument("--strict", action="store_true", help="stop at the first unusable input instead of skipping")
    parser.add_argument("--force", action="store_true", help="prepare again even if OUT is up to date")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if args.workers:  # read by the tokenizers' thread pool when it starts
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    from anyseek.data.prepare import PrepareError, default_out, prepare
    from anyseek.data.sources import SourceError
    from anyseek.data.tokenizer import TokenizerError
    from anyseek.data.wikitext import WikiDumpError

    out = args.out or default_out(args.source, args.vocab_size)
    try:
        prepare(
            args.source, out, args.vocab_size, args.tokenizer, args.text_column, args.val_fraction, args.seed,
            args.workers, not args.quiet, txt_mode=args.txt_docs, strict=args.strict, force=args.force,
            tokenizer_train_bytes=int(args.tokenizer_train_mb * 2**20), max_documents=args.max_docs,
        )  # fmt: skip
    except (SourceError, PrepareError, TokenizerError, WikiDumpError, FileNotFoundError) as e:
        print(f"anyseek prepare: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
