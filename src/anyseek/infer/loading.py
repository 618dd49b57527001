"""Loading a model to generate with or evaluate: a `step-N` folder, a run folder (its newest complete checkpoint) or
any Hugging Face DeepseekV3 folder (`anyseek.checkpoint.model_folder` says which folder a path means), plus its
tokenizer. Errors are `CLIError` with a message that
names the folder and what is missing (the commands print it without a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from anyseek import checkpoint
from anyseek.hf import load_pretrained
from anyseek.infer.layers import join_weights
from anyseek.storage import CheckpointError


class CLIError(Exception):
    """A user error: the command prints the message and exits with status 2."""


def resolve(path: str | Path) -> Path:
    """The model folder `path` means (`anyseek.checkpoint.model_folder`: a model folder, checked against its
    checkpoint.json where it has one, or a run's newest complete step-N), as a CLIError where there is none."""
    try:
        return checkpoint.model_folder(path)
    except CheckpointError as e:
        raise CLIError(str(e)) from e


def load_model(folder: Path, device: str | None = None, dtype: str | None = None):
    """DeepSeekV3 from `folder` in eval mode on `device` (default: the GPU if any) in `dtype` (default: bf16 on a
    GPU, fp32 on the CPU)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype is not None and dtype not in names:
        raise CLIError(f"--dtype must be one of {', '.join(names)}, got {dtype!r}")
    dt = names[dtype] if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CLIError(f"{folder / 'config.json'}: unreadable ({e})") from e
    if config.get("model_type") not in (None, "deepseek_v3", "deepseek_v2"):
        raise CLIError(f"{folder}: model_type {config.get('model_type')!r} is not a DeepseekV3 or DeepseekV2 model")
    try:
        model = load_pretrained(folder, dtype=dt, device=dev)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise CLIError(f"{folder}: cannot load the model ({e})") from e
    join_weights(model)  # the weights multiplied side by side in one buffer each: no copy of them per forward
    return model.eval()


def load_tokenizer(folder: Path):
    """tokenizers.Tokenizer from folder/tokenizer.json and the eos id (generation_config.json, else tokenizer_config)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise CLIError(f"{folder}: no tokenizer.json (copy the tokenizer files of the data the model was trained on "
                       "into the folder)")  # fmt: skip

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception type
        raise CLIError(f"{file}: unreadable tokenizer ({e})") from e
    return tok, _eos_id(folder, tok)


def _eos_id(folder: Path, tok) -> int | list[int] | None:
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            continue
        if eos is not None:
            return eos
    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, json.JSONDecodeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return tok.token_to_id(eos) if eos else None
