#!/usr/bin/env python3
"""Pre-flight of the torchtitan 16B peer, no GPU needed: is torchtitan's model the same model anyseek trains?

    PYTHONPATH=<site with the wheels>:src python3 benchmarks/peers/torchtitan/check_16b.py [--ep 4] [--layers 27]
        [--vocab 32000] [--seqlen 2048] [--json OUT]

1. parses the run's torchtitan command line through torchtitan's own ConfigManager (the same --module/--config and
   overrides run_16b_ep.sh passes), so a bad override fails here in seconds, not after a torchrun start;
2. builds torchtitan's model on the meta device and anyseek's `16B` (with --model.num_hidden_layers / vocab_size
   the same) on the meta device, and compares the parameter counts of every part: embedding, attention,
   dense MLP, router, shared experts, routed experts, norms, lm_head (exit 1 where one differs);
3. prints both trainers' FLOPs per token at --seqlen (one document per sample, as the synthetic data has):
   torchtitan's  6 x (active parameters without the embedding, norms included) + 6 x L x H x (qk + v) x S
   anyseek's     6 x (active parameters without the embedding and norms) + 3 x L x H x (qk + v) x S
   (attention counted causal, i.e. halved; recomputation credited by neither). --json writes them for the
   summary, which turns torchtitan's tokens/s into anyseek's MFU.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import launch_16b  # after the sys.path line above


def torchtitan_side(args) -> dict:
    sys.path.insert(0, launch_16b.peer_dir())
    import launch

    launch.apply_torch_compat_shims()
    launch.maybe_stub_datasets()
    os.environ["TT_LAYERS"], os.environ["TT_VOCAB"] = str(args.layers), str(args.vocab)
    import torch
    from torchtitan.config import ConfigManager

    cli = ["--module", "tt_dsv3_16b", "--config", "deepseek_v3_16b_ep", "--parallelism.expert_parallel_degree",
           str(args.ep), "--training.seq_len", str(args.seqlen), *args.extra]  # fmt: skip
    config = ConfigManager().parse_args(cli)
    assert config.parallelism.expert_parallel_degree == args.ep, "the EP override did not reach the config"
    model_cfg = config.model_spec.model
    with torch.device("meta"):
        model = model_cfg.build()
    parts: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = tt_part(name)
        parts[part] = parts.get(part, 0) + p.numel()
    moe = next(layer.moe for layer in model_cfg.layers if layer.moe is not None)
    active = sum(parts.values()) - parts.get("routed experts", 0) * (1 - moe.router.top_k / moe.num_experts)
    nparams, flops = model_cfg.get_nparams_and_flops(model, args.seqlen)
    return {"parts": parts, "total": nparams, "active": int(active), "flops_per_token": flops,
            "config": {"ep": config.parallelism.expert_parallel_degree, "batch": config.training.local_batch_size,
                       "seq_len": config.training.seq_len, "steps": config.training.steps,
                       "cuda_graphs": not config.training.disable_cuda_graphs,
                       "compile": config.compile.enable, "spmd_backend": config.parallelism.spmd_backend,
                       "activation_checkpoint": type(config.activation_checkpoint).__qualname__}}  # fmt: skip


def _part(name: str, rules: list[tuple[str, str]], who: str) -> str:
    """The part of the first rule whose key `name` contains."""
    for key, part in rules:
        if key in name:
            return part
    raise ValueError(f"{who} parameter {name!r} matches no part")


def tt_part(name: str) -> str:
    """torchtitan parameter name -> the part it belongs to."""
    return _part(name, [("tok_embeddings", "embedding"), ("lm_head", "lm_head"),
                        ("moe.routed_experts", "routed experts"), ("moe.shared_experts", "shared experts"),
                        ("moe.router", "router"), ("feed_forward", "dense MLP"), ("norm", "norms"),
                        ("attention", "attention")], "torchtitan")  # fmt: skip


def anyseek_part(name: str) -> str:
    """anyseek parameter name (Hugging Face style) -> the part it belongs to."""
    return _part(name, [("embed_tokens", "embedding"), ("lm_head", "lm_head"), ("mlp.experts", "routed experts"),
                        ("mlp.shared_experts", "shared experts"), ("mlp.gate.", "router"), ("norm", "norms"),
                        ("self_attn", "attention"), ("mlp.", "dense MLP")], "anyseek")  # fmt: skip


def anyseek_side(args) -> dict:
    from anyseek.model.config import ModelConfig
    from anyseek.model.flavors import FLAVORS
    from anyseek.model.transformer import DeepSeekV3

    fields = dict(FLAVORS["16B"], num_hidden_layers=args.layers, vocab_size=args.vocab)
    model = DeepSeekV3(ModelConfig(**fields), device="meta")
    parts: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.dtype.is_floating_point and p.requires_grad:
            part = anyseek_part(name)
            parts[part] = parts.get(part, 0) + p.numel()
    return {
        "parts": parts,
        "total": model.num_parameters(),
        "active": model.num_parameters(active_only=True),
        "flops_per_token": model.flops_per_token(args.seqlen),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--json", default=None, help="write both sides' counts and FLOPs per token here")
    p.add_argument("extra", nargs="*", help="more torchtitan overrides (after --)")
    args = p.parse_args()
    tt = torchtitan_side(args)
    try:
        ours = anyseek_side(args)
    except ImportError as e:
        print(f"anyseek not importable ({e}): run with PYTHONPATH=src to compare the shapes", file=sys.stderr)
        ours = None
    print(f"torchtitan config: {tt['config']}")
    bad = []
    if ours is not None:
        print("| part | torchtitan | anyseek |\n| --- | --- | --- |")
        for part in sorted(set(tt["parts"]) | set(ours["parts"])):
            a, b = tt["parts"].get(part, 0), ours["parts"].get(part, 0)
            print(f"| {part} | {a:,} | {b:,} |")
            if a != b:
                bad.append(part)
    for side, d in (("torchtitan", tt), ("anyseek", ours)):
        if d is not None:
            print(f"{side}: {d['total']:,} parameters, {d['active']:,} active, "
                  f"{d['flops_per_token'] / 1e9:.3f} GFLOP per token at seq {args.seqlen}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torchtitan": tt, "anyseek": ours, "layers": args.layers, "vocab": args.vocab,
                       "seqlen": args.seqlen}, f, indent=1)  # fmt: skip
    if bad:
        print(f"MISMATCH: torchtitan's model differs from anyseek's 16B in: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
