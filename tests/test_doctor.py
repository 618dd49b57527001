import subprocess
import sys

import pytest

from anyseek import doctor


def test_report_names_the_machine_and_backends():
    text = "\n".join(doctor.report("cpu"))
    for word in ("OS", "Python", "PyTorch", "Triton", "mla_attention", "varlen_attention", "bmm"):
        assert word in text


@pytest.mark.slow
def test_check_passes_on_cpu():
    out = subprocess.run(
        [sys.executable, "-m", "anyseek", "doctor", "--check", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS  mla_attention    sdpa" in out.stdout
    assert "FAIL" not in out.stdout
