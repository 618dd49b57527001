"""`anyseek export RUN_OR_STEP --out DIR`: a Hugging Face folder (safetensors, config, tokenizer) from a training
checkpoint, written atomically through anyseek.hf's writer; and `--peft` for LoRA runs.

RUN_OR_STEP is a step-N folder, or a run folder (its newest complete checkpoint). What is written depends on it:
- a LoRA checkpoint (adapters.safetensors + lora.json): the base (from lora.json, or --base) with s * B A added to
  every adapted weight in fp32 (`--merge RUN_OR_STEP` says the same explicitly);
- a sharded checkpoint of a distributed run (dcp/): gathered in one process on the CPU
  (`anyseek.checkpoint.hf_folder.export_sharded`);
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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from anyseek.storage import CheckpointError

PEFT_PREFIX = "base_model.model."
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", metavar="RUN_OR_STEP",
                        help="a step-N folder or a run folder (its newest complete checkpoint): LoRA checkpoints are "
                             "merged into their base, sharded ones gathered, one-process ones rewritten")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--merge", metavar="RUN_OR_STEP", help="a LoRA run: its base with the adapters merged (what "
                                                             "RUN_OR_STEP does for a LoRA checkpoint)")
    what.add_argument("--peft", metavar="RUN_OR_STEP", help="a LoRA run: a PEFT adapter folder (attention adapters)")
    parser.add_argument("--out", required=True, help="the folder to write (replaced only once the new one is complete)")
    parser.add_argument("--base", default=None, help="LoRA: the base model folder (default: the one lora.json names)")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES),
                        help="dtype of the written weights (default: as trained; LoRA: the base's config.json dtype)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """A missing or damaged checkpoint, or a base that does not match, raises CheckpointError (a ValueError):
    `anyseek.cli` prints it as one `error:` line and exits 2."""
    given = [x for x in (args.checkpoint, args.merge, args.peft) if x]
    if len(given) != 1:
        raise ValueError("anyseek export takes one of RUN_OR_STEP, --merge RUN_OR_STEP or --peft RUN_OR_STEP")
    dtype = DTYPES.get(args.dtype)
    if args.peft:
        out = export_peft(args.peft, args.out)
    elif args.merge:
        out = export_merged(args.merge, args.out, args.base, dtype)
    else:
        out = export_checkpoint(args.checkpoint, args.out, dtype, args.base)
    print(f"wrote {out}")
    return 0


def find_checkpoint(run_or_step: str | Path) -> tuple[Path, bool]:
    """(the step-N folder, whether it was verified): `run_or_step` itself when it is a step-N folder, else the newest
    complete checkpoint in that run folder (verified on the way)."""
    from anyseek.checkpoint.folder import STEP_DIR, latest_checkpoint

    path = Path(run_or_step)
    if STEP_DIR.match(path.name) and path.is_dir():
        return path, False
    ckpt = latest_checkpoint(path, log=lambda s: print(s, file=sys.stderr))
    if ckpt is None:
        raise CheckpointError(f"{path}: no complete checkpoint to export (a step-N folder, or a run folder with one)")
    return ckpt.path, True


def export_checkpoint(run_or_step, out, dtype: torch.dtype | None = None, base=None) -> Path:
    """`anyseek export RUN_OR_STEP`: a LoRA checkpoint merged, a sharded one gathered, a one-process one rewritten."""
    from anyseek.checkpoint.sharded import is_sharded
    from anyseek.checkpoint.hf_folder import export_sharded, write_hf_folder
    from anyseek.transforms.lora import LORA_JSON

    step, verified = find_checkpoint(run_or_step)
    if (step / LORA_JSON).is_file():
        return export_merged(step, out, base, dtype)
    if base is not None:
        raise ValueError(f"--base is for LoRA checkpoints; {step} holds a whole model")
    if is_sharded(step):
        return export_sharded(step, out, dtype)  # verifies
    from anyseek.hf import load_pretrained
    from anyseek.checkpoint.folder import verify

    if not verified:
        verify(step)
    return write_hf_folder(load_pretrained(step, device="cpu"), step, Path(out), dtype)


def find_lora_checkpoint(run_or_step: str | Path) -> Path:
    """A LoRA step-N folder (verified), itself or the newest complete checkpoint of a run folder."""
    from anyseek.checkpoint.folder import verify
    from anyseek.transforms.lora import LORA_JSON

    path, verified = find_checkpoint(run_or_step)
    if not (path / LORA_JSON).is_file():
        raise CheckpointError(f"{path}: not a LoRA checkpoint (no {LORA_JSON}); export it as `anyseek export {path} "
                              "--out DIR`")
    if not verified:
        verify(path)
    return path


def load_lora_model(step: Path, base: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """The base (from lora.json, or `base`) with the checkpoint's adapters applied, on the CPU, in eval mode."""
    from anyseek.hf import load_pretrained
    from anyseek.train.init import InitSource
    from anyseek.transforms.lora import apply_lora, read_adapters, read_lora_json

    spec, ref = read_lora_json(step)
    init = InitSource.open(base or ref["path"])
    model = load_pretrained(init.path, dtype=dtype)
    apply_lora(model, spec, dtype)
    read_adapters(step, model, init.reference())  # a different base (by content hash) is an error
    return model.eval()


def export_merged(run_or_step, out, base=None, dtype: torch.dtype | None = None) -> Path:
    """The base with the adapters merged, as a Hugging Face folder with the run's tokenizer, written atomically
    (`anyseek.storage.atomic_folder`: an existing `out` is replaced only once the new folder is complete)."""
    from anyseek.checkpoint.hf_folder import write_hf_folder
    from anyseek.hf.pretrained import _config_dtype
    from anyseek.transforms.lora import merge_lora, read_lora_json

    step = find_lora_checkpoint(run_or_step)
    _, ref = read_lora_json(step)
    base_folder = Path(base or ref["path"])
    model = merge_lora(load_lora_model(step, base))
    if dtype is None:
        dtype = _config_dtype(json.loads((base_folder / "config.json").read_text()))
    return write_hf_folder(model, step, Path(out), dtype)  # the run's tokenizer (the base's, by construction)


def export_peft(run_or_step, out) -> Path:
    from safetensors.torch import load_file, save_file

    from anyseek.storage import atomic_folder
    from anyseek.transforms.lora import ADAPTERS, read_lora_json

    step = find_lora_checkpoint(run_or_step)
    spec, ref = read_lora_json(step)
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
    return Path(out)


def peft_tensors(adapters: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our adapter names -> PEFT's (`...q_b_proj.lora_A` -> `base_model.model....q_b_proj.lora_A.weight`), and the
    names left out (see the module docstring)."""
    from anyseek.transforms.lora import ATTENTION

    out, left = {}, []
    for name, t in sorted(adapters.items()):
        leaf = name.rsplit(".", 1)[-1]
        module = name.rsplit(".", 2)[-2]
        if name.startswith("mtp.") or leaf not in ("lora_A", "lora_B") or module not in ATTENTION:
            left.append(name)
            continue
        out[f"{PEFT_PREFIX}{name}.weight"] = t.contiguous()
    return out, left
