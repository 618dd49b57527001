import subprocess
import sys
import warnings

import pytest
import torch

from anyseek.kernels import registry


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("ANYSEEK_ATTENTION", raising=False)
    monkeypatch.delenv("ANYSEEK_MOE", raising=False)
    yield
    registry.set_backend("attention", None)


def test_cpu_auto_picks_bmm_then_sdpa_without_warning():
    ex = registry.example_for("mla_attention", "cpu")  # fp32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, name, why = registry.choose("mla_attention", ex)
        assert name == "bmm" and "tiles" in why
        _, name, why = registry.choose("mla_attention", ex.bfloat16())  # bmm is fp32-only: SDPA, silently
        assert name == "sdpa" and "SDPA" in why


def test_env_and_set_backend(monkeypatch):
    ex = registry.example_for("varlen_attention", "cpu")
    monkeypatch.setenv("ANYSEEK_ATTENTION", "reference")
    assert registry.choose("varlen_attention", ex)[1] == "reference"
    registry.set_backend("varlen_attention", "sdpa")  # set_backend wins over the environment
    assert registry.choose("varlen_attention", ex)[1] == "sdpa"


def test_explicit_unavailable_raises_with_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    registry.set_backend("attention", "triton")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        registry.get("mla_attention", registry.example_for("mla_attention", "cpu"))


def test_unknown_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="known: bmm, flash_attn, reference, sdpa, triton"):
        registry.set_backend("attention", "flashy")
    monkeypatch.setenv("ANYSEEK_ATTENTION", "flashy")
    with pytest.raises(ValueError, match="ANYSEEK_ATTENTION asks for backend 'flashy'"):
        registry.get("mla_attention", registry.example_for("mla_attention", "cpu"))
    with pytest.raises(ValueError, match="unknown op"):
        registry.backends("nope")


def test_auto_fallback_warns_once():
    def broken(example):
        return False, "broken on purpose"

    registry.register("varlen_attention", registry.Backend("broken", lambda: None, broken), before="triton")
    try:
        ex = registry.example_for("varlen_attention", "cpu")
        with pytest.warns(RuntimeWarning, match="broken on purpose"):
            _, name, why = registry.choose("varlen_attention", ex)
        assert name == "bmm" and "skipped broken" in why
        registry._cache.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            registry.choose("varlen_attention", ex)
    finally:
        registry._BACKENDS["varlen_attention"] = [
            b for b in registry.backends("varlen_attention") if b.name != "broken"
        ]
        registry._cache.clear()


def test_describe_rows():
    rows = registry.describe("cpu")
    assert [r[0] for r in rows][:2] == ["mla_attention", "varlen_attention"]
    assert all(len(r) == 3 for r in rows)


def test_import_kernels_does_not_import_triton():
    code = "import sys, anyseek.kernels as k; k.registry.describe('cpu'); print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_seam_runs_on_cpu():
    from anyseek import kernels

    T, H = 7, 2
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = kernels.mla_attention(
        torch.randn(T, H, 24), torch.randn(T, H, 16), torch.randn(T, 8), torch.randn(T, H, 16), cu, 4
    )
    assert out.shape == (T, H, 16)
