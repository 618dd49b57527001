"""LoRA, applied to a built DeepSeekV3 from outside: the base frozen (bf16 on GPU), low-rank adapters trained.

    apply_lora(model, LoRASpec(rank=16, alpha=32, targets=("attention", "routed_experts")), base_dtype=torch.bfloat16)

A target Linear W [out, in] becomes `LoRALinear`: y = x W^T + s * B A x with A [r, in], B [out, r], s = alpha / r,
B = 0 at the start (the output equals the base's). Called as a layer, it goes through the seam
`kernels.low_rank_linear`, whose default (`torch`) backend applies the term one of two ways
(`kernels.torch_lowrank.merge_wanted`): with more rows than input features and no dropout, through the merged
weight W + s B A (`kernels.low_rank_merge`), formed for the forward matmul and again for dx in backward, never kept;
otherwise it runs the base matmul and adds s (x A^T) B^T into its output with one addmm, s as its alpha (backward
likewise: dx = g W + s (g B) A; dropout on the adapter input). Either way there is no [out, in] weight gradient: the
adapters' gradients are rank-r products.
Where the model joins two layers' weights itself (MLA's q_a|kv_a, an MLP's gate|up: `model.concat.fused_linear`),
the frozen base weights lie row after row in one buffer (`_join_frozen`, so the join is a view) and the adapters
join as one low-rank term (A's stacked: one narrow matmul reads x; each B added into its own layer's output
columns; the pair shares one dropout mask on its common input).
`LoRALinear.weight` still gives the merged W + s * B A for code that reads weights (decoding, export).

Routed experts get per-expert adapters, stacked; `LoRAExperts` hands them to the seam `kernels.lora_routed_experts`.
Its triton backend (`kernels/ops/moe.py`, where the Triton routed experts run) takes the adapters into the kernels:
each grouped GEMM reads the base weight and adds the rows' rank-r product (x A^T, or dh B in backward; made before
the GEMM or beside its own product in its loop over K) times the other adapter matrix in its epilogue; the adapters'
gradients come from rank-r products per expert (dB = s dh^T (x A^T), dA = s (dh B)^T x). No [E, F, D] weight or
gradient is formed, and the SwiGLU output is not kept for backward (recomputed from the saved pre-activations). Its
other backends (reference, grouped_mm: the same names as routed_experts', chosen together) run the routed experts
on the effective weights (one torch.baddbmm per projection, no Python loop over experts); there the backward forms
the full [E, F, D] gradient of the effective weights and two batched matmuls reduce it to dA, dB.

Code that reads the stacked weights itself (the decode paths of `anyseek.infer`, e.g. the sample the trainer
prints) gets the effective weights from `LoRAExperts.gate_up_proj` / `.down_proj`, as it gets `LoRALinear.weight`.

A 4-bit base (spec.base_bits = 4, `train.base_bits`): the targets' frozen weights are held as packed NF4 rows
(`kernels.quantize4`, uint8 [out, 17 in / 32]; `quantize_targets`, or the loader as it reads them:
`quantized_names`), the embedding in the base dtype. The wrappers and the seams take them as they are (the kernels
dequantize inside their GEMMs); `.weight`, `.gate_up_proj`, `.down_proj` and `merged()` dequantize, so code that
reads weights and `anyseek export` see dequant(W) + s B A.

Shape legend: E routed experts, D hidden, I expert intermediate, F = 2I, r rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from anyseek import kernels
from anyseek.model.concat import adjacent_weights, join_rows
from anyseek.model.moe import MLP, Experts, MoE, Router, addend
from anyseek.model.norm import RMSNorm

ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention", "dense_mlp", "shared_experts", "routed_experts")
    base_bits: int = 16  # 4: the targeted base weights held in 4 bits (NF4, `kernels.quantize4`); 16: as they are

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_train(cls, t) -> LoRASpec:
        return cls(t.lora_rank, t.lora_alpha, t.lora_dropout, tuple(t.lora_targets), getattr(t, "base_bits", 16))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "base_bits": self.base_bits}


class LoRALinear(nn.Module):
    """A frozen nn.Linear (`base`) plus a trained low-rank update: lora_A [r, in] (Kaiming-uniform as in PEFT),
    lora_B [out, r] (zeros)."""

    def __init__(self, base: nn.Linear, spec: LoRASpec, dense_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.base, self.scale, self.dense_dtype = base, spec.scale, dense_dtype
        self.in_features, self.out_features = base.in_features, base.out_features
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(spec.rank, base.in_features, device=dev, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, spec.rank, device=dev, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()

    @property
    def weight(self) -> torch.Tensor:
        """The merged weight W + s * B A [out, in], for code that reads the weight instead of calling the layer."""
        delta = self.lora_B @ self.lora_A
        w = _dense(self.base.weight, self.dense_dtype)
        return w + (self.scale * delta).to(w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        A, B, drop, scale = self.low_rank
        y = kernels.low_rank_linear(x, self.base.weight, A, B, None if drop is None else drop(x), scale)
        return y if self.base.bias is None else y + self.base.bias.to(y.dtype)

    @property
    def low_rank(self) -> tuple[torch.Tensor, torch.Tensor, nn.Module | None, float]:
        """(A [r, in], B [out, r], the dropout on the adapter input or None, the scale s): the term s (x A^T) B^T
        that `kernels.low_rank_linear` adds beside the base weight (s as its matmuls' alpha: no scaled
        copy of B), called as a layer or inside `fused_linear`."""
        drop = self.dropout if self.training and isinstance(self.dropout, nn.Dropout) else None
        return self.lora_A, self.lora_B, drop, self.scale

    @property
    def fused_weight(self) -> torch.Tensor:
        """The weight `model.concat.fused_linear` joins with its neighbour's: the base's (the adapter joins as
        `fused_low_rank`)."""
        return self.base.weight

    @property
    def fused_low_rank(self):
        """`low_rank`, for `fused_linear`."""
        return self.low_rank

    def merged(self) -> nn.Linear:
        """A plain nn.Linear holding W + s * B A, computed in fp32, in the base weight's dtype."""
        base = _dense(self.base.weight, self.dense_dtype)
        with torch.no_grad():
            w = base.float() + self.scale * (self.lora_B.float() @ self.lora_A.float())
        out = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        out.weight = nn.Parameter(w.to(base.dtype), requires_grad=False)
        return out

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


class LoRAExperts(nn.Module):
    """Frozen stacked routed experts (`base`: gate_up_proj [E, F, D], down_proj [E, D, I]) plus per-expert adapters
    gate_up_lora_A [E, r, D], gate_up_lora_B [E, F, r], down_lora_A [E, r, I], down_lora_B [E, D, r]."""

    def __init__(self, base: Experts, spec: LoRASpec, dense_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.base, self.scale, self.dense_dtype = base, spec.scale, dense_dtype
        E, F_, D = *base.gate_up_proj.shape[:2], base.down_proj.shape[1]  # (a 4-bit stack's last dim is packed)
        I = F_ // 2
        dev, r = base.gate_up_proj.device, spec.rank
        self.gate_up_lora_A = nn.Parameter(torch.empty(E, r, D, device=dev))
        self.gate_up_lora_B = nn.Parameter(torch.zeros(E, F_, r, device=dev))
        self.down_lora_A = nn.Parameter(torch.empty(E, r, I, device=dev))
        self.down_lora_B = nn.Parameter(torch.zeros(E, D, r, device=dev))
        for a in (self.gate_up_lora_A, self.down_lora_A):
            for e in range(E):  # setup only: the same init per expert as a LoRALinear of that expert
                nn.init.kaiming_uniform_(a.data[e], a=math.sqrt(5))

    @property
    def gate_up_proj(self) -> torch.Tensor:
        """The effective gate|up weights W + s * B A [E, F, D] (one batched matmul), for code that reads the stacked
        weights instead of calling the module (the decode paths in anyseek.infer), as `LoRALinear.weight` is."""
        w = _dense(self.base.gate_up_proj, self.dense_dtype)
        return torch.baddbmm(w, self.gate_up_lora_B.to(w.dtype), self.gate_up_lora_A.to(w.dtype), alpha=self.scale)

    @property
    def down_proj(self) -> torch.Tensor:
        """The effective down weights W + s * B A [E, D, I]."""
        w = _dense(self.base.down_proj, self.dense_dtype)
        return torch.baddbmm(w, self.down_lora_B.to(w.dtype), self.down_lora_A.to(w.dtype), alpha=self.scale)

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                add_TD=None) -> torch.Tensor:  # fmt: skip
        return kernels.lora_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, self.base.gate_up_proj,
                                           self.base.down_proj, self.gate_up_lora_A, self.gate_up_lora_B,
                                           self.down_lora_A, self.down_lora_B, self.scale, addend(add_TD))  # fmt: skip

    def merged(self) -> Experts:
        with torch.no_grad():
            w_gu, w_d = (_dense(w, self.dense_dtype) for w in (self.base.gate_up_proj, self.base.down_proj))
            gu = torch.baddbmm(w_gu.float(), self.gate_up_lora_B.float(), self.gate_up_lora_A.float(), alpha=self.scale)
            d = torch.baddbmm(w_d.float(), self.down_lora_B.float(), self.down_lora_A.float(), alpha=self.scale)
        out = self.base
        out.gate_up_proj = nn.Parameter(gu.to(w_gu.dtype), requires_grad=False)
        out.down_proj = nn.Parameter(d.to(w_d.dtype), requires_grad=False)
        return out


# ---------------------------------------------------------------- applying, listing, merging


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[str, nn.Module, str]]:
    """(owner module name, owner, attribute) for every layer the targets cover, MTP modules' layers included."""
    for name, mod in model.named_modules():
        if "attention" in targets and name.endswith("self_attn"):
            for attr in ATTENTION:
                if isinstance(getattr(mod, attr, None), nn.Linear):
                    yield name, mod, attr
        elif isinstance(mod, MLP):
            kind = "shared_experts" if name.endswith("shared_experts") else "dense_mlp"
            if kind in targets:
                for attr in MLP_PROJ:
                    yield name, mod, attr
        elif isinstance(mod, MoE) and "routed_experts" in targets:
            yield name, mod, "experts"


def apply_lora(model: nn.Module, spec: LoRASpec, base_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Freeze every base parameter, hold the matrices in `base_dtype` (the embedding, norms and 1-D tensors stay
    fp32 so the residual stream is as in full fine-tuning; the router stays fp32 so that the experts chosen are the
    base's), and wrap the targets. With spec.base_bits == 4 the targets' base weights are held in 4 bits instead
    (`quantize_targets`; the embedding then in `base_dtype` too, as the output head is).
    Adapters are fp32 parameters (the optimizer's only ones). Returns `model`, changed in place."""
    if spec.rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {spec.rank}")
    if spec.base_bits not in (4, 16):
        raise ValueError(f"LoRA base_bits must be 4 or 16, got {spec.base_bits}")
    fp32_kinds = (RMSNorm, Router) if spec.base_bits == 4 else (RMSNorm, nn.Embedding, Router)
    keep_fp32 = {id(m.weight) for m in model.modules() if isinstance(m, fp32_kinds)}
    found = list(target_modules(model, spec.targets))
    if not found:
        raise ValueError(f"train.lora_targets {list(spec.targets)} match no layer of this model")
    for p in model.parameters():
        p.requires_grad_(False)
    if spec.base_bits == 4:
        quantize_targets(found)
    for p in model.parameters():
        want = torch.float32 if id(p) in keep_fp32 or p.dim() < 2 else base_dtype
        if p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)
    _join_frozen(model)
    for _, owner, attr in found:
        base = getattr(owner, attr)
        wrap = LoRAExperts if isinstance(base, Experts) else LoRALinear
        setattr(owner, attr, wrap(base, spec, base_dtype))
    return model


def quantize_targets(found: list[tuple[str, nn.Module, str]]) -> None:
    """Hold the base weights of the targets (`target_modules`' rows) in 4 bits, in place: each frozen weight's data
    becomes its packed NF4 rows (`kernels.quantize4`, uint8 [out, 17 in / 32], one tensor at a time; a weight
    already packed, e.g. quantized while it was read from disk, stays as it is). The seams take them as they are."""
    for name, owner, attr in found:
        mod = getattr(owner, attr)
        weights = [mod.gate_up_proj, mod.down_proj] if isinstance(mod, Experts) else [mod.weight]
        for w in weights:
            if w.dtype == torch.uint8:
                continue
            try:
                w.data = kernels.quantize4(w.data)
            except ValueError as e:
                raise ValueError(f"train.base_bits = 4: {name}.{attr}: {e}") from None


def quantized_names(model: nn.Module, spec: LoRASpec) -> list[str]:
    """The full names of the parameters `quantize_targets` holds in 4 bits for `spec` (for a loader that quantizes
    them as it reads them: `anyseek.hf.load_pretrained(quantize4=)`)."""
    names = []
    for name, owner, attr in target_modules(model, spec.targets):
        leaves = ("gate_up_proj", "down_proj") if isinstance(getattr(owner, attr), Experts) else ("weight",)
        names += [f"{name}.{attr}.{leaf}" for leaf in leaves]
    return names


def _dense(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A frozen base weight as a dense tensor: dequantized to `dtype` where it is held in 4 bits, else itself."""
    return kernels.dequantize4(w, dtype) if w.dtype == torch.uint8 else w


def _join_frozen(model: nn.Module) -> None:
    """Lay out each weight group the model joins (`model.concat.adjacent_weights`: q_a|kv_a, gate|up) row after
    row in one buffer, so that `cat_rows` reads the frozen base weights as a view instead of copying them at every
    forward (the working copy does this for trained weights; frozen ones are not in it)."""
    join_rows(adjacent_weights(model))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters by full parameter name (`...q_b_proj.lora_A`, `...experts.gate_up_lora_B`)."""
    return {n: p.detach() for n, p in model.named_parameters() if _is_adapter(n)}


def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapters into a model `apply_lora` prepared with the same spec; names and shapes must match exactly."""
    params = {n: p for n, p in model.named_parameters() if _is_adapter(n)}
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    bad = [n for n in params if n in tensors and tensors[n].shape != params[n].shape]
    if missing or unexpected or bad:
        raise ValueError(f"adapters do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                         f"mis-shaped {bad[:5]} (same lora_rank and lora_targets as the run that saved them?)")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every adapter wrapper by a plain layer holding W + s * B A (fp32 maths, the base's dtype): the
    result is an ordinary DeepSeekV3 that `save_pretrained` writes. In place; returns `model`."""
    for name, mod in list(model.named_modules()):
        for attr, child in list(mod.named_children()):
            if isinstance(child, (LoRALinear, LoRAExperts)):
                setattr(mod, attr, child.merged())
    return model


def count_adapters(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if _is_adapter(n))


def _is_adapter(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith(("lora_", "gate_up_lora_", "down_lora_"))


class LoRA:
    """The LoRA transform (`anyseek.transforms.Transform`): `apply` freezes the base in `base_dtype` and wraps the
    spec's targets; `revert` merges the adapters into plain layers (export); the adapters are what a checkpoint keeps
    (`anyseek.checkpoint.adapters`)."""

    name = "lora"

    def __init__(self, spec: LoRASpec, base_dtype: torch.dtype = torch.float32):
        self.spec, self.base_dtype = spec, base_dtype

    def apply(self, model: nn.Module) -> nn.Module:
        return apply_lora(model, self.spec, self.base_dtype)

    def revert(self, model: nn.Module) -> nn.Module:
        return merge_lora(model)

    def describe(self, model: nn.Module) -> str:
        s = self.spec
        held = f"{self.base_dtype}" if s.base_bits == 16 else f"4 bits (NF4) for the targets, {self.base_dtype} else"
        return (f"lora: rank {s.rank}, alpha {s.alpha:g}, targets {', '.join(s.targets)}: "
                f"{count_adapters(model) / 1e6:.2f}M adapter parameters trained, base frozen in {held}")
