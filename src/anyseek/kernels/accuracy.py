"""Correctness yardstick shared by the tests, `anyseek doctor --check` and the benchmark.

For one backend function and one case: the fp32 reference (`reference.attention`), the same computation
done by PyTorch in the low precision (the reference with compute_dtype=dtype), and the backend in the low
precision. For the output and every gradient: err = max|backend - ref|, err_pt = max|pt - ref|; the backend
passes when err <= 2 * err_pt + atol (atol covers fp32, where err_pt is ~0). The same rule serves the routed
experts (`moe_error_table`, against `reference.moe`) and decoding (`decode_error_table`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from anyseek.kernels import reference

ATOL = {torch.float32: 2e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def cu_from_lengths(lengths: list[int], device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_inputs(op: str, T: int, H: int, dims: tuple[int, ...], device, seed: int = 0) -> list[torch.Tensor]:
    """fp32 inputs: mla dims (N, R, V) -> q, k_nope, k_pe, v; varlen dims (D, V) -> q, k, v."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if op == "mla_attention":
        N, R, V = dims
        shapes = [(T, H, N + R), (T, H, N), (T, R), (T, H, V)]
    else:
        D, V = dims
        shapes = [(T, H, D), (T, H, D), (T, H, V)]
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def _run(fn: Callable, op: str, inputs, dtype, cu, max_len, scale, causal, dout, **kw):
    xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    out = fn(*xs, cu, max_len, scale, causal, **kw)
    grads = torch.autograd.grad(out, xs, dout.to(out.dtype))
    return [out.float()] + [g.float() for g in grads]


def error_table(
    fn: Callable,
    op: str,
    lengths: list[int],
    H: int,
    dims: tuple[int, ...],
    dtype: torch.dtype,
    device,
    causal: bool = True,
    scale: float | None = None,
    seed: int = 0,
) -> list[tuple[str, float, float]]:
    """[(name, err, err_pt)] for out and each gradient (dq, dk_nope, dk_pe, dv / dq, dk, dv)."""
    cu = cu_from_lengths(lengths, device)
    inputs = make_inputs(op, sum(lengths), H, dims, device, seed)
    ref_fn = getattr(reference, op)
    dout = torch.randn(sum(lengths), H, dims[-1], generator=torch.Generator().manual_seed(seed + 1)).to(device)
    max_len = max(lengths)
    ref = _run(ref_fn, op, inputs, torch.float32, cu, max_len, scale, causal, dout)
    pt = _run(ref_fn, op, inputs, dtype, cu, max_len, scale, causal, dout, compute_dtype=dtype)
    got = _run(fn, op, inputs, dtype, cu, max_len, scale, causal, dout)
    names = ["out", "dq", "dk_nope", "dk_pe", "dv"] if op == "mla_attention" else ["out", "dq", "dk", "dv"]
    return [(n, (a - r).abs().max().item(), (b - r).abs().max().item()) for n, a, b, r in zip(names, got, pt, ref)]


def passes(table: list[tuple[str, float, float]], dtype: torch.dtype) -> bool:
    return all(math.isfinite(err) and err <= 2 * err_pt + ATOL[dtype] for _, err, err_pt in table)


def worst_ratio(table: list[tuple[str, float, float]]) -> float:
    """max err / err_pt; a pair whose err_pt is 0 (fp32 against itself) counts 0 when err is 0, else 1."""
    return max(err / err_pt if err_pt > 0 else float(err > 0) for _, err, err_pt in table)


def _cases(device: torch.device):
    """Small cases for `doctor --check`: odd lengths, a length-1 document, both masks, DeepSeek-like dims."""
    lengths = [1, 7, 33, 64, 2, 50] if device.type == "cpu" else [1, 17, 130, 257, 3, 64, 1000]
    yield "mla_attention", lengths, 4, (64, 32, 64), True
    yield "mla_attention", lengths, 2, (128, 64, 128), False
    yield "varlen_attention", lengths, 3, (96, 64), True
    yield "varlen_attention", lengths, 2, (64, 64), False


def check_all(device: str | torch.device | None = None) -> list[dict]:
    """Every available attention backend (bar the reference) against the reference: rows with pass/fail."""
    from anyseek.kernels import registry

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = [torch.bfloat16, torch.float16] if device.type == "cuda" else [torch.float32, torch.float16]
    rows = []
    for op, lengths, H, dims, causal in _cases(device):
        for b in registry.backends(op):
            if b.name == "reference":
                continue
            for dtype in dtypes:
                what = f"{op:16s} {b.name:7s} {str(dtype)[6:]:8s} H={H} dims={dims} causal={causal}"
                ok, reason = b.available(torch.empty(1, H, sum(dims[:-1]) if op == "mla_attention" else dims[0],
                                                     device=device, dtype=dtype))  # fmt: skip
                if not ok:
                    rows.append(dict(what=what, detail=f"skipped: {reason}", skipped=True, **{"pass": True}))
                    continue
                try:
                    table = error_table(b.load(), op, lengths, H, dims, dtype, device, causal)
                except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                    rows.append(dict(what=what, detail=f"{type(e).__name__}: {e}", **{"pass": False}))
                    continue
                detail = " ".join(f"{n} {e:.1e}/{p:.1e}" for n, e, p in table)
                rows.append(dict(what=what, detail=f"worst ratio {worst_ratio(table):.2f}  {detail}" if dtype != torch.float32 else detail,
                                 **{"pass": passes(table, dtype)}))  # fmt: skip
    return rows


def tail_document_table(
    fn: Callable, T: int, H: int, last: int, dtype: torch.dtype, device, dims: tuple[int, int, int] = (128, 64, 128)
) -> list[tuple[str, float, float]]:
    """Like error_table for MLA on a batch of T tokens whose last document (of `last` tokens) starts past 2**31
    elements of q when T*H*(N+R) is large: checks 64-bit offsets without an fp32 reference over the whole batch.
    Only the last document gets an output gradient; its slice is compared with the reference on that slice."""
    N, R, V = dims
    g = torch.Generator(device="cpu").manual_seed(3)
    cu = torch.tensor([0, T - last, T], dtype=torch.int32, device=device)
    xs = [torch.randn(s, generator=g).to(device, dtype) for s in ((T, H, N + R), (T, H, N), (T, R), (T, H, V))]
    xs = [x.requires_grad_() for x in xs]
    out = fn(*xs, cu, T - last, None, True)
    dout = torch.zeros_like(out)
    dout[T - last :] = torch.randn(last, H, V, generator=g).to(device, dtype)
    grads = torch.autograd.grad(out, xs, dout)
    got = [out[T - last :].float()] + [gr[T - last :].float() for gr in grads]
    tail = [x.detach()[T - last :] for x in xs]
    cu_tail = torch.tensor([0, last], dtype=torch.int32, device=device)
    ref = _run(
        reference.mla_attention, "mla_attention", tail, torch.float32, cu_tail, last, None, True, dout[T - last :]
    )
    pt = _run(reference.mla_attention, "mla_attention", tail, dtype, cu_tail, last, None, True, dout[T - last :],
              compute_dtype=dtype)  # fmt: skip
    names = ["out", "dq", "dk_nope", "dk_pe", "dv"]
    return [(n, (a - r).abs().max().item(), (b - r).abs().max().item()) for n, a, b, r in zip(names, got, pt, ref)]


def decode_inputs(kv_lens: list[int], H: int, L: int, R: int, page: int, device, dtype, seed: int = 0):
    """Inputs of `mla_decode` for rows of the given lengths: a cache whose pages are handed out in shuffled order
    (so tables are not contiguous), block tables [T, M] padded with page 0, random q."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in kv_lens]
    M, N = max(pages), sum(pages) + 1
    perm = (torch.randperm(N - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(kv_lens), M, dtype=torch.int32)
    for t, n in enumerate(pages):
        table[t, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    cache = torch.randn(N, page, L + R, generator=g).to(device, dtype)
    q = torch.randn(len(kv_lens), H, L + R, generator=g).to(device, dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    return q, cache, table.to(device), lens


def decode_error_table(fn: Callable, kv_lens: list[int], H: int, L: int, R: int, dtype: torch.dtype, device,
                       page: int = 64, seed: int = 0, **kw) -> list[tuple[str, float, float]]:  # fmt: skip
    """[("out", max|fn - fp32 ref|, max|PyTorch in dtype - fp32 ref|)] for an `mla_decode` implementation. `fn` sees
    NaN in every cache slot no row owns (past each row's length in its last page, and the padding page 0): a kernel
    that reads a whole tile must still give those slots no weight and no NaN."""
    from anyseek.kernels.reference.decode import mla_decode as ref_fn

    q, cache, table, lens = decode_inputs(kv_lens, H, L, R, page, device, dtype, seed)
    ref = ref_fn(q.float(), cache.float(), table, lens, L)
    pt = ref_fn(q, cache, table, lens, L, compute_dtype=dtype).float()
    poisoned = cache.clone()
    poisoned[0] = float("nan")
    for t, n in enumerate(kv_lens):
        poisoned[int(table[t, (n - 1) // page]), (n - 1) % page + 1 :] = float("nan")
    got = fn(q, poisoned, table, lens, L, **kw).float()
    return [("out", (got - ref).abs().max().item(), (pt - ref).abs().max().item())]


# ----------------------------------------------------------------------------------------------------------------
# routed experts


def moe_routing(T: int, E: int, K: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """topk_ids [T, K] (int64, K distinct experts per token) for a routing pattern:
    balanced (uniform), skewed (expert e drawn with probability ~ 1/(e+1); the hottest gets several times the
    mean), sparse (only a third of the experts receive tokens), one_expert (K = 1, every token on expert E//2)."""
    if kind == "one_expert":
        return torch.full((T, 1), E // 2, dtype=torch.long)
    p_E = torch.ones(E)
    if kind == "skewed":
        p_E = 1.0 / torch.arange(1, E + 1, dtype=torch.float32)
        p_E = p_E[torch.randperm(E, generator=generator)]
    elif kind == "sparse":
        p_E = torch.zeros(E)
        p_E[torch.randperm(E, generator=generator)[: max(K, E // 3)]] = 1.0
    elif kind != "balanced":
        raise ValueError(f"unknown routing {kind!r}")
    if T == 0:
        return torch.zeros(0, K, dtype=torch.long)
    return torch.multinomial(p_E.expand(T, E), K, replacement=False, generator=generator)


def moe_inputs(T: int, D: int, I: int, E: int, K: int, kind: str, seed: int = 0) -> list[torch.Tensor]:
    """fp32 CPU tensors x [T, D], topk_ids [T, K], topk_weights [T, K], gate_up [E, 2I, D], down [E, D, I], dy."""
    g = torch.Generator().manual_seed(seed)
    ids = moe_routing(T, E, K, kind, g)
    K = ids.shape[1]
    x = torch.randn(T, D, generator=g)
    w = torch.rand(T, K, generator=g) + 0.1
    gu = torch.randn(E, 2 * I, D, generator=g) / D**0.5
    dn = torch.randn(E, D, I, generator=g) / I**0.5
    return [x, ids, w, gu, dn, torch.randn(T, D, generator=g)]


def _run_moe(fn: Callable, inputs, dtype, device) -> list[torch.Tensor]:
    x, ids, w, gu, dn, dy = (t.to(device) for t in inputs)
    xs = [x.to(dtype), w, gu.to(dtype), dn.to(dtype)]  # routing weights stay fp32, as the router gives them
    xs = [t.detach().requires_grad_() for t in xs]
    y = fn(xs[0], ids, xs[1], xs[2], xs[3])
    if y.requires_grad:
        grads = torch.autograd.grad(y, xs, dy.to(y.dtype), allow_unused=True, materialize_grads=True)
    else:  # no tokens: the reference returns a constant
        grads = [torch.zeros_like(t) for t in xs]
    return [y.float()] + [g.float() for g in grads]


def moe_error_table(fn: Callable, inputs: list[torch.Tensor], dtype: torch.dtype, device) -> list[tuple[str, float, float]]:
    """[(name, err, err_pt)] for y and the gradients of x, topk_weights, gate_up_proj, down_proj: `fn` in `dtype`
    against the fp32 reference, next to the reference itself run in `dtype`."""
    from anyseek.kernels.reference.moe import routed_experts as ref_fn

    ref = _run_moe(ref_fn, inputs, torch.float32, device)
    pt = _run_moe(ref_fn, inputs, dtype, device)
    got = _run_moe(fn, inputs, dtype, device)
    names = ["out", "dx", "dweights", "dgate_up", "ddown"]
    return [(n, (a - r).abs().max().item() if r.numel() else 0.0, (b - r).abs().max().item() if r.numel() else 0.0)
            for n, a, b, r in zip(names, got, pt, ref)]  # fmt: skip
