"""The Triton kernels as PyTorch ops: the glue between `kernels/triton/` (kernels and their launchers, plain tensors
in and out) and the registry.

Per family of kernels, one module holds the `torch.library.custom_op`s (with fake implementations, so that
torch.compile traces them without running them), the autograd Functions around them and the public functions the
registry loads as the `triton` backend: `attention.py` (mla_attention, varlen_attention). Importing a module here
imports Triton; the registry imports it only when the triton backend is chosen. (The rule, for every op:
docs/kernels.md, "Where glue lives".)
"""
