"""The Triton kernels as PyTorch ops: the glue between `kernels/triton/` (kernels and their launchers, plain tensors
in and out) and the registry, for the ops whose kernels are `torch.library` custom ops.

Per family of kernels, one module holds the custom ops (with fake implementations, so that torch.compile traces
them without running them), the autograd Functions around them and the public functions the registry loads as the
`triton` backend: `attention.py` (mla_attention, varlen_attention), `moe.py` (routed_experts, lora_routed_experts), `fp8.py` (fp8_linear).
Importing a module here imports Triton; the registry imports it only when the triton backend is chosen. The rule
for every op: docs/kernels.md, "Where glue lives".
"""
