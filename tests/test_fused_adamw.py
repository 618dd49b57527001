"""The fused AdamW (`kernels.adamw_flat`, `adamw_tensors`, `train.optim.TensorAdamW`): the Triton backends against
their pure-PyTorch twins (both compute in fp32: a few roundings apart), on CPU under TRITON_INTERPRET=1 (in a
subprocess: the variable never leaks; tests/interpreter.py) and on a GPU (marked cuda); TensorAdamW against torch's
AdamW, a step halted on the device changing nothing; bf16 moments rounded stochastically as the reference does."""

import interpreter
import pytest
import torch

# (name, elements, gradient dtype, working-copy dtype or None[, moments dtype])
ADAMW_CASES = [
    ("fp32_grad", 5003, "float32", None),
    ("fp16_grad_fp16_copy", 4099, "float16", "float16"),
    ("one", 1, "float32", "float16"),
    ("empty", 0, "float16", "float16"),
    ("bf16_moments", 4099, "float16", "float16", "bfloat16"),
    ("bf16_moments_one", 1, "float32", None, "bfloat16"),
]


def adamw_errors(n, grad_dtype, low_dtype, device, seed=0, moments_dtype=torch.float32):
    """[(what, max |kernel - reference|, allowed)] after 3 steps of `kernels.adamw_flat` (weight decay, a folded
    clip factor) and for `sq_norm`; both compute in fp32, so they may differ by a few fp32 roundings only (bf16
    moments: by one bf16 ulp where those roundings move a value across a stochastic-rounding threshold)."""
    from anyseek.kernels.reference import adamw as ref
    from anyseek.kernels.triton import adamw as fused

    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(3)]
    out = {}
    for name, mod in (("ref", ref), ("fused", fused)):
        dev = "cpu" if name == "ref" else device
        p = p0.clone().to(dev)
        m, v = torch.zeros(n, device=dev, dtype=moments_dtype), torch.zeros(n, device=dev, dtype=moments_dtype)
        low = torch.empty(n, dtype=low_dtype, device=dev) if low_dtype is not None else None
        for step, grad in enumerate(grads, 1):
            skip = torch.tensor(0.0, device=dev) if step == 2 else None  # a step the device flag lets through
            mod.adamw_flat(p, grad.to(dev), m, v, low, torch.tensor(1.5, device=dev), step, 1e-2, 0.9, 0.95, 1e-8, 0.1,
                           skip=skip, seed=1000 + step)
        before = [t.clone() for t in (p, m, v) + (() if low is None else (low,))]
        nan = torch.full((n,), float("nan"), device=dev).to(grad_dtype)  # a skipped step changes nothing at all
        mod.adamw_flat(p, nan, m, v, low, torch.tensor(float("nan"), device=dev), 4, 1e-2, 0.9, 0.95, 1e-8, 0.1,
                       skip=torch.tensor(1.0, device=dev))
        assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v) + (() if low is None else (low,)))), name
        out[name] = [t.cpu().float() for t in (p, m, v)] + ([low.cpu().float()] if low is not None else [])
        out[name].append(mod.sq_norm(grads[0].to(dev)).cpu().reshape(1))
    names = ["p", "m", "v"] + (["low"] if low_dtype is not None else []) + ["sq_norm"]
    table = []
    for what, a, b in zip(names, out["fused"], out["ref"]):
        err = (a - b).abs().max().item() if a.numel() else 0.0
        tol = 1e-5 * max(1.0, b.abs().max().item() if b.numel() else 0.0)
        if what == "low" or (what in ("m", "v") and moments_dtype == torch.bfloat16):  # one rounding may land on
            tol = 2.0 ** -7 * max(1.0, b.abs().max().item() if b.numel() else 0.0)  # the other side
        if what == "p" and moments_dtype == torch.bfloat16:  # a moment one bf16 ulp apart (above) moves a later
            tol += 3 * 1e-2 * 2.0**-7  # update (at most lr = 1e-2 in size) by at most that fraction, for 3 steps
        table.append((what, err, tol))
    return table


# (name, shapes, grad dtype[, low copies' dtype]): `kernels.adamw_tensors` over tensors of these shapes
ADAMW_TENSORS_CASES = [
    ("fp32_odd_shapes", [(7,), (2049,), (3, 5), (0,), (1,), (2, 2100)], "float32"),
    ("fp16_grads", [(4100,), (33, 17)], "float16"),
    ("fp16_grads_fp16_lows", [(4100,), (0,), (33, 17), (1,)], "float16", "float16"),
]


def adamw_tensors_errors(shapes, grad_dtype, device, seed=0, low_dtype=None):
    """[(what, max |kernel - reference|, allowed)] after 3 steps of `adamw_tensors` over tensors whose step counts
    differ (the first starts at 5), one step let through by a zero skip flag and a skipped one (nothing may change:
    compared exactly). low_dtype: each weight also has a low-precision copy written from the new weights (compared
    with the reference's within one rounding of the weights' difference)."""
    from anyseek.kernels.reference import adamw as ref
    from anyseek.kernels.triton import adamw as fused

    g = torch.Generator().manual_seed(seed)
    p0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(grad_dtype) for s in shapes] for _ in range(3)]
    out = {}
    for name, mod in (("ref", ref), ("fused", fused)):
        dev = "cpu" if name == "ref" else device
        ps = [t.clone().to(dev) for t in p0]
        ms, vs = [torch.zeros(s, device=dev) for s in shapes], [torch.zeros(s, device=dev) for s in shapes]
        steps = [torch.tensor(4.0 if i == 0 else 0.0, device=dev) for i in range(len(shapes))]
        lows = None if low_dtype is None else [torch.zeros(s, dtype=low_dtype, device=dev) for s in shapes]
        for k, gs in enumerate(grads):
            for st in steps:
                st += 1
            skip = torch.tensor(0.0, device=dev) if k == 1 else None
            mod.adamw_tensors(ps, [x.to(dev) for x in gs], ms, vs, steps, torch.tensor(1.5, device=dev), 1e-2, 0.9,
                              0.95, 1e-8, 0.1, skip=skip, lows=lows)  # fmt: skip
        kept = ps + ms + vs + (lows or [])
        before = [t.clone() for t in kept]
        nan = [torch.full(s, float("nan"), device=dev).to(grad_dtype) for s in shapes]
        mod.adamw_tensors(ps, nan, ms, vs, steps, torch.tensor(float("nan"), device=dev), 1e-2, 0.9, 0.95, 1e-8, 0.1,
                          skip=torch.tensor(1.0, device=dev), lows=lows)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(before, kept)), name
        out[name] = [torch.cat([t.cpu().reshape(-1) for t in ts]) for ts in (ps, ms, vs)]
        if lows is not None:  # the copy is the new weights rounded
            assert all(torch.equal(low.cpu(), p.cpu().to(low_dtype)) for low, p in zip(lows, ps)), name
            out[name].append(torch.cat([t.cpu().float().reshape(-1) for t in lows]))
    table = []
    for what, a, b in zip(("p", "m", "v", "low"), out["fused"], out["ref"]):
        ulp = 0.0 if what != "low" else b.abs().max().item() * torch.finfo(low_dtype).eps
        table.append((what, (a - b).abs().max().item(), 1e-5 * max(1.0, b.abs().max().item()) + ulp))
    return table


def _worker() -> None:
    """Runs in the subprocess: every case of this module; reports one JSON line."""
    results = {}
    for name, n, gd, ld, *md in ADAMW_CASES:
        table = adamw_errors(n, getattr(torch, gd), getattr(torch, ld) if ld else None, "cpu",
                             moments_dtype=getattr(torch, md[0]) if md else torch.float32)
        results[f"adamw_{name}"] = {"pass": all(err <= tol for _, err, tol in table), "table": table}
    for name, shapes, gd, *ld in ADAMW_TENSORS_CASES:
        table = adamw_tensors_errors([tuple(x) for x in shapes], getattr(torch, gd), "cpu",
                                     low_dtype=getattr(torch, ld[0]) if ld else None)
        results[f"adamw_tensors_{name}"] = {"pass": all(err <= tol for _, err, tol in table), "table": table}
    interpreter.report(results)


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"adamw_{c[0]}" for c in ADAMW_CASES]
                         + [f"adamw_tensors_{c[0]}" for c in ADAMW_TENSORS_CASES])
def test_interpreter(interp_results, name):
    interpreter.check(interp_results, name, "(what, err, err_torch)")


def test_tensor_adamw_is_torch_adamw():
    """`train.optim.TensorAdamW` (here through the seam's PyTorch twin) takes torch's AdamW steps: the same weights
    and state after 3 steps with a folded clip factor, state dicts that load into each other, and a step that
    `found_inf` halts changes nothing, its step counts included."""
    from anyseek.train.optim import TensorAdamW

    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (1,)]
    p0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    def run(cls, **kw):
        ps = [torch.nn.Parameter(t.clone()) for t in p0]
        opt = cls([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2,
                  betas=(0.9, 0.95), eps=1e-8, **kw)  # fmt: skip
        opt.grad_scale = torch.tensor(1.5)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        return ps, opt

    ps, opt = run(TensorAdamW)
    want, torch_opt = run(torch.optim.AdamW, fused=True)
    for a, b in zip(ps, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(opt.state.values(), torch_opt.state.values()):
        assert a.keys() == b.keys() and float(a["step"]) == float(b["step"]) == 3.0
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    opt.load_state_dict(torch_opt.state_dict())
    before = [p.detach().clone() for p in ps] + [st["step"].clone() for st in opt.state.values()]
    opt.found_inf = torch.tensor(1.0)
    for p in ps:
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    after = [p.detach() for p in ps] + [st["step"] for st in opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.cuda
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 2047, 3 * 2**20 + 5])
def test_gpu_adamw_flat(grad_dtype, n, moments):
    table = adamw_errors(n, grad_dtype, torch.bfloat16, "cuda", moments_dtype=moments)
    assert all(err <= tol for _, err, tol in table), table


@pytest.mark.cuda
@pytest.mark.parametrize("grad_dtype,low_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                                 (torch.bfloat16, torch.bfloat16)])
def test_gpu_adamw_tensors(grad_dtype, low_dtype):
    shapes = [(1,), (2047,), (1024, 3000), (0,), (5, 7), (3 * 2**20 + 5,)]
    table = adamw_tensors_errors(shapes, grad_dtype, "cuda", low_dtype=low_dtype)
    assert all(err <= tol for _, err, tol in table), table


@pytest.mark.cuda
def test_gpu_tensor_adamw_matches_fused_adamw():
    """TensorAdamW against torch's fused AdamW on CUDA tensors (clip factor, two groups), and a halted step."""
    from anyseek.train.optim import TensorAdamW

    g = torch.Generator().manual_seed(0)
    shapes = [(512, 300), (4099,), (64,)]
    p0 = [torch.randn(s, generator=g).cuda() for s in shapes]
    grads = [[torch.randn(s, generator=g).cuda() for s in shapes] for _ in range(3)]
    res = []
    for cls in (TensorAdamW, lambda *a, **k: torch.optim.AdamW(*a, fused=True, **k)):
        ps = [torch.nn.Parameter(t.clone()) for t in p0]
        opt = cls([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2,
                  betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
        opt.grad_scale, opt.found_inf = torch.tensor(1.5, device="cuda"), torch.zeros((), device="cuda")
        for k, gs in enumerate(grads + [grads[0]]):
            opt.found_inf.fill_(float(k == 3))  # the last step halted on the device
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        res.append(ps + [st["step"] for st in opt.state.values()])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_gpu_bf16_moments_round_as_the_reference():
    """The kernel's random numbers are the reference's: given equal fp32 updates, all but a few elements (an fp32
    rounding apart, across a threshold) round to the same bf16."""
    from anyseek.kernels.reference import adamw as ref
    from anyseek.kernels.triton import adamw as fused

    n = 1 << 20
    out = []
    for mod, dev in ((ref, "cpu"), (fused, "cuda")):
        g = torch.Generator().manual_seed(1)
        grad = torch.randn(n, generator=g).to(dev)
        p, m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev, dtype=torch.bfloat16), torch.zeros(
            n, device=dev, dtype=torch.bfloat16)
        mod.adamw_flat(p, grad, m, v, None, torch.tensor(1.0, device=dev), 1, 1e-3, 0.9, 0.95, 1e-8, 0.0, seed=77)
        out.append((m.cpu(), v.cpu()))
    for a, b in zip(*out):
        assert (a != b).float().mean().item() < 1e-3


if __name__ == "__main__":
    _worker()
