"""The data pipeline: text sources -> tokenizer + token shards (`prepare`) -> packed varlen batches (`loader`).

    sources.py    SPEC -> a Source (wiki-sample, hf: in hf.py, files); readers.py reads one file of each type,
                  wikitext.py streams and cleans MediaWiki XML dumps
    tokenizer.py  byte-level BPE training, external tokenizers, the files AutoTokenizer loads
    prepare.py    prepare() / ensure_prepared(): shards + manifest.json (format in shards.py; chunks.py reads,
                  cleans and splits documents; progress.py reports)
    loader.py     PackedLoader and Batch (window cutting in pieces.py)
    cli_prepare.py, cli_data.py   `anyseek prepare`, `anyseek data inspect`

Nothing is imported here, so that `anyseek prepare --help` stays fast and torch loads only with the loader.
"""
