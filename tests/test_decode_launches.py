"""How many kernels one decode step launches per MoE layer on the GPU path (`infer/layers.py`), counted on the CPU:
the Triton kernels run under the interpreter (every seam asked for its triton backend) and each PyTorch op that is
not a view counts as one kernel, as it would on a GPU. At batch 1 a 16B decode step is bound by these launches
(~500 a step, ~3 us each inside a CUDA graph, against ~1 ms for reading the weights), so a copy or a second matmul
that creeps into the layer costs every token; this test names it.

The seams are asked for their triton backends around the decode step alone (the prefill before it takes the CPU's).
The model has 16B's structure (no q LoRA, two shared experts, sigmoid routing, one dense layer first) at small
widths; one MoE layer's launches are the difference between a 4-layer and a 3-layer model's step.
"""

from __future__ import annotations

import collections

import interpreter
import pytest

# one MoE layer of a decode step: two add-norms, q|kv_a (one matmul: `join_weights`), the cache write (with the
# query's rope), W_UK, the attention, W_UV, o_proj, the router's linear and top-k, the shared experts' gate|up,
# SwiGLU and down, the routing plan, the two grouped GEMMs and the sum over each token's experts
MOE_LAYER = {"torch:mm": 5, "torch:bmm": 2, "triton:_rmsnorm_fwd_kernel": 2, "triton:_cache_write_kernel": 1,
             "triton:_decode_split_kernel": 1, "triton:_route_topk_kernel": 1, "triton:_swiglu_fwd_kernel": 1,
             "triton:_plan_one_kernel": 1, "triton:_grouped_gemm_kernel": 2, "triton:_sum_k_kernel": 1}  # fmt: skip
VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand", "select",
         "slice", "split", "split_with_sizes", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unbind",
         "narrow", "view_as", "empty", "empty_strided", "empty_like", "new_empty", "lift_fresh"}  # fmt: skip


def _count(layers: int, batch: int, join: bool) -> collections.Counter:
    import torch
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode

    from anyseek.infer.engine import Engine
    from anyseek.infer.layers import join_weights
    from anyseek.kernels import registry
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3

    counts: collections.Counter = collections.Counter()
    inside = [0]
    run = interp.InterpretedFunction.run

    def counted(self, *a, **k):
        counts["triton:" + self.fn.__name__] += 1
        inside[0] += 1  # the interpreter's own tensor work is not the kernel's launches
        try:
            return run(self, *a, **k)
        finally:
            inside[0] -= 1

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0] and func.namespace == "aten" and name not in VIEWS and name != "promote_types":
                counts["torch:" + name] += 1
            return func(*args, **(kwargs or {}))

    cfg = ModelConfig.from_name("16B", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                num_hidden_layers=layers, num_attention_heads=2, kv_lora_rank=128,
                                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
                                num_experts_per_tok=4, vocab_size=512, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    model = DeepSeekV3(cfg).eval()
    if join:
        join_weights(model)
    engine = Engine(model, max_batch=batch, max_len=32, cuda_graphs=False)
    interp.InterpretedFunction.run = counted
    try:
        with torch.no_grad():
            engine.prefill(list(range(batch)), [[1, 2, 3, 4, 5]] * batch)  # (the CPU's backends: quicker)
            counts.clear()
            with registry.using(**dict.fromkeys(("moe", "decode", "norm", "rope", "swiglu", "router"), "triton")):
                with Ops():
                    engine.extend(list(range(batch)), [[7]] * batch)
    finally:
        interp.InterpretedFunction.run = run
    return counts


def _worker() -> None:
    interpreter.unpoison()  # (its NaN fills would count as launches)
    results = {}
    for name, batch, join in (("batch2", 2, True), ("not_joined", 1, False)):
        layer = _count(4, batch, join)
        layer.subtract(_count(3, batch, join))
        got = {k: v for k, v in layer.items() if v}
        results[name] = {"pass": got == MOE_LAYER, "table": sorted(got.items())}
    interpreter.report(results)


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


def test_a_moe_layer_of_the_decode_step_launches_seventeen_kernels(interp_results):
    """The launches of one MoE layer (two sequences), by kernel, as listed in MOE_LAYER: a new copy, cast or
    concatenation, or a projection pair that runs as two matmuls, fails it (say which, and update MOE_LAYER where it
    is meant)."""
    interpreter.check(interp_results, "batch2", "(launch, count)")


def test_the_count_sees_a_projection_pair_run_as_two_matmuls(interp_results):
    """Without `join_weights` q_proj and kv_a_proj_with_mqa run as two matmuls: the count must see the one more."""
    got = dict(interp_results["not_joined"]["table"])
    assert not interp_results["not_joined"]["pass"] and got["torch:mm"] == MOE_LAYER["torch:mm"] + 1, got


if __name__ == "__main__":
    _worker()
