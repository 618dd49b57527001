"""A Hugging Face folder (safetensors, config, tokenizer) from a training
checkpoint, written atomically through anyseek.hf's writer, and a PEFT adapter folder for LoRA runs (the command:
`anyseek export`, `anyseek.checkpoint.cli`).

RUN_OR_STEP is a step-N folder, or a run folder (its newest complete checkpoint). What is written depends on it:
- a LoRA checkpoint (adapters.safetensors + lora.json): the base (from lora.json, or --base) with s * B A added to
  every adapted weight in fp32 (`--merge RUN_OR_STEP` says the same explicitly);
- a sharded checkpoint of a distributed run (dcp/): gathered in one process on the CPU
  (`export_sharded`);
- a one-process checkpoint: it already is a Hugging Face folder; its model is rewritten (e.g. in --dtype).
The folder loads in `anyseek.load_pretrained` and transformers.

`--peft RUN_OR_STEP` writes a PEFT adapter folder (adapter_config.json + adapter_model.safetensors, PEFT's key
names) for `peft.PeftModel.from_pretrained(transformers_model, DIR)` holding the attention projections' adapters of
the main layers. Left out, with a warning (the merged export keeps all of them):
- dense-MLP and shared-expert adapters: PEFT (0.21) rewrites `gate_proj` / `up_proj` / `down_proj` targets of a
  transformers-5 DeepseekV3 into leaf names and onto the fused routed experts, so it would not load them where they
  were trained (checked: attention-only folders load and give our logits; with MLP targets they do not);
- routed-expert adapters (transformers stacks the experts in one parameter; PEFT's per-parameter LoRA differs);
- the MTP modules' adapters (transformers has no MTP modules).

Where it writes (`check_out`, before anything is read or written): `--out DIR` must be absent, an empty folder, or a
folder an earlier export wrote (its export.json lists the files it wrote, and DIR holds nothing else); it is then
replaced once the new folder is complete. Never a run folder, a step-N folder or anything inside one (their
checkpoints, metrics and training state are not an export's to replace), nor the checkpoint or base being read.
There is no override: a folder that must go is the user's to delete.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from anyseek.checkpoint.adapters import ADAPTERS, is_lora, read_adapters, read_lora_json
from anyseek.checkpoint.find import find_checkpoint
from anyseek.checkpoint.folder import MARKER, STEP_DIR, is_sharded, verify
from anyseek.checkpoint.identity import reference
from anyseek.hf import config_dtype, load_pretrained, write_model_files
from anyseek.storage import LOCK_FILE, CheckpointError, atomic_folder
from anyseek.transforms.lora import ATTENTION, apply_lora, merge_lora

PEFT_PREFIX = "base_model.model."
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens")
EXPORT_JSON = "export.json"  # written last into every export: its source and the files it wrote
RUN_FILES = (MARKER, "train_state.json", "metrics.jsonl", LOCK_FILE)  # any of them: a run's folder or a step-N


class ExportRefused(ValueError):
    """`--out` names a folder an export must not replace; the message says what it holds and what to do."""


def export(run_or_step: str | Path, out: str | Path, dtype: torch.dtype | None = None,
           base: str | Path | None = None) -> Path:
    """`anyseek export RUN_OR_STEP --out DIR`: a LoRA checkpoint merged into its base (`base`: another folder than
    the one lora.json names), a sharded one gathered, a one-process one rewritten (in `dtype`: default as trained).
    `out`: see `check_out` (ExportRefused)."""
    check_out(out, run_or_step)
    step, verified = find_checkpoint(run_or_step)
    if is_lora(step):
        return export_merged(step, out, base, dtype)
    if base is not None:
        raise ValueError(f"--base is for LoRA checkpoints; {step} holds a whole model")
    if is_sharded(step):
        return export_sharded(step, out, dtype)  # verifies
    if not verified:
        verify(step)
    return write_hf_folder(load_pretrained(step, device="cpu"), step, Path(out), dtype)


def find_lora_checkpoint(run_or_step: str | Path) -> Path:
    """A LoRA step-N folder (verified), itself or the newest complete checkpoint of a run folder."""
    path, verified = find_checkpoint(run_or_step)
    if not is_lora(path):
        raise CheckpointError(f"{path}: not a LoRA checkpoint (no lora.json); export it as `anyseek export {path} "
                              "--out DIR`")
    if not verified:
        verify(path)
    return path


def load_lora_model(step: Path, base: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """The base (from lora.json, or `base`) with the checkpoint's adapters applied, on the CPU, in eval mode."""
    saved = read_lora_json(step)
    folder = _base_folder(step, base or saved.base["path"])
    model = load_pretrained(folder, dtype=dtype)
    apply_lora(model, saved.spec, dtype)
    read_adapters(step, model, reference(folder))  # a different base (by content hash) is an error
    return model.eval()


def _base_folder(step: Path, path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{step}: its base {folder} is not a model folder (no config.json); pass the base the "
                              "adapters were trained on with --base PATH")
    return folder


def export_merged(run_or_step, out, base=None, dtype: torch.dtype | None = None) -> Path:
    """The base with the adapters merged, as a Hugging Face folder with the run's tokenizer, written atomically
    (`anyseek.storage.atomic_folder`: an existing `out` is replaced only once the new folder is complete)."""
    check_out(out, run_or_step)
    step = find_lora_checkpoint(run_or_step)
    base_folder = _base_folder(step, base or read_lora_json(step).base["path"])
    check_out(out, step, base_folder)
    model = merge_lora(load_lora_model(step, base))
    if dtype is None:
        dtype = config_dtype(json.loads((base_folder / "config.json").read_text()))
    return write_hf_folder(model, step, Path(out), dtype)  # the run's tokenizer (the base's, by construction)


def export_sharded(checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                   max_shard_size: int | str = "5GB") -> Path:
    """A sharded checkpoint folder (step-N with dcp/) -> the Hugging Face folder `out_dir` (replaced atomically),
    gathered in one process on the CPU. dtype: of the floating weights (default: as trained, fp32). Raises
    CheckpointError for a damaged or unloadable checkpoint, ValueError for a folder that is not a sharded checkpoint."""
    from anyseek.checkpoint.sharded import load_consolidated  # (torch.distributed.checkpoint: sharded folders only)

    src = Path(checkpoint_dir)
    check_out(out_dir, src)
    if not is_sharded(src):
        raise ValueError(f"{src}: not a sharded checkpoint (no dcp/ folder)")
    return write_hf_folder(load_consolidated(src), src, Path(out_dir), dtype, max_shard_size)


def write_hf_folder(model, src: Path, out: Path, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB") -> Path:
    """`model` as the Hugging Face folder `out` (`check_out`), with the tokenizer files of the checkpoint folder `src`;
    atomic: an earlier export at `out` is replaced only once the new folder is complete."""
    check_out(out, src)
    with atomic_folder(out) as tmp:
        write_model_files(model, tmp, dtype, max_shard_size)
        for f in sorted(Path(src).iterdir()):
            if f.is_file() and f.name.startswith(TOKENIZER_PREFIXES):
                shutil.copy2(f, tmp / f.name)
        _mark(tmp, src)
    return out


def export_peft(run_or_step, out) -> Path:
    """A PEFT adapter folder `out` (`check_out`) from a LoRA checkpoint (see the module docstring)."""
    check_out(out, run_or_step)
    step = find_lora_checkpoint(run_or_step)
    saved = read_lora_json(step)
    spec, ref = saved.spec, saved.base
    check_out(out, step, ref["path"])
    tensors, left_out = peft_tensors(load_file(str(step / ADAPTERS)))
    if not tensors:
        raise ValueError(f"{step}: none of its adapters can be written for PEFT (targets {list(spec.targets)})")
    if left_out:
        print("anyseek export: warning: left out of the PEFT folder (PEFT cannot place them on transformers' "
              f"DeepseekV3): {len(left_out)} adapters, e.g. {left_out[0]}; the merged export keeps them",
              file=sys.stderr)
    modules = sorted({k.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for k in tensors})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": ref["path"],
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "target_modules": modules,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    with atomic_folder(Path(out)) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        _mark(tmp, step)
    return Path(out)


def check_out(out: str | Path, *sources: str | Path) -> Path:
    """`out` as the folder an export may write, else ExportRefused: absent, empty, or an earlier export holding only
    what it wrote (export.json lists it); never a run folder, a step-N folder or anything inside one, nor one of the
    folders the export reads (`sources`: the checkpoint, a LoRA base) or one inside or around them."""
    given = Path(out).expanduser()
    where = given.resolve()
    if given.exists() and not given.is_dir():
        raise ExportRefused(f"--out {given}: exists and is not a folder")
    for src in sources:
        read = Path(src).expanduser().resolve()
        how = "is" if where == read else "is inside" if read in where.parents else "holds" if where in read.parents \
            else None
        if how:
            raise ExportRefused(f"--out {given} {how} {read}, which the export reads; choose a new or empty folder")
    for folder in (where, *where.parents):
        if _is_run_folder(folder):
            what = "is" if folder == where else "is inside"
            raise ExportRefused(f"--out {given} {what} {folder}, a training run's folder: its checkpoints, metrics and "
                                "training state are not an export's to replace; choose a folder outside the run")
    _check_replaceable(given)
    return given


def _is_run_folder(folder: Path) -> bool:
    """A run's folder or one of its step-N folders: a training file, or a step-N folder holding a checkpoint."""
    if not folder.is_dir():
        return False
    if any((folder / name).exists() for name in RUN_FILES):
        return True
    try:
        return any(STEP_DIR.match(p.name) and (p / MARKER).is_file() for p in folder.iterdir())
    except OSError:  # a folder we may not list (/home of others): no run of ours
        return False


def _check_replaceable(out: Path) -> None:
    """An existing `out` may go only when it holds nothing but what an earlier export wrote there."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    try:
        wrote = set(json.loads((out / EXPORT_JSON).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ExportRefused(f"--out {out}: not empty and not written by anyseek export (holds {_some(held)}); "
                            "choose a new or empty folder") from None
    others = [name for name in held if name not in wrote and name != EXPORT_JSON]
    if others:
        raise ExportRefused(f"--out {out}: an earlier export, but it also holds {_some(others)}, which the export "
                            "did not write and would delete; move them away or choose another folder")


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _mark(tmp: Path, src: Path) -> None:
    """export.json, written last: what the folder was exported from and which files the export wrote (a later export
    may replace exactly those; anything else found there is the user's)."""
    files = sorted(p.name for p in tmp.iterdir())
    mark = {"written_by": "anyseek export", "source": str(Path(src).resolve()), "files": files}
    (tmp / EXPORT_JSON).write_text(json.dumps(mark, indent=1) + "\n")


def peft_tensors(adapters: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our adapter names -> PEFT's (`...q_b_proj.lora_A` -> `base_model.model....q_b_proj.lora_A.weight`), and the
    names left out (see the module docstring)."""
    out, left = {}, []
    for name, t in sorted(adapters.items()):
        leaf = name.rsplit(".", 1)[-1]
        module = name.rsplit(".", 2)[-2]
        if name.startswith("mtp.") or leaf not in ("lora_A", "lora_B") or module not in ATTENTION:
            left.append(name)
            continue
        out[f"{PEFT_PREFIX}{name}.weight"] = t.contiguous()
    return out, left
