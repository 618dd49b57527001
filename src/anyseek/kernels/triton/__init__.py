"""Triton backends. Where an op's kernels are `torch.library` custom ops (attention, the routed experts), the files
here hold only the `@triton.jit` kernels and their launchers (plain tensors in and out) and the glue (custom ops,
fake implementations, autograd Functions, the public function the registry loads) lives in `kernels/ops/`;
otherwise one file per op holds kernels, launcher and its autograd Function together. docs/kernels.md, "Where glue
lives". Importing anything here imports Triton: the registry does so only when a triton backend is chosen.
"""
