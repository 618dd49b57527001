"""`anyseek export --merge RUN_OR_STEP --out DIR` and `anyseek export --peft RUN_OR_STEP --out DIR`.

A LoRA checkpoint holds only adapters (adapters.safetensors) and a reference to its base (lora.json). --merge loads
the base, adds s * B A to every adapted weight in fp32 and writes a full Hugging Face folder (with the tokenizer)
that `anyseek.load_pretrained` and transformers load. --peft writes a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors, PEFT's key names) for `peft.PeftModel.from_pretrained(transformers_model, DIR)` holding
the attention projections' adapters of the main layers. Left out, with a warning (--merge keeps all of them):
- dense-MLP and shared-expert adapters: PEFT (0.21) rewrites `gate_proj` / `up_proj` / `down_proj` targets of a
  transformers-5 DeepseekV3 into leaf names and onto the fused routed experts, so it would not load them where they
  were trained (checked: attention-only folders load and give our logits; with MLP targets they do not);
- routed-expert adapters (transformers stacks the experts in one parameter; PEFT's per-parameter LoRA differs);
- the MTP modules' adapters (transformers has no MTP modules).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from anyseek.storage import CheckpointError

PEFT_PREFIX = "base_model.model."


def configure(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--merge", metavar="RUN_OR_STEP", help="write the base with the adapters merged (HF folder)")
    what.add_argument("--peft", metavar="RUN_OR_STEP", help="write a PEFT adapter folder")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--base", default=None, help="the base model folder (default: the one lora.json names)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="--merge: dtype of the written weights (default: the base's config.json dtype)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """A bad folder or a base that does not match raises CheckpointError (a ValueError): `anyseek.cli` prints it as
    one `error:` line and exits 2."""
    if args.merge:
        out = export_merged(args.merge, args.out, args.base, getattr(torch, args.dtype) if args.dtype else None)
    else:
        out = export_peft(args.peft, args.out)
    print(f"wrote {out}")
    return 0


def find_lora_checkpoint(run_or_step: str | Path) -> Path:
    """A LoRA step-N folder itself, or the newest complete one in a run folder."""
    from anyseek.train.checkpoint import latest_checkpoint
    from anyseek.train.lora import LORA_JSON

    path = Path(run_or_step)
    if not (path / LORA_JSON).is_file():
        ckpt = latest_checkpoint(path) if path.is_dir() else None
        if ckpt is None:
            raise CheckpointError(f"{path}: neither a LoRA step-N folder nor a run folder with a complete checkpoint")
        path = ckpt.path
    if not (path / LORA_JSON).is_file():
        raise CheckpointError(f"{path}: not a LoRA checkpoint (no {LORA_JSON}); it already is a full model folder")
    return path


def load_lora_model(step: Path, base: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """The base (from lora.json, or `base`) with the checkpoint's adapters applied, on the CPU, in eval mode."""
    from anyseek.hf import load_pretrained
    from anyseek.train.init import InitSource
    from anyseek.train.lora import apply_lora, read_adapters, read_lora_json

    spec, ref = read_lora_json(step)
    init = InitSource.open(base or ref["path"])
    model = load_pretrained(init.path, dtype=dtype)
    apply_lora(model, spec, dtype)
    read_adapters(step, model, init.reference())  # a different base (by content hash) is an error
    return model.eval()


def export_merged(run_or_step, out, base=None, dtype: torch.dtype | None = None) -> Path:
    """The base with the adapters merged, as a Hugging Face folder with the run's tokenizer, written atomically
    (`anyseek.storage.atomic_folder`: an existing `out` is replaced only once the new folder is complete)."""
    from anyseek.hf import write_model_files
    from anyseek.hf.pretrained import _config_dtype
    from anyseek.storage import atomic_folder
    from anyseek.train.lora import merge_lora, read_lora_json

    step = find_lora_checkpoint(run_or_step)
    _, ref = read_lora_json(step)
    base_folder = Path(base or ref["path"])
    model = merge_lora(load_lora_model(step, base))
    if dtype is None:
        dtype = _config_dtype(json.loads((base_folder / "config.json").read_text()))
    out = Path(out)
    with atomic_folder(out) as tmp:
        write_model_files(model, tmp, dtype)  # config.json, generation_config.json, safetensors
        for f in sorted(step.iterdir()):  # the run's tokenizer (the base's, by construction)
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens_map")):
                shutil.copy2(f, tmp / f.name)
    return out


def export_peft(run_or_step, out) -> Path:
    from safetensors.torch import load_file, save_file

    from anyseek.storage import atomic_folder
    from anyseek.train.lora import ADAPTERS, read_lora_json

    step = find_lora_checkpoint(run_or_step)
    spec, ref = read_lora_json(step)
    tensors, left_out = peft_tensors(load_file(str(step / ADAPTERS)))
    if not tensors:
        raise ValueError(f"{step}: none of its adapters can be written for PEFT (targets {list(spec.targets)})")
    if left_out:
        print("anyseek export: warning: left out of the PEFT folder (PEFT cannot place them on transformers' "
              f"DeepseekV3): {len(left_out)} adapters, e.g. {left_out[0]}; `--merge` keeps them", file=sys.stderr)
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
    return Path(out)


def peft_tensors(adapters: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our adapter names -> PEFT's (`...q_b_proj.lora_A` -> `base_model.model....q_b_proj.lora_A.weight`), and the
    names left out (see the module docstring)."""
    from anyseek.train.lora import ATTENTION

    out, left = {}, []
    for name, t in sorted(adapters.items()):
        leaf = name.rsplit(".", 1)[-1]
        module = name.rsplit(".", 2)[-2]
        if name.startswith("mtp.") or leaf not in ("lora_A", "lora_B") or module not in ATTENTION:
            left.append(name)
            continue
        out[f"{PEFT_PREFIX}{name}.weight"] = t.contiguous()
    return out, left
