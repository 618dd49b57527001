"""FP8 training, DeepSeek-V3's recipe (arXiv 2412.19437 §3.3), applied to a built DeepSeekV3 from outside:

    model = FP8().apply(model)     # train.precision = "fp8"
    ...train...
    model = FP8().revert(model)    # plain nn.Linear / Experts again, the same weights (export as usual)

The attention projections (q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), the dense MLPs and
the shared experts (gate_proj, up_proj, down_proj) become `FP8Linear`: an nn.Linear holding the same weight
Parameter under the same name, whose matmul is the seam `kernels.fp8_linear` (E4M3 in 1x128 activation tiles and
128x128 weight blocks, scales from the current tensors, fp32 promotion every 128 products; Fprop, Dgrad and Wgrad
in FP8). Where the model joins two layers into one matmul (q_a|kv_a, gate|up: `model.concat.fused_linear`), the
joined weight goes through `kernels.fp8_linear` as one (its 128x128 blocks cross the boundary between the two
layers only where a layer's rows are not a multiple of 128). The routed experts become `FP8Experts` (the same
stacked Parameters) through `kernels.fp8_routed_experts` (grouped FP8 GEMMs with the routing's gather and
scatter, the weighted SwiGLU between them in fp32).

What stays in train.dtype (bf16 on a GPU): the embedding, the output head, the router, the norms and attention
itself. Under expert parallelism the routed experts stay FP8 and their rows travel in FP8 (power-of-two 1x128
scales; outputs and gradients in bf16: distributed/expert_parallel.py). The weights stay fp32 masters (or the trainer's bf16
working copy of them), quantized afresh at every forward: checkpoints and export do not change.

FP8 needs E4M3 tensor cores (compute capability 8.9+). Elsewhere an explicit request raises, unless the FP8 ops'
backend asked for is the PyTorch emulation (`ANYSEEK_FP8=reference`, `kernels.set_backend("fp8", "reference")`):
the same quantization, slowly, on any device (for tests).
"""

from __future__ import annotations

import torch
from torch import nn

from anyseek import kernels
from anyseek.kernels import registry
from anyseek.model.moe import Experts, addend
from anyseek.transforms.lora import target_modules

TARGETS = ("attention", "dense_mlp", "shared_experts", "routed_experts")


class FP8Linear(nn.Linear):
    """An nn.Linear (same weight Parameter, same name) whose matmul runs `kernels.fp8_linear`."""

    fused_matmul = staticmethod(kernels.fp8_linear)  # what `fused_linear` runs on joined weights

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> FP8Linear:
        out = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        out.weight, out.bias = layer.weight, layer.bias
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.fp8_linear(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def plain(self) -> nn.Linear:
        """An nn.Linear holding the same weight (and bias)."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        out.weight, out.bias = self.weight, self.bias
        return out


class FP8Experts(Experts):
    """The routed experts (same stacked Parameters, same names) through `kernels.fp8_routed_experts`. `fp8`: expert
    parallelism, which replaces this module, keeps them in FP8 and sends their rows in FP8."""

    fp8 = True

    @classmethod
    def from_experts(cls, experts: Experts) -> FP8Experts:
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.gate_up_proj, out.down_proj = experts.gate_up_proj, experts.down_proj
        return out

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                add_TD=None) -> torch.Tensor:  # fmt: skip
        return kernels.fp8_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, self.gate_up_proj, self.down_proj,
                                          addend(add_TD))  # fmt: skip

    def plain(self) -> Experts:
        out = Experts.__new__(Experts)
        nn.Module.__init__(out)
        out.gate_up_proj, out.down_proj = self.gate_up_proj, self.down_proj
        return out


def unavailable(device: torch.device) -> str | None:
    """Why FP8 training cannot run on `device` (None: it can). The emulation runs anywhere when asked for."""
    if registry.requested("fp8_linear")[0] == "reference":
        return None
    how = "ANYSEEK_FP8=reference runs the PyTorch emulation of the recipe instead (slow; for tests)"
    if device.type != "cuda":
        return f"train.precision=fp8 needs a CUDA GPU with FP8 tensor cores; this run is on {device.type} ({how})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"train.precision=fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor} ({how})")
    return None


def apply_fp8(model: nn.Module) -> nn.Module:
    """Convert the recipe's layers (`TARGETS`) to `FP8Linear`, in place; returns `model`. Raises RuntimeError where
    FP8 cannot run on the model's device (`unavailable`)."""
    device = next(model.parameters()).device
    why = unavailable(device)
    if why:
        raise RuntimeError(why)
    found = [(owner, attr) for _, owner, attr in target_modules(model, TARGETS)]
    if not found:
        raise ValueError("train.precision=fp8: the model has no attention or MLP linear layers to convert")
    for owner, attr in found:
        layer = getattr(owner, attr)
        if type(layer) is nn.Linear:
            setattr(owner, attr, FP8Linear.from_linear(layer))
        elif type(layer) is Experts:
            setattr(owner, attr, FP8Experts.from_experts(layer))
    return model


def revert_fp8(model: nn.Module) -> nn.Module:
    """Every `FP8Linear` / `FP8Experts` back to a plain nn.Linear / Experts holding the same weights, in place;
    returns `model`."""
    for mod in list(model.modules()):
        for attr, child in list(mod.named_children()):
            if isinstance(child, (FP8Linear, FP8Experts)):
                setattr(mod, attr, child.plain())
    return model


def count_fp8(model: nn.Module) -> tuple[int, int]:
    """(FP8 linear layers, FP8 routed-expert stacks)."""
    mods = list(model.modules())
    return sum(isinstance(m, FP8Linear) for m in mods), sum(isinstance(m, FP8Experts) for m in mods)


class FP8:
    """The FP8 transform (`anyseek.transforms.Transform`): `apply` converts the recipe's layers, `revert` gives the
    plain model back; checkpoints keep the weights as they are (fp32 masters)."""

    name = "fp8"

    def apply(self, model: nn.Module) -> nn.Module:
        return apply_fp8(model)

    def revert(self, model: nn.Module) -> nn.Module:
        return revert_fp8(model)

    def describe(self, model: nn.Module) -> str:
        example = next(model.parameters()).new_empty(1, 128)
        linears, experts = count_fp8(model)
        _, backend, why = registry.choose("fp8_linear", example)
        _, backend_e, _ = registry.choose("fp8_routed_experts", example)
        return (f"fp8: {linears} linear layers (attention projections, dense MLPs, shared experts) and {experts} "
                f"routed-expert stacks in DeepSeek-V3's FP8 recipe (backends {backend} / {backend_e}: {why}); "
                "embedding, head, router, norms and attention as before")
