"""The Triton MLA decode kernel against its reference: on CPU under TRITON_INTERPRET=1 (in a subprocess, so the
variable never leaks into other tests), and on a GPU (marked cuda). The 2x rule of kernels/accuracy.py."""

import interpreter
import pytest
import torch

# (name, kv_lens, H, L, R, page, dtype, config overrides): odd heads and dims, length 1, exactly full pages,
# more splits than a short row has pages (empty splits), token tiles smaller than a page
INTERP_CASES = [
    ("fp32_odd", [1, 37, 64, 5], 3, 24, 8, 16, "float32", {"splits": 3}),
    ("fp16_odd_heads", [17, 1, 48], 17, 32, 16, 16, "float16", {"splits": 2}),
    ("fp16_many_splits", [3, 90], 2, 16, 16, 32, "float16", {"splits": 5, "BLOCK_N": 16}),
    ("fp16_one_split", [33, 64], 4, 32, 16, 32, "float16", {"splits": 1}),
    # power-of-two widths: whole tiles by TMA descriptors (the interpreter runs them), partial ones by pointers;
    # and the same shapes through pointers only
    ("fp16_tma", [1, 16, 17, 47, 64], 5, 64, 16, 32, "float16", {"splits": 2, "tma": True}),
    ("fp16_no_tma", [1, 16, 17, 47, 64], 5, 64, 16, 32, "float16", {"splits": 2, "tma": False}),
]
# (name, kv_lens, H, L, R, page, dtype, config overrides, softmax_scale): the cases above run the default
# 1/sqrt(L+R); YaRN configs (the 671B flavor) pass another. Scales ~2x and ~1/3 of the default, through the
# reduction over splits and through the one-split path that writes the output itself
SCALED_CASES = [
    ("fp32_scale_0.4", [1, 37, 20], 3, 24, 8, 16, "float32", {"splits": 2}, 0.4),
    ("fp16_tma_scale_0.04", [16, 47, 3], 5, 64, 16, 32, "float16", {"splits": 2, "tma": True}, 0.04),
    ("fp16_one_split_scale_0.3", [33, 5], 4, 32, 16, 32, "float16", {"splits": 1}, 0.3),
]


def scaled_error_table(fn, kv_lens, H, L, R, page, dtype, softmax_scale, device="cpu", **kw):
    """As `accuracy.decode_error_table` (without its NaN-poisoned slots), with `softmax_scale` given to `fn`, the
    fp32 reference and the reference in `dtype` alike -> [("out", err, err_pt)]."""
    from anyseek.kernels import accuracy
    from anyseek.kernels.reference.decode import mla_decode as ref_fn

    q, cache, table, lens = accuracy.decode_inputs(kv_lens, H, L, R, page, device, dtype, seed=4)
    ref = ref_fn(q.float(), cache.float(), table, lens, L, softmax_scale=softmax_scale)
    pt = ref_fn(q, cache, table, lens, L, softmax_scale=softmax_scale, compute_dtype=dtype).float()
    got = fn(q, cache, table, lens, L, softmax_scale=softmax_scale, **kw).float()
    return [("out", (got - ref).abs().max().item(), (pt - ref).abs().max().item())]


def _worker() -> None:
    from anyseek.kernels import accuracy
    from anyseek.kernels.triton import mla_decode as k

    results = {}
    for name, lens, H, L, R, page, dtype, cfg in INTERP_CASES:
        dt = getattr(torch, dtype)
        table = accuracy.decode_error_table(k.mla_decode, lens, H, L, R, dt, "cpu", page=page, seed=1, config=cfg)
        results[name] = {"pass": accuracy.passes(table, dt), "table": table}
    for name, lens, H, L, R, page, dtype, cfg, scale in SCALED_CASES:
        dt = getattr(torch, dtype)
        table = scaled_error_table(k.mla_decode, lens, H, L, R, page, dt, scale, config=cfg)
        results[name] = {"pass": accuracy.passes(table, dt), "table": table}
    from anyseek.kernels import registry

    registry.set_backend("mla_decode", "triton")
    results["registry"] = {"pass": registry.choose("mla_decode", torch.empty(1, 4, 48))[1] == "triton", "table": []}
    interpreter.report(results)


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in INTERP_CASES + SCALED_CASES] + ["registry"])
def test_interpreter(interp_results, name):
    interpreter.check(interp_results, name, "(out, err, err_pt)")


def test_reference_matches_dense_attention():
    """The reference over pages equals plain softmax attention over the row's tokens gathered by hand."""
    from anyseek.kernels import accuracy
    from anyseek.kernels.reference.decode import mla_decode

    q, cache, table, lens = accuracy.decode_inputs([5, 19, 1], 3, 8, 4, 4, "cpu", torch.float64, seed=2)
    out = mla_decode(q, cache, table, lens, 8, softmax_scale=0.3)
    X, u = q.shape[-1], 2.0**-24  # the reference computes in fp32 (unit roundoff u) whatever its inputs' dtype
    for t, n in enumerate(lens.tolist()):
        rows = torch.cat([cache[p] for p in table[t].tolist()])[:n]
        p = torch.softmax(q[t] @ rows.T * 0.3, dim=-1)
        # fp32 error bound: a score (X products, inputs rounded to fp32) is off by at most (X + 2) u times the sum
        # of its terms' magnitudes; the output moves by at most 2 max|c| per unit of score error (d out / d s_j =
        # p_j (c_j - out)); the softmax and p @ c add ~(n + 2) u max|c|. A wrong page or mask moves it by ~1
        s_abs = (q[t].abs() @ rows.abs().T * 0.3).max()
        c_max = rows[:, :8].abs().max()
        tol = float((2 * (X + 2) * s_abs + n + 2) * u * c_max)
        torch.testing.assert_close(out[t], p @ rows[:, :8], rtol=0, atol=tol)


def test_tma_is_chosen_only_where_it_applies():
    from anyseek.kernels.triton.mla_decode import launch_config

    cpu = torch.device("cpu")
    assert launch_config(2, 16, 4, cpu, torch.float16, 512, 64)["tma"]
    assert not launch_config(2, 16, 4, cpu, torch.float32, 512, 64)["tma"]  # fp32 runs IEEE dots through pointers
    assert not launch_config(2, 16, 4, cpu, torch.float16, 24, 8)["tma"]  # widths that are not powers of two
    assert not launch_config(2, 16, 4, cpu, torch.float16, 512, 48)["tma"]


def test_workspace_allocator_keeps_one_the_user_set():
    """The TMA path builds its descriptors on the device, which needs a Triton workspace allocator: the kernel
    installs one only where Triton's default (which refuses every request) is in place."""
    import contextvars

    def check():
        import triton
        from triton.runtime import _allocation

        from anyseek.kernels.triton import mla_decode as k

        k._ensure_allocator()
        assert _allocation._allocator.get() is k._scratch
        mine = lambda size, alignment, stream: torch.empty(size, dtype=torch.int8)  # noqa: E731
        triton.set_allocator(mine)
        k._ensure_allocator()
        assert _allocation._allocator.get() is mine

    contextvars.copy_context().run(check)  # the allocator is a context variable: leave this thread's as it was


def test_a_tma_failure_falls_back_to_pointers(monkeypatch):
    """Where the TMA variant cannot be built (an old Triton, a driver without it), the first launch says so once
    and the kernel loads through pointers from then on. The launches are recorded, not run (no GPU here; the
    interpreter cases above run both variants for real)."""
    import warnings

    from anyseek.kernels import accuracy
    from anyseek.kernels.triton import mla_decode as k

    calls = []

    def launch(kernel, grid, cfg):
        def go(*args, **meta):
            calls.append(meta["TMA"])
            if meta["TMA"]:
                raise RuntimeError("no TMA here\nsecond line")

        return go

    class Reduce:
        def __getitem__(self, grid):
            return lambda *args, **meta: None

    monkeypatch.setattr(k, "_launch", launch)
    monkeypatch.setattr(k, "_decode_reduce_kernel", Reduce())
    monkeypatch.setattr(k, "_TMA_STATE", {})
    monkeypatch.setattr(k, "_ensure_allocator", lambda: None)
    q, cache, table, lens = accuracy.decode_inputs([5, 40], 4, 32, 16, 16, "cpu", torch.float16, seed=3)
    with pytest.warns(RuntimeWarning, match="TMA variant failed .RuntimeError: no TMA here"):
        k.mla_decode(q, cache, table, lens, 32, config={"tma": True})
    assert calls == [True, False] and list(k._TMA_STATE.values()) == ["RuntimeError: no TMA here"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second try
        k.mla_decode(q, cache, table, lens, 32, config={"tma": True})
    assert calls == [True, False, False]


def test_gluon_kernel_is_chosen_only_where_it_applies(monkeypatch):
    """The warp-specialised Gluon kernel (mla_decode_ws.py) is asked for on Hopper with heads in blocks of 64 and
    DeepSeek's 512 + 64 latent; everywhere else the Triton kernel runs, and a CPU tensor gets the reason."""
    from anyseek.kernels.triton import mla_decode as k
    from anyseek.kernels.triton import mla_decode_ws as ws

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(k, "_device_limits", lambda device: (132, 227 * 1024, True, True))  # an H100
    assert k.launch_config(64, 128, 64, gpu, torch.bfloat16, 512, 64)["ws"]
    assert k.launch_config(64, 64, 64, gpu, torch.float16, 512, 64)["ws"]
    assert not k.launch_config(64, 16, 64, gpu, torch.bfloat16, 512, 64)["ws"]  # 16 heads: memory-bound, Triton's
    assert not k.launch_config(64, 96, 64, gpu, torch.bfloat16, 512, 64)["ws"]
    assert not k.launch_config(64, 128, 64, gpu, torch.bfloat16, 256, 64)["ws"]  # the `small` flavor's latent
    monkeypatch.setattr(k, "_device_limits", lambda device: (170, 227 * 1024, True, False))  # Blackwell: no wgmma
    assert not k.launch_config(64, 128, 64, gpu, torch.bfloat16, 512, 64)["ws"]
    ok, why = ws.available(torch.empty(2, 128, 576, dtype=torch.bfloat16), torch.empty(3, 64, 576), 512)
    assert not ok and ("Hopper" in why or "Gluon" in why)


def test_a_gluon_failure_falls_back_to_the_triton_kernel(monkeypatch):
    """Where the Gluon kernel cannot be built (a Triton without Gluon's Hopper support, a compile error), its first
    launch says so once and the Triton kernel runs instead, from then on without a second try."""
    import warnings

    from anyseek.kernels import accuracy
    from anyseek.kernels.triton import mla_decode as k
    from anyseek.kernels.triton import mla_decode_ws as ws

    ran = []

    def gluon_split(*args):
        ran.append("gluon")
        raise RuntimeError("no warp specialisation here")

    def launch(kernel, grid, cfg):
        return lambda *args, **meta: ran.append("triton")

    monkeypatch.setattr(ws, "available", lambda q, cache, L: (True, "pretend"))
    monkeypatch.setattr(ws, "split", gluon_split)
    monkeypatch.setattr(k, "_launch", launch)
    monkeypatch.setattr(k, "_TMA_STATE", {})
    monkeypatch.setattr(k, "_ensure_allocator", lambda: None)
    q, cache, table, lens = accuracy.decode_inputs([5, 40], 4, 32, 16, 16, "cpu", torch.float16, seed=3)
    with pytest.warns(RuntimeWarning, match="warp-specialised MLA decode kernel failed .* no warp specialisation"):
        k.mla_decode(q, cache, table, lens, 32, config={"ws": True, "tma": False, "splits": 1})
    assert ran == ["gluon", "triton"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k.mla_decode(q, cache, table, lens, 32, config={"ws": True, "tma": False, "splits": 1})
    assert ran == ["gluon", "triton", "triton"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H, lens, splits", [
    (128, [1, 31, 32, 33, 64, 65, 1000, 4097], None),  # partial tiles of every kind, length 1
    (64, [7] * 33, None),  # many short rows
    (128, [20000], None),  # one long row over many splits
    (256, [5, 129, 4096], 1),  # four head blocks, one split: the output written by the kernel itself
    (128, [100, 3000, 1], 3),  # splits longer than some rows (empty ranges)
])  # fmt: skip
def test_gpu_gluon_decode(H, lens, splits, dtype):
    """The warp-specialised Gluon kernel against the fp32 reference (2x rule, NaN in every slot no row owns), and
    the proof that it, not the Triton kernel, ran."""
    from anyseek.kernels import accuracy
    from anyseek.kernels.triton import mla_decode as k
    from anyseek.kernels.triton import mla_decode_ws as ws

    ok, why = ws.device_available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    cfg = {"ws": True} if splits is None else {"ws": True, "splits": splits}
    table = accuracy.decode_error_table(k.mla_decode, lens, H, 512, 64, dtype, "cuda", config=cfg)
    assert accuracy.passes(table, dtype), table
    assert [v for key, v in k._TMA_STATE.items() if key[0] == "ws" and key[3] == dtype] == [True]


@pytest.mark.cuda
@pytest.mark.parametrize("ws", [True, False])
def test_gpu_decode_softmax_scale(ws):
    """A softmax scale other than 1/sqrt(L+R) (the model's is 1/sqrt(qk_head_dim), times mscale^2 under YaRN),
    through the Gluon kernel on Hopper (with the proof that it ran) and through the Triton kernel."""
    from anyseek.kernels import accuracy
    from anyseek.kernels.triton import mla_decode as k
    from anyseek.kernels.triton import mla_decode_ws as ws_k

    if ws and not ws_k.device_available(torch.device("cuda"))[0]:
        pytest.skip(ws_k.device_available(torch.device("cuda"))[1])
    table = scaled_error_table(k.mla_decode, [1, 65, 1000], 128, 512, 64, 64, torch.bfloat16, 0.1, device="cuda",
                               config={"ws": ws})  # fmt: skip
    assert accuracy.passes(table, torch.bfloat16), table
    if ws:
        assert [v for key, v in k._TMA_STATE.items() if key[0] == "ws" and key[3] == torch.bfloat16] == [True]


@pytest.mark.cuda
@pytest.mark.parametrize("LR", [(256, 64), (32, 16)])
@pytest.mark.parametrize("tma", [True, False])
def test_gpu_decode_other_widths(LR, tma):
    """The `small` and `tiny` flavors' latent widths, through TMA and through pointers."""
    from anyseek.kernels import accuracy
    from anyseek.kernels.triton.mla_decode import mla_decode

    for dtype in (torch.bfloat16, torch.float16):
        table = accuracy.decode_error_table(mla_decode, [1, 63, 64, 65, 700], 16, *LR, dtype, "cuda",
                                            config={"tma": tma})  # fmt: skip
        assert accuracy.passes(table, dtype), (dtype, table)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [1, 16, 20, 128])
@pytest.mark.parametrize("lens", [[1, 64, 65, 1000, 4097], [7] * 33, [20000]])
def test_gpu_decode(lens, H, dtype):
    from anyseek.kernels import accuracy
    from anyseek.kernels.triton.mla_decode import mla_decode

    table = accuracy.decode_error_table(mla_decode, lens, H, 512, 64, dtype, "cuda")
    assert accuracy.passes(table, dtype), table


if __name__ == "__main__":
    _worker()
