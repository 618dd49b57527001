"""`anyseek export RUN_OR_STEP --out DIR` (`--merge RUN_OR_STEP`, `--peft RUN_OR_STEP`): a Hugging Face folder, or a
PEFT adapter folder, from a training checkpoint (`anyseek.checkpoint.exporter`)."""

from __future__ import annotations

import argparse

DTYPES = ("fp32", "bf16", "fp16")  # (names only: torch is imported when the command runs, not for --help)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", metavar="RUN_OR_STEP",
                        help="a step-N folder or a run folder (its newest complete checkpoint): LoRA checkpoints are "
                             "merged into their base, sharded ones gathered, one-process ones rewritten")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--merge", metavar="RUN_OR_STEP", help="a LoRA run: its base with the adapters merged (what "
                                                             "RUN_OR_STEP does for a LoRA checkpoint)")
    what.add_argument("--peft", metavar="RUN_OR_STEP", help="a LoRA run: a PEFT adapter folder (attention adapters)")
    parser.add_argument("--out", required=True,
                        help="the folder to write: new, empty, or an earlier export (replaced once the new one is "
                             "complete); never a run folder or anything inside one")
    parser.add_argument("--base", default=None, help="LoRA: the base model folder (default: the one lora.json names)")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="dtype of the written weights (default: as trained; LoRA: the base's config.json dtype)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """A missing or damaged checkpoint, or a base that does not match, raises CheckpointError (a ValueError):
    `anyseek.cli` prints it as one `error:` line and exits 2."""
    import torch

    from anyseek.checkpoint.exporter import export, export_merged, export_peft

    given = [x for x in (args.checkpoint, args.merge, args.peft) if x]
    if len(given) != 1:
        raise ValueError("anyseek export takes one of RUN_OR_STEP, --merge RUN_OR_STEP or --peft RUN_OR_STEP")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    if args.peft:
        out = export_peft(args.peft, args.out)
    elif args.merge:
        out = export_merged(args.merge, args.out, args.base, dtype)
    else:
        out = export(args.checkpoint, args.out, dtype, args.base)
    print(f"wrote {out}")
    return 0
