"""Triton attention kernels: on CPU under TRITON_INTERPRET=1 (in a subprocess, so the variable never leaks
into other tests that import triton), and on a GPU (marked cuda).

The rule (flash-attention's): max|kernel - fp32 ref| <= 2 * max|PyTorch in the low precision - fp32 ref| (+ a
small atol for fp32), for the output and every gradient.
"""

import interpreter
import pytest
import torch

# (name, op, lengths, H, dims, dtype, causal): small shapes, the interpreter runs numpy per tile
INTERP_CASES = [
    ("mla_fp16_odd_lengths", "mla_attention", [1, 5, 17, 40, 3, 33], 3, (32, 16, 24), "float16", True),
    ("mla_fp32_noncausal", "mla_attention", [1, 9, 31, 2], 2, (32, 16, 32), "float32", False),
    ("mla_many_short_docs", "mla_attention", [1, 2, 3] * 60, 1, (16, 16, 16), "float16", True),
    ("mla_one_long_doc", "mla_attention", [161], 2, (16, 16, 16), "float16", True),
    ("mla_128_heads", "mla_attention", [9, 12], 128, (16, 16, 16), "float16", True),
    ("varlen_fp16_40_24", "varlen_attention", [1, 19, 30], 2, (40, 24), "float16", True),
    ("varlen_fp32_64_noncausal", "varlen_attention", [7, 25], 2, (64, 64), "float32", False),
]
# (name, op, lengths, H, dims, dtype, causal, softmax_scale): every case above runs the default scale 1/sqrt(q dim);
# YaRN configs (the 671B flavor) pass another (mscale^2 / sqrt(q dim)). Scales ~2x and ~1/3 of the default: a
# kernel (forward or either backward pass) that ignores the argument is off by far more than fp16 rounding
SCALED_CASES = [
    ("mla_fp32_scale_0.3", "mla_attention", [1, 9, 22], 2, (32, 16, 32), "float32", True, 0.3),
    ("mla_fp16_scale_0.05", "mla_attention", [5, 17, 2], 3, (32, 16, 24), "float16", True, 0.05),
    ("varlen_fp16_scale_0.4_noncausal", "varlen_attention", [7, 13], 2, (40, 24), "float16", False, 0.4),
]


def _worker() -> None:
    """Runs in the subprocess: every case, then torch.compile over the custom ops; prints one JSON line."""
    from anyseek.kernels import accuracy
    from anyseek.kernels.ops import attention as ops

    results = {}
    for name, op, lengths, H, dims, dtype, causal in INTERP_CASES:
        dt = getattr(torch, dtype)
        table = accuracy.error_table(getattr(ops, op), op, lengths, H, dims, dt, "cpu", causal, scale=None, seed=1)
        results[name] = {"pass": accuracy.passes(table, dt), "table": table}
    for name, op, lengths, H, dims, dtype, causal, scale in SCALED_CASES:
        dt = getattr(torch, dtype)
        table = accuracy.error_table(getattr(ops, op), op, lengths, H, dims, dt, "cpu", causal, scale=scale, seed=2)
        results[name] = {"pass": accuracy.passes(table, dt), "table": table}
    # the 64-bit indexing path (taken on batches past 2**31 elements), forced on a small case
    from anyseek.kernels.triton import attention

    big, attention._big = attention._big, lambda *a: True
    table = accuracy.error_table(ops.mla_attention, "mla_attention", [3, 20, 1], 2, (16, 16, 16), torch.float16, "cpu")
    results["int64_path"] = {"pass": accuracy.passes(table, torch.float16), "table": table}
    attention._big = big
    # torch.compile traces the custom ops through their fake implementations (aot_eager: no C++ compiler)
    cu = torch.tensor([0, 3, 20], dtype=torch.int32)
    x = [torch.randn(20, 2, 48), torch.randn(20, 2, 32), torch.randn(20, 16), torch.randn(20, 2, 32)]
    x = [t.requires_grad_() for t in x]
    fn = torch.compile(lambda *a: ops.mla_attention(*a, cu, 17).square().sum(), backend="aot_eager", fullgraph=True)
    fn(*x).backward()
    eager = [t.grad.clone() for t in x]
    for t in x:
        t.grad = None
    ops.mla_attention(*x, cu, 17).square().sum().backward()
    results["compile"] = {"pass": all(torch.allclose(a, t.grad, atol=1e-5) for a, t in zip(eager, x)), "table": []}
    # MLA splits k_nope and v off one projection: the backward hands their gradients over as one buffer (no cat)
    from anyseek.model import concat

    seen, joined = [], concat.joined_view
    concat.joined_view = lambda parts, dim: seen.append(joined(parts, dim)) or seen[-1]
    kv = torch.randn(20, 2, 64, requires_grad=True)
    q, kpe, g = torch.randn(20, 2, 48), torch.randn(20, 16), torch.randn(20, 2, 32)
    k_nope, v = concat.split_last(kv, [32, 32])
    ops.mla_attention(q, k_nope, kpe, v, cu, 17).backward(g)
    concat.joined_view = joined
    ref = kv.detach().clone().requires_grad_()
    k2, v2 = ref.split([32, 32], dim=-1)
    ops.mla_attention(q, k2, kpe, v2, cu, 17).backward(g)
    results["joint_kv_grad"] = {"pass": len(seen) == 1 and seen[0] is not None and torch.equal(kv.grad, ref.grad),
                                "table": []}
    # the registry hands out the triton backend on CPU when asked explicitly under the interpreter
    from anyseek.kernels import registry

    registry.set_backend("attention", "triton")
    results["registry"] = {"pass": registry.choose("mla_attention", x[0])[1] == "triton", "table": []}
    interpreter.report(results)


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [c[0] for c in INTERP_CASES + SCALED_CASES] + ["int64_path", "compile", "joint_kv_grad", "registry"]
)
def test_interpreter(interp_results, name):
    interpreter.check(interp_results, name, "(grad, err, err_pt)")


# ---------------------------------------------------------------------------------------------------- GPU


def _gpu_lengths(kind: str) -> list[int]:
    g = torch.Generator().manual_seed(0)
    if kind == "random":
        return [1] + torch.randint(1, 700, (12,), generator=g).tolist() + [1, 129]
    if kind == "thousand_short":
        return torch.randint(1, 9, (1000,), generator=g).tolist()
    return [4001]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["random", "thousand_short", "long"])
@pytest.mark.parametrize("H", [1, 16, 128])
def test_gpu_mla(kind, H, dtype):
    from anyseek.kernels import accuracy
    from anyseek.kernels.ops import attention as ops

    lengths = _gpu_lengths(kind)
    if H == 128 and kind == "long":
        lengths = [1500]  # the fp32 reference materialises H x L x L scores
    table = accuracy.error_table(ops.mla_attention, "mla_attention", lengths, H, (128, 64, 128), dtype, "cuda")
    assert accuracy.passes(table, dtype), table


@pytest.mark.cuda
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (96, 80)])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen(dims, causal):
    from anyseek.kernels import accuracy
    from anyseek.kernels.ops import attention as ops

    table = accuracy.error_table(
        ops.varlen_attention, "varlen_attention", _gpu_lengths("random"), 4, dims, torch.bfloat16, "cuda", causal
    )
    assert accuracy.passes(table, torch.bfloat16), table


@pytest.mark.cuda
def test_gpu_offsets_past_2_31():
    from anyseek.kernels import accuracy
    from anyseek.kernels.ops import attention as ops

    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip("needs ~40 GiB of free GPU memory")
    table = accuracy.tail_document_table(ops.mla_attention, 90_000, 128, 1000, torch.bfloat16, "cuda")
    assert accuracy.passes(table, torch.bfloat16), table


if __name__ == "__main__":
    _worker()
