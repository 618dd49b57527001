"""train/profile.py: the step breakdown read from a Chrome trace, against totals worked out by hand."""

import pytest

from anyseek.train.config import ConfigError, load_run_config
from anyseek.train.profile import breakdown


def _k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_breakdown_sums_unions_and_overlap():
    trace = {"traceEvents": [
        _k("gemm", 0, 100), _k("gemm2", 50, 100),  # compute 0-150 (overlapping on two streams: counted once)
        _k("ncclDevKernel_AllToAll_RING", 120, 60),  # a2a 120-180: 30 under compute
        _k("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 300, 50),  # comm 300-350, alone
        _k("Memcpy DtoH", 400, 10, cat="gpu_memcpy"),  # compute-side copy 400-410
        _k("aten::_local_scalar_dense", 380, 40, cat="cpu_op"),  # host sync 380-420
        _k("cudaStreamSynchronize", 390, 20, cat="cuda_runtime"),  # nested in it: not counted twice
        _k("aten::mm", -100, 10, cat="cpu_op"),  # the window starts at -100
        {"ph": "i", "name": "marker", "ts": 10_000},  # not a span: ignored
    ]}
    b = breakdown(trace, steps=2)
    assert b.wall_ms == pytest.approx(0.52)  # -100 .. 420
    assert b.compute_ms == pytest.approx(0.16)
    assert b.a2a_ms == pytest.approx(0.06)
    assert b.comm_ms == pytest.approx(0.05)
    assert b.busy_ms == pytest.approx(0.18 + 0.05 + 0.01)
    assert b.hidden_ms == pytest.approx(0.03)
    assert b.host_sync_ms == pytest.approx(0.04)
    table = b.markdown()
    assert "| all-to-all | 0.0 | 12% |" in table  # 0.06 ms of 0.52 over 2 steps: 0.03 ms a step


@pytest.mark.parametrize("spec", ["5", "a:b", "0:3", "3:0", "1:2:3"])
def test_bad_profile_windows_are_named(spec):
    with pytest.raises(ConfigError, match="train.profile"):
        load_run_config("tiny", [f"--train.profile={spec}"])
