"""The CPU decode step (`infer/cpu_decode.py`: folded norms and absorbed weights, one matmul for all experts, views of
the cache) against the general cached path and the uncached forward, fp32: every fold on and off, both RoPE
layouts, both routing functions, batches of unequal lengths (masked), sequences on non-consecutive cache blocks
(gathered), the gathered-experts fallback, and weights that change between requests."""

from __future__ import annotations

import pytest
import torch

import anyseek
from anyseek.infer import cpu_decode
from anyseek.infer.engine import Engine
from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "qk_rope_head_dim": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 3, "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0, "init_std": 0.08, "max_position_embeddings": 256}  # fmt: skip
CASES = {  # (fold W_UK into q, fold W_UV into o_proj) follow from the sizes: see cpu_decode._pack_attn
    "fold_both": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 4,
                  "topk_group": 2, "rope_interleave": True, "n_shared_experts": 1},
    "fold_neither": {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1,
                     "topk_group": 1, "rope_interleave": False, "n_shared_experts": 2},
    "no_qlora_softmax": {"q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 12,
                         "n_group": 2, "topk_group": 1, "scoring_func": "softmax", "norm_topk_prob": False,
                         "rope_interleave": True, "n_shared_experts": 0},
}  # fmt: skip
PROMPTS = [[5, 9, 2, 77, 31], list(range(40, 110)), [3]]


def make_model(case: str, seed: int = 0) -> DeepSeekV3:
    torch.manual_seed(seed)
    model = DeepSeekV3(ModelConfig(**BASE, **CASES[case])).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.1)
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_cases_cover_every_fold():
    folds = set()
    for case in CASES:
        a = cpu_decode.packed_layers(make_model(case)).layers[0][0]
        folds.add((a.w_uk is None, a.w_uv is None))
    assert {(True, True), (False, False)} <= folds


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_step_equals_general_path_and_uncached_forward(case):
    """Three prompts of different lengths (masked rows) and then one alone (a slice of the cache): each step's
    logits equal the general cached path's and, at the end, the full forward's."""
    model = make_model(case)
    for prompts in (PROMPTS, PROMPTS[1:2]):
        B = len(prompts)
        fast, general = Engine(model, B, 120, page=16), Engine(model, B, 120, page=16)
        general.cpu = None
        assert fast.cpu is not None
        la, _, _ = fast.prefill(list(range(B)), prompts)
        lb, _, _ = general.prefill(list(range(B)), prompts)
        seqs, worst = [list(p) for p in prompts], 0.0
        for _ in range(20):
            nxt = lb.argmax(-1).tolist()
            for s, t in zip(seqs, nxt):
                s.append(t)
            la, lb = fast.decode(list(range(B)), nxt), general.decode(list(range(B)), nxt)
            worst = max(worst, rel(la, lb))
        with torch.no_grad():
            for b, s in enumerate(seqs):
                worst = max(worst, rel(la[b], model(torch.tensor(s)).logits[-1]))
        assert worst < 1e-5, (case, B, worst)


def test_non_consecutive_blocks_and_gathered_experts(monkeypatch):
    """After the middle sequence finishes the others sit on blocks 0 and 2 (their rows are gathered); with the
    all-experts MoE switched off the chosen experts' weights are gathered instead (the general MoE decode)."""
    model = make_model("fold_both")
    for waste in (cpu_decode.DENSE_MOE_WASTE, 0):
        monkeypatch.setattr(cpu_decode, "DENSE_MOE_WASTE", waste)
        eng = Engine(model, 3, 120, page=16)
        logits, _, _ = eng.prefill([0, 1, 2], PROMPTS)
        eng.free(1)
        seqs = [list(PROMPTS[0]), list(PROMPTS[2])]
        nxt = logits[[0, 2]].argmax(-1).tolist()
        assert [eng.cpu.block_of(eng.cache.seqs[s].pages) for s in (0, 2)] == [0, 2]
        for _ in range(10):
            for s, t in zip(seqs, nxt):
                s.append(t)
            logits = eng.decode([0, 2], nxt)
            nxt = logits.argmax(-1).tolist()
        with torch.no_grad():
            worst = max(rel(logits[b], model(torch.tensor(s)).logits[-1]) for b, s in enumerate(seqs))
        assert worst < 1e-5, (waste, worst)


def test_weights_changed_between_requests_are_repacked():
    model = make_model("fold_neither")
    first = anyseek.generate(model, PROMPTS, max_new_tokens=12, temperature=0)
    with torch.no_grad():  # as an optimizer step would: in place
        for p in model.parameters():
            p.mul_(1.3)
    again = anyseek.generate(model, PROMPTS, max_new_tokens=12, temperature=0)
    eng = Engine(model, 1, 100)
    eng.cpu = None
    want = []
    for p in PROMPTS:  # the general path, one sequence at a time
        logits, _, _ = eng.prefill([0], [p])
        toks = []
        for _ in range(12):
            toks.append(int(logits.argmax(-1)))
            logits = eng.decode([0], toks[-1:])
        eng.free(0)
        want.append(toks)
    assert again == want and again != first
