"""Hugging Face interop: load and save DeepSeek-V2/V3 checkpoint folders (config.json + safetensors).

    model = load_pretrained("path/to/DeepSeek-V3-folder", dtype=torch.bfloat16, device="cuda")
    save_pretrained(model, "out/folder", dtype=torch.bfloat16, max_shard_size="5GB")

Loading streams: the model is built with its parameters on the meta device, then each parameter is read from the
safetensors files (memory-mapped) and assigned, so peak memory is about one model. Routed experts arrive as N
per-expert pieces and are copied into one stacked tensor per layer as they are read. FP8 block-quantized weights
(the official release) are dequantized on the way in. Saved folders use the official per-expert layout and load
in `transformers.AutoModelForCausalLM.from_pretrained`. See names.py for the name mapping.

Softmax-routed models are written as transformers' DeepseekV2 (hf/config.py). That class has no routing bias: an
all-zero `e_score_correction_bias` is left out of the folder, a trained one is kept under its own name (transformers
reports it unexpected and routes without it). A model transformers would compute differently (`transformers_gaps`)
is refused by `save_pretrained` and exports (`for_transformers=True`), and written with a warning and a note in
config.json for training checkpoints, whose job is to resume exactly (`for_transformers=False`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from torch import nn

from anyseek.hf.config import NOTE_KEY, config_from_hf, config_to_hf
from anyseek.hf.config import transformers_gaps as config_gaps
from anyseek.hf.fp8 import DEFAULT_BLOCK, dequantize_blockwise
from anyseek.hf.names import LoadPlan, Piece, expert_names, plan_load, to_hf
from anyseek.hf.safetensors_io import TensorInfo, TensorReader, nbytes, scan_folder, write_shards
from anyseek.kernels.reference.quant4 import packed_width, quantize4
from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3
from anyseek.storage import CheckpointError, atomic_folder

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained", "transformers_gaps", "write_model_files"]

_MAX_LISTED = 40  # names listed per kind of problem in one error message
_KEEP_FILES = re.compile(r"(tokenizer.*|special_tokens_map\.json|chat_template.*|vocab\.json|merges\.txt)")
_ROUTING_BIAS = "mlp.gate.e_score_correction_bias"
# what an existing folder may hold for save_pretrained to replace it: a model's files (the old ones are dropped; an
# `anyseek export` marker with them) and the kept tokenizer files
_REPLACED_FILES = re.compile(r"(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors"
                             r"|model\.safetensors\.index\.json|export\.json|" + _KEEP_FILES.pattern + ")")


# ---------------------------------------------------------------- loading


def load_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    strict: bool = True,
    quantize4: Callable[[nn.Module], Collection[str]] | None = None,
) -> DeepSeekV3:
    """Build a DeepSeekV3 from a Hugging Face DeepseekV3 folder and return it in eval mode.

    dtype: of the parameters (default: the `dtype`/`torch_dtype` in config.json, else float32); buffers such as
    `e_score_correction_bias` keep the dtype the model gives them (fp32). device: default CPU.
    strict=True: every tensor must match (else one CheckpointError lists missing, unexpected and mis-shaped tensors
    by name). strict=False: missing tensors keep their random init and unexpected ones are skipped (a warning lists
    both); mis-shaped tensors are always an error. A checkpoint without MTP layers (e.g. written by transformers)
    loads with num_nextn_predict_layers lowered to what it holds, with a warning.
    quantize4: given the model (on meta, before loading), the names of the parameters to hold in 4 bits: each is
    quantized as it is read (`kernels.quantize4`, from the file's values; per expert for a stacked tensor), so the
    full-precision weights never exist together (LoRA's 4-bit base, `train.base_bits = 4`).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    hf_dict = _read_json(folder / "config.json")
    block = _fp8_block(hf_dict, folder / "config.json")
    ckpt = scan_folder(folder)
    cfg = _model_config(hf_dict, folder / "config.json")
    cfg = _drop_absent_mtp(cfg, ckpt, folder)
    dtype = dtype if dtype is not None else config_dtype(hf_dict)
    # meta: parameters take no memory and skip init; the rope tables (built outside meta) stay real
    model = DeepSeekV3(cfg, device="meta" if strict else None)
    # DeepSeek-V2 (softmax routing) checkpoints have no selection bias; ours is unused there
    zero_ok = ("e_score_correction_bias",) if cfg.scoring_func == "softmax" else ()
    n_layers, n_mtp = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    packed = set(quantize4(model)) if quantize4 is not None else set()
    load_into(model, ckpt, n_layers, n_mtp, dtype, device, strict, block, folder, zero_ok, packed4=packed)
    return model.eval()


def load_into(
    model: nn.Module,
    ckpt: dict[str, TensorInfo],
    n_layers: int,
    n_mtp: int,
    dtype: torch.dtype,
    device: str | torch.device | None = None,
    strict: bool = True,
    block: tuple[int, int] = DEFAULT_BLOCK,
    folder: Path | None = None,
    zero_if_missing: tuple[str, ...] = (),
    packed4: Collection[str] = (),
) -> None:
    """Fill `model`'s state from the checkpoint tensors `ckpt` (see safetensors_io.scan_folder), assigning new tensors.
    Parameters become `dtype` on `device`; buffers keep their dtype. Tensors whose names end with one of
    `zero_if_missing` may be absent from the checkpoint and are then zeros. Parameters named in `packed4` become
    packed 4-bit tensors (`_materialize4`) instead."""
    device = torch.device(device if device is not None else "cpu")
    aliases = _aliases(model)
    state = model.state_dict(keep_vars=True)
    expected = {n: tuple(t.shape) for n, t in state.items() if n not in aliases}
    tied = {n: tuple(state[n].shape) for n in aliases}
    plan = plan_load(expected, ckpt, n_layers, n_mtp, block, tied)
    zeros = {n for n in expected if n.endswith(zero_if_missing) and n not in plan.pieces} if zero_if_missing else set()
    plan.missing = [m for m in plan.missing if m not in {to_hf(n, n_layers) for n in zeros}]
    _report(plan, folder, ckpt, strict)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    with TensorReader() as reader:
        for name, pieces in plan.pieces.items():
            old = state[name]
            want = dtype if name in params and old.is_floating_point() else old.dtype
            if name in packed4:
                new = _materialize4(pieces, old, device, reader, block)
            else:
                new = _materialize(pieces, old, want, device, reader, block)
            _assign(model, name, new, [a for a, c in aliases.items() if c == name])
    for name in zeros:
        _assign(model, name, torch.zeros(state[name].shape, dtype=state[name].dtype, device=device), [])
    _finish(model, dtype, device)


def _report(plan: LoadPlan, folder: Path | None, ckpt: dict[str, TensorInfo], strict: bool) -> None:
    where = folder if folder is not None else "checkpoint"
    files = sorted({i.file.name for i in ckpt.values()})
    lines = []
    for title, names in (
        ("missing", plan.missing if strict else []),
        ("unexpected", plan.unexpected if strict else []),
        ("mis-shaped", plan.misshaped),
    ):
        if names:
            lines.append(f"  {title} ({len(names)}):")
            lines += [f"    {n}" for n in names[:_MAX_LISTED]]
            if len(names) > _MAX_LISTED:
                lines.append(f"    ... and {len(names) - _MAX_LISTED} more")
    if lines:
        head = (
            f"{where}: checkpoint ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''}) does not match the model"
        )
        raise CheckpointError("\n".join([head] + lines))
    if not strict and (plan.missing or plan.unexpected):
        warnings.warn(
            f"{where}: loaded with strict=False; {len(plan.missing)} missing tensors keep their init "
            f"({', '.join(plan.missing[:5])}), {len(plan.unexpected)} unexpected skipped "
            f"({', '.join(plan.unexpected[:5])})",
            stacklevel=3,
        )


def _materialize(
    pieces: list[Piece],
    old: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    reader: TensorReader,
    block: tuple[int, int],
) -> torch.Tensor:
    """One target tensor from its checkpoint pieces: a whole tensor, or per-expert slices copied into a stacked
    one (which starts as `old` when that holds values: strict=False keeps the init of missing experts). Every piece
    is copied (an FP8 one dequantized) straight into the new tensor: nothing stays on the file's private mmap (a
    parameter left there would die with SIGBUS if the file were later truncated in place), and no second full-size
    copy is made on the way."""
    whole = len(pieces) == 1 and pieces[0].expert < 0
    if whole or old.is_meta:
        out = torch.empty(old.shape, dtype=dtype, device=device)
    else:
        out = old.detach().to(device=device, dtype=dtype, copy=True)
    for p in pieces:
        _read_into(p, reader, block, out if whole else out[p.expert, p.rows])
    return out


def _materialize4(pieces: list[Piece], old: torch.Tensor, device: torch.device, reader: TensorReader,
                  block: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """A target tensor held in 4 bits (`kernels.quantize4`: uint8 [..., N, 17K/32]), each checkpoint piece
    quantized from its values as stored (FP8 dequantized to fp32 first) into its rows as it is read: the
    full-precision tensor is never formed, only one piece (a weight, or one expert's projection) at a time."""
    out = torch.empty(*old.shape[:-1], packed_width(old.shape[-1]), dtype=torch.uint8, device=device)
    whole = len(pieces) == 1 and pieces[0].expert < 0
    for p in pieces:
        t = reader.get(p.info)
        if p.scale is not None:
            t = dequantize_blockwise(t, reader.get(p.scale), block, dtype=torch.float32)
        (out if whole else out[p.expert, p.rows]).copy_(quantize4(t.to(device)))
    return out


def _read_into(piece: Piece, reader: TensorReader, block: tuple[int, int], out: torch.Tensor) -> None:
    """A checkpoint tensor copied (an FP8 one dequantized) straight into `out`, a view of the target tensor."""
    t = reader.get(piece.info)
    if piece.scale is None:
        out.copy_(t)
    else:
        dequantize_blockwise(t, reader.get(piece.scale), block, dtype=out.dtype, out=out)


def _assign(model: nn.Module, name: str, tensor: torch.Tensor, aliases: list[str]) -> None:
    new = None
    for full in [name] + aliases:
        mod_name, _, leaf = full.rpartition(".")
        mod = model.get_submodule(mod_name)
        if leaf in mod._parameters:
            if new is None:
                grad = mod._parameters[leaf].requires_grad and tensor.is_floating_point()  # (not a 4-bit one)
                new = nn.Parameter(tensor, requires_grad=grad)
            mod._parameters[leaf] = new
        else:
            mod._buffers[leaf] = tensor


def _finish(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Move what was not loaded (non-persistent buffers; with strict=False, missing parameters) into place."""
    for name, p in model.named_parameters():
        if p.is_meta:
            raise CheckpointError(f"internal error: parameter {name} was not loaded")
    for name, b in model.named_buffers():
        if b.is_meta:
            raise CheckpointError(f"internal error: buffer {name} was not loaded")
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    model.to(device)


def _aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameters: {alias name: first name of the same Parameter}."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (a Hugging Face model folder needs config.json)")
    try:
        d = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return d


def _fp8_block(hf_dict: dict, file: Path) -> tuple[int, int]:
    """Pop `quantization_config` (we dequantize on load) and return its FP8 block size."""
    q = hf_dict.pop("quantization_config", None)
    if q is None:
        return DEFAULT_BLOCK
    if q.get("quant_method") != "fp8":
        raise CheckpointError(
            f"{file}: quantization_config.quant_method {q.get('quant_method')!r} is not supported "
            "(only the official FP8 block quantization, 'fp8')"
        )
    block = q.get("weight_block_size") or list(DEFAULT_BLOCK)
    if len(block) != 2:
        raise CheckpointError(f"{file}: quantization_config.weight_block_size must be [rows, cols], got {block}")
    return int(block[0]), int(block[1])


def _model_config(hf_dict: dict, file: Path) -> ModelConfig:
    try:
        return config_from_hf(hf_dict, source=str(file))
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(str(e) if str(file) in str(e) else f"{file}: {e}") from e


def config_dtype(hf_dict: dict) -> torch.dtype:
    name = hf_dict.get("dtype") or hf_dict.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _drop_absent_mtp(cfg: ModelConfig, ckpt: dict[str, TensorInfo], folder: Path) -> ModelConfig:
    n, want = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    present = {
        int(m.group(1)) - n for k in ckpt if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= n
    }
    have = 0
    while have < want and have in present:
        have += 1
    if have == want:
        return cfg
    warnings.warn(
        f"{folder}: config.json asks for {want} MTP layers but the checkpoint holds {have} "
        f"(no model.layers.{n + have}.*{'; transformers does not save them' if not have else ''}); loading with "
        f"num_nextn_predict_layers={have}",
        stacklevel=3,
    )
    return dataclasses.replace(cfg, num_nextn_predict_layers=have)


# ---------------------------------------------------------------- saving


def save_pretrained(
    model: DeepSeekV3,
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write `model` as a Hugging Face DeepseekV3 folder: config.json, generation_config.json and
    model.safetensors (or shards + model.safetensors.index.json past `max_shard_size`, e.g. "5GB" or bytes).

    Official layout: per-expert `mlp.experts.e.{gate,up,down}_proj.weight`, MTP module k as
    `model.layers.{N+k}.*` with copies of embed_tokens and lm_head (`shared_head.head`). dtype: of floating
    parameters (default: as they are); buffers keep theirs. Atomic (`anyseek.storage.atomic_folder`): an existing
    folder is replaced only once the new one is complete, and its tokenizer files are kept. A softmax-routed model
    that transformers' DeepseekV2 would compute differently (`transformers_gaps`) is a CheckpointError naming why.
    A folder holding anything else (a user's files, a training checkpoint's state) is refused with FileExistsError
    naming it: nothing is deleted that the caller did not write.
    """
    folder = Path(path)
    if folder.is_dir():
        other = sorted(p.name for p in folder.iterdir() if not (p.is_file() and _REPLACED_FILES.fullmatch(p.name)))
        if other:
            raise FileExistsError(f"{folder}: holds {', '.join(other[:5])}{' ...' if len(other) > 5 else ''}, which "
                                  "save_pretrained would delete (it replaces the folder, keeping only tokenizer "
                                  "files); save into a new or empty folder, or move them away first")
    with atomic_folder(folder) as tmp:
        write_model_files(model, tmp, dtype, max_shard_size)
        if folder.is_dir():
            for f in folder.iterdir():
                if f.is_file() and _KEEP_FILES.fullmatch(f.name) and not (tmp / f.name).exists():
                    shutil.copy2(f, tmp / f.name)


def write_model_files(
    model: DeepSeekV3,
    folder: Path,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    for_transformers: bool = True,
) -> None:
    """The model's files (config.json, generation_config.json, safetensors) into an existing `folder`, in place:
    callers that need atomicity write into an `atomic_folder`.

    for_transformers=True (exports): a model that transformers would compute differently (`transformers_gaps`) is a
    CheckpointError naming why, before anything is written. False (training checkpoints: the resume state, which
    anyseek loads exactly): written all the same, with a warning and the reasons under "anyseek" in config.json."""
    if not isinstance(getattr(model, "config", None), ModelConfig):
        raise TypeError(f"save_pretrained needs a DeepSeekV3 (a ModelConfig at .config), got {type(model).__name__}")
    cfg = model.config
    gaps = transformers_gaps(model)
    if gaps and for_transformers:
        raise CheckpointError(
            f"not written: transformers' DeepseekV2 (how a softmax-routed model loads in transformers) would "
            f"compute another model than this one: {'; '.join(gaps)}. anyseek loads the training checkpoints of "
            "this model exactly (anyseek generate / eval, --init, anyseek.load_pretrained); a model transformers "
            "computes has none of these (model.bias_update_speed = 0 keeps the routing bias at zero)"
        )
    if gaps:
        warnings.warn(
            f"anyseek: this softmax-routed model is written as transformers' DeepseekV2, which will load it and "
            f"compute another model: {'; '.join(gaps)}. anyseek resumes and loads it exactly; `anyseek export` "
            "refuses it",
            stacklevel=2,
        )
    # transformers' DeepseekV2 has no routing bias: an all-zero one (nothing to keep) stays out of its folder
    omit = set() if gaps or cfg.scoring_func != "softmax" else _routing_biases(model.state_dict())
    entries = _save_entries(model, cfg.num_hidden_layers, cfg.num_nextn_predict_layers, dtype, omit)
    write_shards(entries, folder, max_shard_size)
    _write_configs(model, cfg, folder, dtype, gaps)


def transformers_gaps(model: nn.Module) -> list[str]:
    """What of `model` (its config and its trained routing bias) the transformers class its config.json names would
    not compute; empty when transformers computes this model. Only softmax routing (DeepseekV2) has gaps."""
    cfg = model.config
    gaps = config_gaps(cfg)
    if cfg.scoring_func == "softmax":
        state = model.state_dict()
        biased = [n for n in _routing_biases(state) if state[n].any()]
        if biased:
            gaps.append(
                f"a trained routing bias (e_score_correction_bias nonzero in {len(biased)} MoE layers; transformers' "
                "DeepseekV2 selects experts without one)"
            )
    return gaps


def _routing_biases(state: dict[str, torch.Tensor]) -> set[str]:
    return {n for n in state if n.endswith(_ROUTING_BIAS)}


def _save_entries(
    model: nn.Module, n_layers: int, n_mtp: int, dtype: torch.dtype | None, omit: set[str] = frozenset()
) -> list:
    """(checkpoint name, bytes, make tensor) for every tensor to write but `omit`, experts unstacked, MTP renamed."""
    state = {n: t for n, t in model.state_dict().items() if n not in omit}
    buffers = {n for n, _ in model.named_buffers()}

    def out_dtype(name: str, t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() and name not in buffers else t.dtype

    entries = []
    for name, t in state.items():
        hf, want = to_hf(name, n_layers), out_dtype(name, t)
        if t.dim() == 3 and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            inter = t.shape[1] // 2
            for ename, e, part in expert_names(hf, t.shape[0]):
                rows = {"gate": slice(0, inter), "up": slice(inter, None), "down": slice(None)}[part]
                shape = t[e, rows].shape
                entries.append((ename, nbytes(shape, want), lambda t=t, e=e, r=rows, w=want: t[e, r].to(w)))
        else:
            entries.append((hf, nbytes(t.shape, want), lambda t=t, w=want: t.to(w)))
    for k in range(n_mtp):
        for copy, src in (
            ("embed_tokens.weight", "model.embed_tokens.weight"),
            ("shared_head.head.weight", "lm_head.weight"),
        ):
            t, want = state[src], out_dtype(src, state[src])
            entries.append((f"model.layers.{n_layers + k}.{copy}", nbytes(t.shape, want), lambda t=t, w=want: t.to(w)))
    return entries


def _write_configs(
    model: nn.Module, cfg: ModelConfig, folder: Path, dtype: torch.dtype | None, gaps: list[str] = ()
) -> None:
    hf = config_to_hf(cfg)
    if gaps:  # for whoever opens the folder: transformers loads it and computes another model
        hf["anyseek"][NOTE_KEY] = f"transformers' {hf['architectures'][0]} does not compute: {'; '.join(gaps)}"
    saved = dtype if dtype is not None else next(p.dtype for p in model.parameters() if p.is_floating_point())
    hf["dtype"] = str(saved).removeprefix("torch.")
    hf.pop("torch_dtype", None)
    hf.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    gen = {"_from_model_config": True}
    gen.update({k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None})
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
