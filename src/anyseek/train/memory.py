"""The expected peak memory of a training run, printed before it starts, with the knob to turn when it won't fit.

    est = estimate(model_cfg, run_cfg, lora_spec=None)
    print(est.table())

Parameters are counted exactly on a model built on the meta device (LoRA applied there too); activations come from
a per-token, per-layer count of the tensors autograd keeps. Against peaks measured on an H100 (docs/benchmarks.md):
the default GPU step (`train.working_copy`, CUDA graphs) of the `small` flavor at 8,192 tokens 10.49 GiB
estimated, 10.5 measured (with train.moments_dtype=bf16 8.68 estimated, 8.7 measured; 32,768 tokens 17.66 and
17.6), and LoRA rank 16 on it 4.16 estimated, 4.1 measured (32,768 tokens: 19.5 estimated,
19.6 measured before the loss held one chunk of logits at a time); the autocast step (`train.working_copy=false`)
is estimated ~15% low (its fp32 residual and the casts autocast keeps are counted only in part; not re-measured
since the fusions).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GiB = 1 << 30


@dataclass
class Estimate:
    weights: float  # bytes
    grads: float
    optimizer: float
    weight_copies: float  # low-precision weight copies the backward keeps (autocast casts, merged LoRA weights)
    activations: float
    lora: bool
    activations_full_checkpointing: float = 0.0  # what activations would be with parallel.activation_checkpointing=full

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.weight_copies + self.activations

    def table(self) -> str:
        parts = [("weights", self.weights), ("gradients", self.grads), ("optimizer state", self.optimizer),
                 ("weight copies", self.weight_copies), ("activations", self.activations)]
        body = ", ".join(f"{name} {b / GiB:.2f}" for name, b in parts)
        return f"expected peak memory {self.total / GiB:.2f} GiB ({body} GiB)"


def estimate(model_cfg, run_cfg, lora_spec=None, base_dtype: torch.dtype = torch.float32,
             autocast: bool = True, working_copy: bool = False, triton_experts: bool = False) -> Estimate:
    """Bytes for one optimizer step of `run_cfg` on `model_cfg`: AdamW's two moments on what trains (fp32; bf16
    with train.moments_dtype=bf16 and the working copy), gradients of what trains, the frozen base in `base_dtype`
    under LoRA. autocast: bf16 compute over fp32
    weights (a bf16 copy per matrix use, an fp32 residual stream); working_copy: `train.working_copy` (bf16 copies
    of the weights kept for the whole run, bf16 activations and gradients; train/precision.py); triton_experts:
    the routed experts run the Triton kernels (a GPU), which take LoRA's adapters themselves (no merged expert
    weights, no SwiGLU output kept)."""
    from anyseek.model.transformer import DeepSeekV3
    from anyseek.transforms import lora as lora_lib

    model = DeepSeekV3(model_cfg, device="meta")
    # autocast keeps a bf16 copy of every matrix a layer multiplies by; not of the embedding (a lookup) or the output
    # head (cast chunk by chunk inside the loss)
    heads = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in heads)
    low = 2 if autocast or working_copy else 4  # bytes of a weight copy / activation element
    resid = 2 if working_copy else 4  # the residual stream: fp32 when the weights it adds are fp32
    accumulate = run_cfg.train.grad_accum > 1
    grad_bytes = 4 if accumulate or not working_copy else 2  # the working copy's flat gradients: bf16 unless summed
    # AdamW's two moments: fp32, or bf16 with the working copy's optimizer (train.moments_dtype)
    moment_bytes = 4 if working_copy and run_cfg.train.moments_dtype == "bf16" else 8
    if lora_spec is None:
        n = model.num_parameters()
        weights, grads, optimizer = 4 * n, grad_bytes * n, moment_bytes * n
        copies = 2 * n if working_copy else (low * matrices if autocast else 0)
    else:
        lora_lib.apply_lora(model, lora_spec, base_dtype)
        size = torch.finfo(base_dtype).bits // 8
        # the frozen fp32 tensors (embedding, norms, router): held in bf16 alone under the working copy
        other = 2 if working_copy else 4
        base = sum(p.numel() * (size if p.dtype == base_dtype else other) for n, p in model.named_parameters()
                   if not lora_lib._is_adapter(n))
        a = lora_lib.count_adapters(model)
        weights, grads, optimizer = base + 4 * a, grad_bytes * a, moment_bytes * a
        copies = size * _merged_elements(model, triton_experts) + (2 * a if working_copy else 0)
    t = run_cfg.data.tokens_per_batch
    mode = getattr(getattr(run_cfg, "parallel", None), "activation_checkpointing", "none")
    head = _head_chunk_bytes(model_cfg, t, low)
    expert_act = not (lora_spec is not None and triton_experts)  # the LoRA Triton experts recompute it
    acts = t * _activation_bytes_per_token(model_cfg, low, mode, resid, expert_act) + head
    return Estimate(weights, grads, optimizer, copies, acts, lora_spec is not None,
                    t * _activation_bytes_per_token(model_cfg, low, "full", resid, expert_act) + head)


def _head_chunk_bytes(c, tokens: int, low: int) -> float:
    """The output head's loss works on [C, V] logits, chunk by chunk (`model.loss.chunk_rows` rows on GPUs):
    one fp32 chunk and its low-precision gradient are alive at the end of the forward, the activations' peak."""
    from anyseek.model.loss import chunk_rows

    rows = min(tokens, chunk_rows(c.vocab_size, "cuda", tokens))
    return float(rows * c.vocab_size * (4 + low))


def _merged_elements(model, triton_experts: bool) -> int:
    """Elements of the merged weights a LoRA forward forms and keeps for the backward: the routed experts' where
    they run on the effective weights (not the Triton kernels), counted twice (their backward also forms the full
    gradient of the merged weights)."""
    from anyseek.transforms.lora import LoRAExperts

    if triton_experts:
        return 0
    return sum(2 * (m.base.gate_up_proj.numel() + m.base.down_proj.numel()) for m in model.modules()
               if isinstance(m, LoRAExperts))


def _activation_bytes_per_token(c, low: int, checkpointing: str = "none", resid: int = 4,
                                expert_act: bool = True) -> float:
    """What autograd keeps per token, tensor by tensor as the model saves them (low: bytes of a computed
    activation; resid: of the residual stream). Per layer: the residual input of each norm and the normed x,
    MLA's q_a and its norm, the kv latent and its norm, the attention's q, k_nope|v (one buffer), k_pe, output and
    log-sum-exp; a dense MLP's [gate | up] and SwiGLU output; a MoE's K routed rows ([gate | up] and activation), its
    fp32 scores and the shared experts' [gate | up] and activation. The MTP modules add their embedding, two norms
    and the joined input. `checkpointing` (parallel.activation_checkpointing, the layers
    `anyseek.distributed.fsdp.apply_activation_checkpointing` picks): a recomputed layer keeps only its inputs, and
    one such layer's activations are alive again during its backward. expert_act: the routed rows' SwiGLU output
    is kept (not by LoRA's Triton experts, which recompute it from [gate | up]). Against peaks measured on an H100
    (docs/benchmarks.md): see the module docstring."""
    H, D, E = c.num_attention_heads, c.hidden_size, c.n_routed_experts
    Q, L, R = c.q_lora_rank or 0, c.kv_lora_rank, c.qk_rope_head_dim
    attn = (resid + low) * D + low * (2 * Q + 2 * L) + low * (H * c.qk_head_dim + H * (c.qk_nope_head_dim
                                                                                          + c.v_head_dim) + R
                                                              + H * c.v_head_dim) + 4 * H
    post = (resid + low) * D + 8
    dense = low * 3 * c.intermediate_size
    moe = 0
    if E:
        K, I = c.num_experts_per_tok, c.moe_intermediate_size
        moe = low * (3 if expert_act else 2) * I * K + 8 * K + 4 * E + low * 3 * I * c.n_shared_experts
    n_dense = min(c.first_k_dense_replace, c.num_hidden_layers) if E else c.num_hidden_layers
    # decoder layers, then the MTP modules (counted as MoE layers, with their own inputs)
    units = [attn + post + dense] * n_dense + [attn + post + moe] * (c.num_hidden_layers - n_dense)
    units += [attn + post + moe + (low + 2 * resid + 2 * low) * D] * c.num_nextn_predict_layers
    recomputed = [i for i in range(len(units)) if checkpointing == "full" or
                  (checkpointing == "selective" and i < c.num_hidden_layers and i % 2 == 0)]
    # a recomputed decoder layer keeps its inputs: h and the previous FFN output still to be added (`pending`)
    kept = sum((2 if 0 < i < c.num_hidden_layers else 1) * resid * D if i in recomputed else u
               for i, u in enumerate(units))
    heads = (1 + c.num_nextn_predict_layers) * (resid + low) * D  # final norms' inputs, the loss's saved grad_h
    return float(kept + max((units[i] for i in recomputed), default=0) + heads)


def available(device: torch.device) -> float | None:
    """Bytes the device has in all (GPU: its memory; CPU: physical RAM); None when unknown."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def advice(est: Estimate, run_cfg, have: float) -> list[str]:
    """Which knobs bring `est` under `have` bytes, most effective first."""
    tips = []
    if not est.lora and (est.grads + est.optimizer) > 0:
        tips.append(f"LoRA (--train.lora_rank=16 with --init) drops gradients and optimizer state of the base: "
                    f"about {(est.grads + est.optimizer + est.weights / 2) / GiB:.1f} GiB less")
    t = run_cfg.data.tokens_per_batch
    if est.activations > 0.1 * have and t > run_cfg.data.max_seqlen:
        half = max(t // 2, run_cfg.data.max_seqlen)
        tips.append(f"a smaller micro-batch (--data.tokens_per_batch={half} --train.grad_accum="
                    f"{run_cfg.train.grad_accum * 2}: same tokens per step) saves about "
                    f"{est.activations * (1 - half / t) / GiB:.1f} GiB of activations")
    saved = est.activations - est.activations_full_checkpointing
    if est.activations > 0.1 * have and saved > 0:
        tips.append(f"--parallel.activation_checkpointing=full (or selective: every other layer) recomputes layers in "
                    f"backward and keeps only their inputs: about {saved / GiB:.1f} GiB of activations less")
    return tips


def report(model_cfg, run_cfg, device: torch.device, lora_spec, base_dtype: torch.dtype, log=print) -> Estimate:
    """Print the estimate for a one-process run on `device` (its precision as the trainer decides it)."""
    from anyseek.train import precision

    low = precision.compute_dtype(run_cfg.train.dtype, device)
    working = precision.wanted(run_cfg.train.working_copy, device, False, low)
    est = estimate(model_cfg, run_cfg, lora_spec, base_dtype, low is not None, working, device.type == "cuda")
    have = available(device)
    where = f"of {have / GiB:.1f} GiB on {device}" if have else f"on {device}"
    log(f"memory: {est.table()} {where}")
    if have and est.total > 0.9 * have:
        log(f"warning: this run will likely not fit in {device}'s {have / GiB:.1f} GiB. Try:")
        for tip in advice(est, run_cfg, have):
            log(f"  - {tip}")
    return est
