"""`anyseek plan --config FLAVOR --gpus N [--gpu-memory GB] [--tokens-per-gpu T] [--parallel.key=value]`:
memory per GPU and communication per step for each expert-parallel degree, on paper (nothing is allocated).

What anyseek does, counted as it does it (docs/distributed.md):
  dense weights (everything but the routed experts): FSDP2 over all N GPUs, fp32 master + fp32 grads + AdamW's two
  fp32 moments = 16 bytes/parameter / N (bf16 shards: bf16 weights + fp32 masters + bf16 grads, the same 16; the
  weights column counts 4 bytes and the gradients 4 either way);
  routed experts: split over EP ranks, replicated over N/EP groups (not FSDP-sharded), 16 bytes/parameter / EP;
  activations: bf16, the tensors each layer keeps for backward, counted by the same model as the report printed
  before a run (`anyseek.train.memory.activation_bytes`; fp32 residual stream where the shards are fp32, i.e. with
  EP); with activation checkpointing the recomputed layers keep only their inputs, plus one layer's working set.
Communication per GPU and step: FSDP all-gathers the bf16 dense weights twice (forward, backward) and
reduce-scatters fp32 gradients; EP sends every routed row's hidden state out and back, forward and backward; the
expert gradients are all-reduced over the N/EP copies. No pipeline parallelism: a model whose experts do not fit
even at the largest EP degree does not fit.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

ACCEPTS_EXTRA = True
GB = 1e9


@dataclass
class Plan:
    ep: int
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    activations_selective_gb: float  # every other layer recomputed (parallel.activation_checkpointing=selective)
    activations_ckpt_gb: float  # every layer recomputed (full)
    allgather_gb: float
    reduce_scatter_gb: float
    all_to_all_gb: float
    expert_allreduce_gb: float

    def total(self, checkpointing: bool | str) -> float:
        """Per-GPU GB with activation checkpointing none (False), "selective" (every other layer) or full (True)."""
        if checkpointing == "selective":
            act = self.activations_selective_gb
        else:
            act = self.activations_ckpt_gb if checkpointing else self.activations_gb
        return self.weights_gb + self.grads_gb + self.optimizer_gb + act


def parameter_counts(config) -> tuple[int, int]:
    """(dense parameters, routed-expert parameters) of the model, counted on the meta device."""
    from anyseek.model.moe import Experts
    from anyseek.model.transformer import DeepSeekV3

    model = DeepSeekV3(config, device="meta")
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    return model.num_parameters() - experts, experts


def plan(config, gpus: int, ep: int, tokens_per_gpu: int) -> Plan:
    """The per-GPU bytes and traffic of `config` on `gpus` GPUs, EP degree `ep` (a divisor of gpus)."""
    if gpus < 1 or ep < 1 or gpus % ep or tokens_per_gpu < 0:
        raise ValueError(f"plan needs gpus >= 1, an EP degree dividing it and tokens >= 0; got gpus={gpus}, ep={ep}, "
                         f"tokens_per_gpu={tokens_per_gpu}")
    from anyseek.train.memory import activation_bytes  # (torch: not for `anyseek plan --help`)

    dense, experts = parameter_counts(config)
    # bf16 shards (parallel.shard_dtype=auto without EP) carry a bf16 residual stream; fp32 shards under autocast an
    # fp32 one
    resid = 2 if ep == 1 else 4
    acts = {mode: activation_bytes(config, tokens_per_gpu, mode, low=2, resid=resid)
            for mode in ("none", "selective", "full")}
    edp = gpus // ep
    frac = (gpus - 1) / gpus
    n_moe = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)) + config.num_nextn_predict_layers
    rows = tokens_per_gpu * config.num_experts_per_tok * n_moe
    return Plan(
        ep=ep,
        weights_gb=4 * (dense / gpus + experts / ep) / GB,
        grads_gb=4 * (dense / gpus + experts / ep) / GB,
        optimizer_gb=8 * (dense / gpus + experts / ep) / GB,
        activations_gb=acts["none"] / GB,
        activations_selective_gb=acts["selective"] / GB,
        activations_ckpt_gb=acts["full"] / GB,
        allgather_gb=2 * 2 * dense * frac / GB,
        reduce_scatter_gb=4 * dense * frac / GB,
        all_to_all_gb=4 * rows * config.hidden_size * 2 * (ep - 1) / ep / GB,
        expert_allreduce_gb=2 * 4 * experts / ep * (edp - 1) / edp / GB,
    )


def candidates(config, gpus: int) -> list[int]:
    return [e for e in range(1, gpus + 1) if gpus % e == 0 and config.n_routed_experts % e == 0] or [1]


def _number(kind: type, least: float, what: str):
    """An argparse type: a `kind` number >= `least` (finite), else argparse's one-line error naming the flag."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (least <= value < float("inf")):  # also refuses nan
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="tiny", help="a shipped config, a model flavor (16B, 671B) or a TOML")
    parser.add_argument("--gpus", type=_number(int, 1, "a whole number of GPUs >= 1"), default=1,
                        help="GPUs in all (the world size)")
    parser.add_argument("--gpu-memory", type=_number(float, 1e-9, "a number of GB > 0"), default=80.0,
                        help="GB of memory per GPU (default 80)")
    parser.add_argument("--tokens-per-gpu", type=_number(int, 0, "a whole number of tokens >= 1 (0: the config's)"),
                        default=0, help="tokens per micro-batch per GPU (default: the config's data.tokens_per_batch)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from anyseek.train.config import ConfigError, load_run_config

    try:
        cfg = load_run_config(args.config, extra)
        config = cfg.model_config()
    except ConfigError as e:
        print(f"anyseek plan: config error: {e}", file=sys.stderr)
        return 2
    T = args.tokens_per_gpu or cfg.data.tokens_per_batch
    dense, experts = parameter_counts(config)
    print(f"{cfg.model.flavor}: {(dense + experts) / 1e9:.2f}B parameters ({dense / 1e9:.2f}B dense, "
          f"{experts / 1e9:.2f}B routed experts) on {args.gpus} GPUs of {args.gpu_memory:g} GB, {T} tokens/GPU")
    print(f"{'ep':>5} {'weights':>8} {'grads':>7} {'adam':>7} {'act':>7} {'act/ckpt':>8} {'total':>7} "
          f"{'fits':>10} | per step: {'all-gather':>10} {'red-scat':>9} {'all2all':>8} {'exp-AR':>8}  (GB)")
    usable = 0.9 * args.gpu_memory  # allocator slack, CUDA context, kernels' workspaces
    fitting: list[tuple[Plan, str]] = []
    for ep in candidates(config, args.gpus):
        p = plan(config, args.gpus, ep, T)
        fits = ("yes" if p.total(False) <= usable else "selective" if p.total("selective") <= usable
                else "with ckpt" if p.total(True) <= usable else "no")
        if fits != "no":
            fitting.append((p, fits))
        print(f"{ep:>5} {p.weights_gb:>8.2f} {p.grads_gb:>7.2f} {p.optimizer_gb:>7.2f} {p.activations_gb:>7.2f} "
              f"{p.activations_ckpt_gb:>8.2f} {p.total(False):>7.1f} {fits:>10} | {'':>9} {p.allgather_gb:>10.2f} "
              f"{p.reduce_scatter_gb:>9.2f} {p.all_to_all_gb:>8.2f} {p.expert_allreduce_gb:>8.2f}")
    if not fitting:
        print("does not fit at any EP degree: more GPUs, fewer tokens per GPU, or pipeline parallelism (which anyseek "
              "does not do)")
        return 1
    p, fits = next((f for f in fitting if f[1] == "yes"), fitting[0])  # recomputing costs ~1/3 more compute
    ckpt = {"with ckpt": " --parallel.activation_checkpointing=full",
            "selective": " --parallel.activation_checkpointing=selective"}.get(fits, "")
    print(f"suggested: --parallel.ep={p.ep}{ckpt} --data.tokens_per_batch={T} (the smallest EP degree that fits, "
          "without recomputation if possible: least all-to-all traffic)")
    return 0
