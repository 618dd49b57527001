"""`anyseek eval CHECKPOINT --data DIR [--split val]`: next-token loss and perplexity of a checkpoint on prepared
data, plus tokens/s. The batches are the trainer's (its packed loader with the run's tokens_per_batch and
max_seqlen, from the checkpoint's run_config.json when present) and the loss is the same mean, so on the same
device and dtype the number equals the validation loss the trainer reported."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a step-N folder, a run folder or a Hugging Face DeepseekV3 folder")
    parser.add_argument("--data", required=True, help="a folder written by `anyseek prepare`")
    parser.add_argument("--split", default="val", help="train or val (default: val)")
    parser.add_argument("--max-tokens", type=int, help="stop after this many targets (default: the run's "
                                                        "eval_tokens when the checkpoint has run_config.json, else all)")  # fmt: skip
    parser.add_argument("--device", help="cpu, cuda, ... (default: the GPU if any)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on a GPU, fp32 on the CPU")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from anyseek.infer.loading import CLIError

    try:
        result = evaluate(args)
    except CLIError as e:
        print(f"anyseek eval: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _run_settings(folder: Path) -> dict:
    from anyseek import checkpoint  # (torch: not for `anyseek eval --help`)

    cfg = checkpoint.run_config(folder)
    d, t = cfg.get("data", {}), cfg.get("train", {})
    return {
        k: v
        for k, v in {
            "tokens_per_batch": d.get("tokens_per_batch"),
            "max_seqlen": d.get("max_seqlen"),
            "seed": t.get("seed"),
            "eval_tokens": t.get("eval_tokens"),
        }.items()
        if v is not None
    }


def check_tokenizer(folder: Path, data: Path, manifest: dict) -> None:
    """The data must hold ids of the model's tokenizer (`anyseek.data.tokenizer.tokenized_with`: the same file or the
    same vocabulary), else its loss means nothing: CLIError naming both. A folder without tokenizer.json: a warning."""
    from anyseek.data.tokenizer import tokenized_with
    from anyseek.infer.loading import CLIError

    mine = folder / "tokenizer.json"
    if not mine.is_file():
        print(f"anyseek eval: warning: {folder} has no tokenizer.json; cannot check that {data} was tokenized with "
              "the model's tokenizer", file=sys.stderr)
        return
    try:
        same = tokenized_with(mine, data, manifest)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file; missing files are OSErrors
        raise CLIError(f"cannot compare the tokenizers of {folder} and {data} ({e})") from e
    if not same:
        tok = manifest.get("tokenizer") or {}
        raise CLIError(f"{data} was prepared with another tokenizer ({data}/tokenizer/tokenizer.json, from "
                       f"{tok.get('path') or tok.get('kind', 'its own')}) than the model's ({mine}): its loss would "
                       f"mean nothing; prepare the text again with `anyseek prepare --tokenizer {folder} ...`")


def evaluate(args: argparse.Namespace) -> dict:
    import torch

    from anyseek.data.loader import PackedLoader
    from anyseek.infer import loading
    from anyseek.infer.loading import CLIError

    folder = loading.resolve(args.checkpoint)
    data = Path(args.data).expanduser()
    if not (data / "manifest.json").is_file():
        raise CLIError(f"{data}: not a prepared data folder (no manifest.json; run `anyseek prepare` first)")
    s = _run_settings(folder)
    try:
        loader = PackedLoader(data, split=args.split, tokens_per_batch=s.get("tokens_per_batch", 4096),
                              max_seqlen=s.get("max_seqlen", 512), seed=s.get("seed", 0), loop=False)  # fmt: skip
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"{data}: cannot read split {args.split!r} ({e})") from e
    check_tokenizer(folder, data, loader.manifest)
    model = loading.load_model(folder, args.device, args.dtype)
    vocab = loader.manifest.get("vocab_size")
    if vocab is not None and vocab > model.config.vocab_size:
        raise CLIError(f"{data} has a vocabulary of {vocab} tokens, the model only {model.config.vocab_size}")
    limit = args.max_tokens or s.get("eval_tokens")
    dev = model.lm_head.weight.device
    total, count, seen, start = 0.0, 0, 0, time.perf_counter()
    with torch.no_grad():
        for batch in loader:
            targets = batch.targets.to(dev)
            n = int((targets != -100).sum())
            if n == 0:
                continue
            out = model(batch.input_ids.to(dev), cu_seqlens=batch.cu_seqlens.to(dev), targets=targets,
                        max_seqlen=batch.max_seqlen, return_logits=False)  # fmt: skip
            total += float(out.lm_loss) * n
            count, seen = count + n, seen + batch.input_ids.numel()
            if limit and count >= limit:
                break
    seconds = time.perf_counter() - start
    if count == 0:
        raise CLIError(f"{data}: split {args.split!r} has no tokens to score")
    loss = total / count
    return {"checkpoint": str(folder), "split": args.split, "loss": round(loss, 6),
            "perplexity": round(math.exp(loss), 4) if loss < 50 else float("inf"), "tokens": count,
            "tokens_per_s": round(seen / seconds, 1)}  # fmt: skip
