"""The data pipeline: text sources -> tokenizer + token shards (`prepare`) -> packed varlen batches (`loader`).

    sources.py    SPEC -> documents (wiki-sample, hf:, .txt/.jsonl/.json/.parquet, MediaWiki XML via wikitext.py)
    tokenizer.py  byte-level BPE training, external tokenizers, the files AutoTokenizer loads
    prepare.py    prepare() / ensure_prepared(): the shards and manifest.json (format in shards.py)
    loader.py     PackedLoader and Batch (window cutting in packing.py)
    cli_prepare.py, cli_data.py   `anyseek prepare`, `anyseek data inspect`

Nothing is imported here, so that `anyseek prepare --help` stays fast and torch loads only with the loader.
"""
