"""MLA decode on Hopper with warp-specialised warpgroups (Gluon): the 64-heads-per-program case (H = 64, 128, ...).

The Triton kernel (`mla_decode.py`) holds a 64 x 512 fp32 accumulator in one program of 8 warps; Triton lays the
score product q.c out over both warpgroups, each computing it whole, and runs the softmax between the two products
with nothing else to hide it. Here a program has two consumer warpgroups and one loader warp:

- the loader warp walks the block table and copies each 32-token tile (both latent halves and the rope part) into
  a ring of shared-memory stages by TMA, the query once before that;
- consumer warpgroup w (0 or 1) owns output columns [w * 256, w * 256 + 256) (a 64 x 256 fp32 accumulator) and the
  scores of every other tile (tiles w, w + 2, ...): for its tile it computes s = q.c (all 576 columns), the online
  softmax, writes p (in the cache's 16-bit type) and the row statistics (rescale factor, maximum, sum) to shared
  memory, and signals the other warpgroup; both then add p @ c[:, their columns].
- A warpgroup issues the score product of its next tile before it waits for the other's p of the tile between, so
  one warpgroup's softmax runs while the other's products keep the tensor cores busy, and no product is computed
  twice.

The online softmax runs tile after tile exactly as in the single-program kernel (the statistics pass from one
warpgroup to the other), so the result is the same function. The last tile of a range may be partial: its score
columns past the end are -inf, and each warpgroup zeroes the rows of its latent half past the end before its value
product reads them (a cache slot past a row's length may hold anything, NaN included).

Output as the split kernel's: the normalized partial output and base-2 log-sum-exp per split (fp32), or with one
split the output itself. Gluon is Triton's explicit-layout dialect (`triton.experimental.gluon`; this kernel runs with
Triton 3.6 and compiles with 3.9). Where Gluon or Hopper is missing, `available` says so and the Triton kernel runs;
where the kernel fails to build, its first launch warns once and the Triton kernel runs (`mla_decode._try_variant`).
"""

from __future__ import annotations

import functools

import torch

try:  # Gluon's Hopper instructions (the interpreter does not run Gluon)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # names that moved: the partition-wide barrier (gl.thread_barrier in Triton 3.5-3.6, gl.barrier later) and the
    # TMA copy into shared memory (tma.async_copy_global_to_shared, later tma.async_load)
    _partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _GLUON_ERROR = None
except Exception as e:  # noqa: BLE001 - any Triton without it: this kernel is unavailable, the Triton one runs
    _GLUON_ERROR = f"{type(e).__name__}: {e}"

BLOCK_H = 64  # heads per program: one wgmma M
BLOCK_N = 32  # tokens per tile
STAGES = 4  # tiles in flight: 4 x 36 KB + the query 72 KB + p 8 KB fits Hopper's 227 KB
HALF = 256  # latent columns per warpgroup (and per TMA box)
# registers per thread: Triton gives the default partition (warpgroup 0) 256, so 128 x (256 + 208 + 40) = 64,512 of
# the 65,536; ptxas on sm_90a: 8 bytes spilled (Triton 3.6)
LOADER_REGS, CONSUMER_REGS, MAXNREG = 40, 208, 168


if _GLUON_ERROR is None:

    @gluon.jit
    def _loader(Q, C, BT, q_smem, c_smem, kp_smem, qp_smem, q_bar, kv_ready, kv_free,
                t, hb, H, start, n_tiles, stride_bt, n_rows, n_q_rows, PAGE):  # fmt: skip
        # (constants travel as the buffers' shapes: Triton 3.6 turns a partition's constexpr arguments into values)
        BLOCK_H: gl.constexpr = q_smem.type.shape[1]
        HALF: gl.constexpr = q_smem.type.shape[2]
        BLOCK_N: gl.constexpr = c_smem.type.shape[1]
        STAGES: gl.constexpr = kp_smem.type.shape[0]
        R: gl.constexpr = kp_smem.type.shape[2]
        L: gl.constexpr = 2 * HALF
        X: gl.constexpr = L + R
        # each descriptor's box and layout those of the buffer it fills
        q_lat = tma.make_tensor_descriptor(Q, [n_q_rows, L], [X, 1], [BLOCK_H, HALF], q_smem.type.layout)
        q_pe = tma.make_tensor_descriptor(Q + L, [n_q_rows, R], [X, 1], [BLOCK_H, R], qp_smem.type.layout)
        c_lat = tma.make_tensor_descriptor(C, [n_rows, L], [X, 1], [BLOCK_N, HALF], c_smem.type.layout)
        c_pe = tma.make_tensor_descriptor(C + L, [n_rows, R], [X, 1], [BLOCK_N, R], kp_smem.type.layout)
        q_row = t * H + hb * BLOCK_H
        mbarrier.expect(q_bar, 2 * BLOCK_H * HALF * 2 + BLOCK_H * R * 2)
        _tma_load(q_lat, [q_row, 0], q_bar, q_smem.index(0))
        _tma_load(q_lat, [q_row, HALF], q_bar, q_smem.index(1))
        _tma_load(q_pe, [q_row, 0], q_bar, qp_smem.index(0))
        for j in range(n_tiles):
            s = j % STAGES
            mbarrier.wait(kv_free.index(s), ((j // STAGES) & 1) ^ 1)
            n0 = start + j * BLOCK_N
            row = gl.load(BT + t * stride_bt + n0 // PAGE) * PAGE + n0 % PAGE
            bar = kv_ready.index(s)
            mbarrier.expect(bar, BLOCK_N * (2 * HALF + R) * 2)
            _tma_load(c_lat, [row, 0], bar, c_smem.index(2 * s))
            _tma_load(c_lat, [row, HALF], bar, c_smem.index(2 * s + 1))
            _tma_load(c_pe, [row, 0], bar, kp_smem.index(s))

    @gluon.jit
    def _zero_rows_past(v_smem, valid, BLOCK_N: gl.constexpr, HALF: gl.constexpr):
        """Zero rows >= valid of a [BLOCK_N, HALF] tile in shared memory (a partial tile's slots past the end)."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk))
        x = v_smem.load(blk)
        x = gl.where(gl.expand_dims(rows < valid, 1), x, gl.zeros_like(x))
        v_smem.store(x)
        fence_async_shared()

    @gluon.jit
    def _scores(q_smem, qp_smem, c_smem, kp_smem, s, s_layout: gl.constexpr):
        """Issue s = q . c for stage s (all 576 columns: both latent halves, then the rope part); asynchronous."""
        BLOCK_H: gl.constexpr = q_smem.type.shape[1]
        BLOCK_N: gl.constexpr = c_smem.type.shape[1]
        sc = warpgroup_mma(q_smem.index(0), c_smem.index(2 * s).permute((1, 0)),
                           gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        sc = warpgroup_mma(q_smem.index(1), c_smem.index(2 * s + 1).permute((1, 0)), sc, is_async=True)
        return warpgroup_mma(qp_smem.index(0), kp_smem.index(s).permute((1, 0)), sc, is_async=True)

    @gluon.jit
    def _softmax(sc, m_i, l_i, n0, end, scale_log2, BLOCK_N: gl.constexpr, col_s: gl.constexpr):
        """One tile's online softmax (base 2): p, the accumulator's rescale factor, the new maximum and sum."""
        cols = n0 + gl.arange(0, BLOCK_N, layout=col_s)
        sc = gl.where(gl.expand_dims(cols < end, 0), sc * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _publish_and_add(W: gl.constexpr, p, alpha, m_i, l_i, acc, j, s, c_smem, p_smem, st_alpha, st_m, st_l,
                         p_ready, kv_free, row_o: gl.constexpr):  # fmt: skip
        """Write this warpgroup's tile j (p, statistics) for the other one, signal it, add p @ c[:, this half]."""
        # buffers j % 2: the other warpgroup read them (tile j - 2) before it signalled tile j - 1, which this one
        # has waited for
        p_smem.index(j % 2).store(p.to(p_smem.dtype))
        st_alpha.index(j % 2).store(alpha)
        st_m.index(j % 2).store(m_i)
        st_l.index(j % 2).store(l_i)
        fence_async_shared()
        _partition_barrier()
        mbarrier.arrive(p_ready, count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        acc = warpgroup_mma(p_smem.index(j % 2), c_smem.index(2 * s + W), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(kv_free.index(s), count=1)
        return acc

    @gluon.jit
    def _add_other_tile(W: gl.constexpr, jp, acc, start, end, c_smem, p_smem, st_alpha, st_m, st_l, kv_ready, p_ready,
                        row_s: gl.constexpr, row_o: gl.constexpr, LAST: gl.constexpr):  # fmt: skip
        """The other warpgroup's tile jp: wait for it and for its p and statistics, zero this half's rows past the
        end (LAST: the range's last tile, which may be partial; only there, to keep the loop's registers), and issue
        acc * alpha + p @ c[:, this half] (asynchronous). -> (the pending product, the running maximum and sum after
        tile jp, the tile's stage)."""
        BLOCK_N: gl.constexpr = c_smem.type.shape[1]
        HALF: gl.constexpr = c_smem.type.shape[2]
        STAGES: gl.constexpr = kv_ready.type.shape[0]
        sq = jp % STAGES
        mbarrier.wait(kv_ready.index(sq), (jp // STAGES) & 1)
        if LAST:
            valid = end - (start + jp * BLOCK_N)
            if valid < BLOCK_N:
                _zero_rows_past(c_smem.index(2 * sq + W), valid, BLOCK_N, HALF)
        mbarrier.wait(p_ready, jp & 1)
        alpha_o = st_alpha.index(jp % 2).load(row_o)
        m_i = st_m.index(jp % 2).load(row_s)
        l_i = st_l.index(jp % 2).load(row_s)
        pending = warpgroup_mma(p_smem.index(jp % 2), c_smem.index(2 * sq + W), acc * gl.expand_dims(alpha_o, 1),
                                is_async=True)  # fmt: skip
        return pending, m_i, l_i, sq

    @gluon.jit
    def _consumer(W: gl.constexpr, q_smem, c_smem, kp_smem, qp_smem, p_smem, st_alpha, st_m, st_l,
                  q_bar, kv_ready, kv_free, p_ready,
                  O, LSE, t, hb, sp, H, start, end, n_tiles, scale_log2,
                  stride_ot, stride_oh, stride_os, stride_lt, stride_lh):  # fmt: skip
        BLOCK_H: gl.constexpr = q_smem.type.shape[1]
        HALF: gl.constexpr = q_smem.type.shape[2]
        BLOCK_N: gl.constexpr = c_smem.type.shape[1]
        STAGES: gl.constexpr = kp_smem.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])  # fmt: skip
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
        mbarrier.wait(q_bar, 0)
        if W == 0:  # tile 0: nothing before it
            first = 2
            if n_tiles > 0:
                mbarrier.wait(kv_ready.index(0), 0)
                valid = end - start
                if valid < BLOCK_N:
                    _zero_rows_past(c_smem.index(W), valid, BLOCK_N, HALF)
                sc = _scores(q_smem, qp_smem, c_smem, kp_smem, 0, s_layout)
                sc = warpgroup_mma_wait(0, deps=(sc,))
                p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, start, end, scale_log2, BLOCK_N, col_s)
                acc = _publish_and_add(W, p, alpha, m_i, l_i, acc, 0, 0, c_smem, p_smem, st_alpha, st_m, st_l,
                                       p_ready, kv_free, row_o)  # fmt: skip
        else:
            first = 1
        for j in range(first, n_tiles, 2):  # this warpgroup's tiles; the other's tile j - 1 is added in between
            s = j % STAGES
            mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
            n0 = start + j * BLOCK_N
            valid = end - n0
            if valid < BLOCK_N:
                _zero_rows_past(c_smem.index(2 * s + W), valid, BLOCK_N, HALF)
            sc = _scores(q_smem, qp_smem, c_smem, kp_smem, s, s_layout)
            # the other warpgroup's tile j - 1 (not the last: never partial), its product behind the scores
            pending, m_i, l_i, sq = _add_other_tile(W, j - 1, acc, start, end, c_smem, p_smem, st_alpha, st_m, st_l,
                                                    kv_ready, p_ready, row_s, row_o, False)  # fmt: skip
            sc = warpgroup_mma_wait(1, deps=(sc,))
            p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, n0, end, scale_log2, BLOCK_N, col_s)
            acc = warpgroup_mma_wait(0, deps=(pending,))
            mbarrier.arrive(kv_free.index(sq), count=1)
            acc = _publish_and_add(W, p, alpha, m_i, l_i, acc, j, s, c_smem, p_smem, st_alpha, st_m, st_l,
                                   p_ready, kv_free, row_o)  # fmt: skip
        last = n_tiles - 1
        if n_tiles > 0 and last % 2 != W:  # the other warpgroup's last tile
            pending, m_i, l_i, sq = _add_other_tile(W, last, acc, start, end, c_smem, p_smem, st_alpha, st_m, st_l,
                                                    kv_ready, p_ready, row_s, row_o, True)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=(pending,))
            mbarrier.arrive(kv_free.index(sq), count=1)
        empty = l_i == 0.0
        inv = gl.convert_layout(1.0 / gl.where(empty, 1.0, l_i), row_o)
        heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_o)
        cols_o = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
        o_ptr = (O + t * stride_ot + sp * stride_os + gl.expand_dims(heads, 1) * stride_oh
                 + gl.expand_dims(cols_o, 0))  # fmt: skip
        gl.store(o_ptr, (acc * gl.expand_dims(inv, 1)).to(O.dtype.element_ty))
        if W == 0:
            lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
            heads_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
            gl.store(LSE + t * stride_lt + heads_s * stride_lh + sp, lse)

    # Two wrappers that differ only in the warpgroup index they pass: Triton 3.6 turns constexpr arguments handed to a
    # partition through warp_specialize into runtime values, so the index is baked in by the function itself.
    @gluon.jit
    def _consumer1(q_smem, c_smem, kp_smem, qp_smem, p_smem, st_alpha, st_m, st_l, q_bar, kv_ready, kv_free,
                   p_ready, O, LSE, t, hb, sp, H, start, end, n_tiles, scale_log2,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh):
        _consumer(1, q_smem, c_smem, kp_smem, qp_smem, p_smem, st_alpha, st_m, st_l, q_bar, kv_ready, kv_free,
                  p_ready, O, LSE, t, hb, sp, H, start, end, n_tiles, scale_log2,
                  stride_ot, stride_oh, stride_os, stride_lt, stride_lh)

    @gluon.jit
    def _consumer0(q_smem, c_smem, kp_smem, qp_smem, p_smem, st_alpha, st_m, st_l, q_bar, kv_ready, kv_free,
                   p_ready, O, LSE, t, hb, sp, H, start, end, n_tiles, scale_log2,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh):
        _consumer(0, q_smem, c_smem, kp_smem, qp_smem, p_smem, st_alpha, st_m, st_l, q_bar, kv_ready, kv_free,
                  p_ready, O, LSE, t, hb, sp, H, start, end, n_tiles, scale_log2,
                  stride_ot, stride_oh, stride_os, stride_lt, stride_lh)

    @gluon.jit(do_not_specialize=["pages_per_split"])
    def _decode_ws_kernel(Q, C, BT, LENS, O, LSE, scale_log2,
                          stride_bt, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                          H, pages_per_split, n_rows, n_q_rows,
                          L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
                          BLOCK_N: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr,
                          LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):  # fmt: skip
        hb, t, sp = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        kv_len = gl.load(LENS + t)
        start = sp * pages_per_split * PAGE
        end = gl.minimum(start + pages_per_split * PAGE, kv_len)
        n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
        dt: gl.constexpr = Q.dtype.element_ty
        lat_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], dt)
        pe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dt)
        qlat_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], dt)
        qpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], dt)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dt)
        st_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        q_smem = gl.allocate_shared_memory(dt, [2, BLOCK_H, HALF], qlat_layout)
        c_smem = gl.allocate_shared_memory(dt, [2 * STAGES, BLOCK_N, HALF], lat_layout)
        kp_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], pe_layout)
        qp_smem = gl.allocate_shared_memory(dt, [1, BLOCK_H, R], qpe_layout)
        p_smem = gl.allocate_shared_memory(dt, [2, BLOCK_H, BLOCK_N], p_layout)
        st_alpha = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], st_layout)
        st_m = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], st_layout)
        st_l = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], st_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(p_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_free.index(i), count=2)
        consumer_args = (q_smem, c_smem, kp_smem, qp_smem, p_smem, st_alpha, st_m, st_l, q_bar, kv_ready, kv_free,
                         p_ready, O, LSE, t, hb, sp, H, start, end, n_tiles, scale_log2,
                         stride_ot, stride_oh, stride_os, stride_lt, stride_lh)
        gl.warp_specialize([
            (_consumer0, consumer_args),
            (_consumer1, consumer_args),
            (_loader, (Q, C, BT, q_smem, c_smem, kp_smem, qp_smem, q_bar, kv_ready, kv_free, t, hb, H, start,
                       n_tiles, stride_bt, n_rows, n_q_rows, PAGE)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def device_available(device: torch.device) -> tuple[bool, str]:
    """(ok, reason) for this kernel on `device` (the shapes aside)."""
    if _GLUON_ERROR is not None:
        return False, f"this Triton has no Gluon for Hopper ({_GLUON_ERROR})"
    if device.type != "cuda" or torch.version.hip is not None or _capability(device.index) != (9, 0):
        return False, "it runs on Hopper (sm_90) only: warpgroup MMA"
    return True, "Gluon warp-specialised kernel on sm_90"


def unsupported(H: int, L: int, R: int, dtype: torch.dtype) -> str | None:
    """Why H heads over an L + R latent in `dtype` do not fit this kernel (None: they do)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"16-bit q and cache only, got {dtype}"
    if H % BLOCK_H or L != 2 * HALF or R != 64:
        return f"heads in blocks of {BLOCK_H} and a {2 * HALF} + 64 latent only (got H={H}, latent {L} + {R})"
    return None


def available(q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> tuple[bool, str]:
    """(ok, reason) for this kernel on q [T, H, L+R] and a paged cache [blocks, page, L+R]."""
    ok, reason = device_available(q.device)
    if not ok:
        return ok, reason
    why = unsupported(q.shape[1], kv_lora_rank, q.shape[2] - kv_lora_rank, q.dtype)
    if why is None and cache.dtype != q.dtype:
        why = f"q {q.dtype} and cache {cache.dtype} differ"
    if why is None and cache.shape[1] % BLOCK_N:
        why = f"pages of a multiple of {BLOCK_N} tokens only (got {cache.shape[1]})"
    aligned = q.is_contiguous() and cache.is_contiguous() and q.data_ptr() % 16 == 0 and cache.data_ptr() % 16 == 0
    if why is None and not aligned:
        why = "contiguous, 16-byte aligned q and cache only"
    return why is None, why or reason


def split(q, cache, table, lens, o_part, lse_part, scale_log2: float, splits: int, pages_per_split: int) -> None:
    """The split pass of `mla_decode` (its partials or, with one split, its output) by this kernel."""
    T, H, X = q.shape
    page = cache.shape[1]
    grid = (H // BLOCK_H, T, splits)  # the head blocks of one row next to each other: they read the same tiles
    _decode_ws_kernel[grid](
        q, cache, table, lens, o_part, lse_part, scale_log2,
        table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        H, pages_per_split, cache.shape[0] * page, T * H,
        L=2 * HALF, R=X - 2 * HALF, PAGE=page, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, HALF=HALF, STAGES=STAGES,
        LOADER_REGS=LOADER_REGS, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
