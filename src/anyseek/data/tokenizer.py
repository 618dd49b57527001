"""The tokenizer beside the data: a byte-level BPE trained on the source, or an existing tokenizer.json / folder.

It is saved in DATA_DIR/tokenizer/ as tokenizer.json + tokenizer_config.json + special_tokens_map.json, which
transformers' AutoTokenizer loads (PreTrainedTokenizerFast, bos/eos/pad set); training copies these files into
every checkpoint. Every document ends with the end-of-document token (eos); bos is the same token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
PAD = "<|pad|>"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


class TokenizerError(ValueError):
    pass


def train_bpe(batches: Iterable[list[str]], vocab_size: int, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE (no normalizer, so decode(encode(text)) == text) on batches of documents.
    Ids 0 and 1 are EOS and PAD; the vocabulary may come out smaller than `vocab_size` on a tiny corpus."""
    if vocab_size < 258 + 2:
        raise TokenizerError(f"vocab_size must be at least 260 (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(batches, trainer=trainer, length=length)
    return tok


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_external(path: str | Path) -> tuple[Tokenizer, dict]:
    """A tokenizer.json file or a Hugging Face tokenizer folder -> (tokenizer, tokenizer_config dict)."""
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(
            f"{path}: no tokenizer.json; anyseek needs a fast tokenizer (convert a slow one with transformers: "
            "AutoTokenizer.from_pretrained(p).save_pretrained(p))"
        )
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception on a bad file
        raise TokenizerError(f"{file}: not a tokenizers JSON file ({e})") from None
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        if (folder / name).is_file():
            try:
                config.update(json.loads((folder / name).read_text(encoding="utf-8")))
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{folder / name}:{e.lineno}: malformed JSON ({e.msg})") from None
    return tok, config


def resolve_specials(tok: Tokenizer, config: dict) -> dict:
    """Pick eos/bos/pad tokens (adding EOS when the tokenizer has no end-of-document token) -> names and ids."""
    vocab = tok.get_vocab(with_added_tokens=True)
    eos = _token_content(config.get("eos_token"))
    if eos is None or eos not in vocab:
        eos = next((t for t in KNOWN_EOS if t in vocab), None)
    if eos is None:
        eos = EOS
        tok.add_special_tokens([EOS])
        vocab = tok.get_vocab(with_added_tokens=True)
    bos = _token_content(config.get("bos_token"))
    bos = bos if bos in vocab else eos
    pad = _token_content(config.get("pad_token"))
    pad = pad if pad in vocab else (PAD if PAD in vocab else eos)
    return {"eos_token": eos, "bos_token": bos, "pad_token": pad,
            "eos_token_id": vocab[eos], "bos_token_id": vocab[bos], "pad_token_id": vocab[pad]}  # fmt: skip


def save_tokenizer(tok: Tokenizer, out_dir: Path, specials: dict, base_config: dict | None = None) -> list[Path]:
    """Write the three files AutoTokenizer reads; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    names = {k: specials[k] for k in ("bos_token", "eos_token", "pad_token")}
    config = {k: v for k, v in (base_config or {}).items() if k not in ("auto_map", "tokenizer_file", "name_or_path")}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("clean_up_tokenization_spaces", False)
    config.update(names, add_bos_token=False, add_eos_token=False)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(names, indent=2, ensure_ascii=False) + "\n")
    return [out_dir / name for name in TOKENIZER_FILES]


def tokenizer_files(data_dir: str | Path) -> list[Path]:
    """The files to copy into a checkpoint (tokenizer.json, tokenizer_config.json, special_tokens_map.json)."""
    folder = Path(data_dir) / TOKENIZER_DIR
    files = [folder / name for name in TOKENIZER_FILES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{data_dir}: tokenizer files missing: {missing} (run `anyseek prepare` again)")
    return files


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer saved beside prepared data (DATA_DIR/tokenizer/tokenizer.json)."""
    return Tokenizer.from_file(str(tokenizer_files(data_dir)[0]))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenized_with(tokenizer_json: Path, data_dir: str | Path, manifest: dict) -> bool:
    """Whether the prepared data in `data_dir` (its `manifest`) holds ids of `tokenizer_json`: the same file (the one
    saved beside the data, or the one given to `prepare --tokenizer`), or a tokenizer with the same vocabulary (the
    same ids for the same tokens, e.g. the same tokenizer saved again). Training from a model (`--init`) and `anyseek
    eval` refuse data for which this is False: its losses would mean nothing."""
    used = {manifest.get("tokenizer_sha256"),
            *((manifest.get("inputs") or {}).get("tokenizer", {}).get("files", {}).values())}
    if sha256_file(tokenizer_json) in used:
        return True
    theirs = tokenizer_files(data_dir)[0]
    return Tokenizer.from_file(str(tokenizer_json)).get_vocab(True) == Tokenizer.from_file(str(theirs)).get_vocab(True)


def batched(texts: Iterable[str], n: int = 1000) -> Iterator[list[str]]:
    batch: list[str] = []
    for t in texts:
        batch.append(t)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
