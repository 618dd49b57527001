"""Rough edges a new user hits on a fresh clone (issue 38): each CLI mistake gives one clear line, each surprise
(a context limit hit, a slow speculation, a run too big or too long for the machine) is said once."""

from __future__ import annotations

import itertools
import json
import sys

import pytest

from anyseek.cli import main


def cli(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `anyseek ARGS`; argparse's own errors (SystemExit) count as an exit code."""
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("args, needle", [
    (["--gpus", "0"], "argument --gpus: expected a whole number of GPUs >= 1, got 0"),
    (["--gpus", "-4"], "argument --gpus"),
    (["--gpus", "2.5"], "argument --gpus"),
    (["--tokens-per-gpu", "-5"], "argument --tokens-per-gpu"),
    (["--gpu-memory", "0"], "argument --gpu-memory"),
    (["--gpu-memory", "nan"], "argument --gpu-memory"),
])  # fmt: skip
def test_plan_refuses_numbers_that_make_no_sense(capsys, args, needle):
    rc, out, err = cli(capsys, "plan", *args)
    assert rc == 2 and needle in err and "Traceback" not in err and "suggested" not in out, (args, out, err)


def test_plan_still_plans(capsys):
    rc, out, err = cli(capsys, "plan", "--gpus", "2", "--tokens-per-gpu", "128")
    assert rc == 0 and "on 2 GPUs" in out and "128 tokens/GPU" in out and "suggested" in out, err


WORDS = ["the", "cat", "dog", "sat", "ran", "on", "over", "a", "mat", "tree", "and", "then", "it", "was", "red",
         "blue", "small", "big", "river", "king"]  # fmt: skip
CONTEXT = 96  # the trained model's max_position_embeddings: small, so a prompt can fill it


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run folder, data folder) after 2 steps of a 2-layer tiny model with a 96-token context."""
    import random

    from anyseek.data.prepare import prepare
    from anyseek.train.config import load_run_config
    from anyseek.train.trainer import Trainer

    root = tmp_path_factory.mktemp("new_user")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(150)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = root / "prepared"
    prepare(source=str(root / "docs.jsonl"), out=data, vocab_size=300, val_fraction=0.1, progress=False)
    cfg = load_run_config("tiny", [f"--data.path={data}", "--data.tokens_per_batch=256", "--data.max_seqlen=64",
                                   "--model.num_hidden_layers=2", f"--model.max_position_embeddings={CONTEXT}",
                                   "--train.max_steps=2", "--train.eval_every=1000", "--train.eval_tokens=300",
                                   "--train.sample_tokens=2", "--train.threads=1", "--train.tensorboard=false"])
    Trainer(cfg, root / "run", log=lambda s: None).run()
    return root / "run", data


def test_generate_says_when_the_context_ends_it(trained, capsys, tmp_path):
    from tokenizers import Tokenizer

    run, _ = trained
    prompt = "the cat sat on a mat " * 8
    n = len(Tokenizer.from_file(str(run / "step-2" / "tokenizer.json")).encode(prompt).ids)
    assert 50 < n < CONTEXT - 10, n
    rc, _, err = cli(capsys, "generate", str(run), "--prompt", prompt, "--temperature", "0",
                     "--max-new-tokens", "50")  # fmt: skip
    assert rc == 0, err
    # the model may end early at an end-of-text token; it did not here (checked once: 2 steps of training)
    want = f"note: stopped after {CONTEXT - n} of --max-new-tokens 50 new tokens"
    assert want in err and f"context of {CONTEXT} tokens" in err, err
    rc, _, err = cli(capsys, "generate", str(run), "--prompt", "the cat", "--max-new-tokens", "5")
    assert rc == 0 and "note:" not in err, err  # ended by --max-new-tokens: nothing to say
    prompts = tmp_path / "p.jsonl"
    long = json.dumps({"prompt_ids": [5] * (CONTEXT - 3)})
    prompts.write_text(long + '\n{"prompt_ids": [5, 6]}\n')
    rc, _, err = cli(capsys, "generate", str(run), "--prompts", str(prompts), "--max-new-tokens", "4",
                       "--temperature", "0")  # fmt: skip
    assert rc == 0 and "note: 1 of 2 prompts stopped before --max-new-tokens 4" in err, err
    assert "fewest new tokens 3" in err, err


def test_speculation_on_the_cpu_warns_once(trained, capsys):
    run, _ = trained
    rc, _, err = cli(capsys, "generate", str(run), "--prompt", "the cat", "--max-new-tokens", "4", "--speculative",
                     "mtp", "--device", "cpu")  # fmt: skip
    assert rc == 0 and err.count("--speculative mtp is 3-6x slower on the CPU") == 1, err
    rc, _, err = cli(capsys, "generate", str(run), "--prompt", "the cat", "--max-new-tokens", "4", "--device", "cpu")
    assert rc == 0 and "slower" not in err, err


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA H800 PCIe", 756.0),
    ("NVIDIA H20", 148.0), ("NVIDIA B200", 2250.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA A10G", None), ("NVIDIA L40S", 362.0),
    ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA GeForce RTX 4090", 165.2),
    ("NVIDIA GeForce RTX 5090", 209.5), ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 503.8),
    ("NVIDIA RTX 6000 Ada Generation", 364.2), ("NVIDIA RTX A6000", 154.8), ("Tesla T4", None),
])  # fmt: skip
def test_mfu_peak_is_the_skus_dense_bf16_peak(name, tflops):
    """Datasheet dense bf16 tensor-core figures (half the sparse one); not the SXM H100's for a PCIe or NVL card."""
    from anyseek.train.metrics import peak_tflops

    assert peak_tflops(name) == tflops


def test_tensorboard_asked_for_but_missing_is_said_once(tmp_path, monkeypatch):

    from anyseek.train.metrics import MetricsLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as where tensorboard is not installed
    said: list[str] = []
    log = MetricsLog(tmp_path, tensorboard=True, log=said.append)
    log.write("train", 1, {"loss": 1.0})
    log.close()
    assert len(said) == 1 and "tensorboard is not installed" in said[0] and "--train.tensorboard=false" in said[0]
    MetricsLog(tmp_path, tensorboard=False, log=said.append).close()
    assert len(said) == 1  # not asked for: nothing to say


def test_init_names_the_output_folder_after_the_model(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from anyseek.train import trainer
    from anyseek.train.cli import default_out

    class Recorder:  # stands in for the Trainer: where `anyseek train` would write
        def __init__(self, cfg, out, **kw):
            seen.append(out)

        def run(self):
            return {}

        def close(self):
            pass

    seen: list[Path] = []
    monkeypatch.setattr(trainer, "Trainer", Recorder)
    monkeypatch.chdir(tmp_path)

    (tmp_path / "Moonlight-16B-A3B").mkdir()
    (tmp_path / "r1" / "step-1500").mkdir(parents=True)
    assert default_out("tiny", None) == Path("runs/tiny")
    assert default_out("configs/mine.toml", None) == Path("runs/mine")
    assert default_out("tiny", str(tmp_path / "Moonlight-16B-A3B") + "/") == Path("runs/Moonlight-16B-A3B")
    assert default_out("tiny", str(tmp_path / "r1" / "step-1500")) == Path("runs/r1-step-1500")
    rc, _, err = cli(capsys, "train", "--init", "Moonlight-16B-A3B")
    assert rc == 0 and seen == [Path("runs/Moonlight-16B-A3B")], err


def test_a_failed_rank_is_its_own_error_and_one_line(tmp_path):
    """Two gloo ranks that both refuse the config: each rank's `error:` line, then one line naming the ranks;
    nothing of torchrun's report (its launcher traceback, its table of failures); the ranks' exit status (2)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "anyseek", "train", "--nproc-per-node", "2", "--parallel.ep=3",
           "--out", str(tmp_path / "run"), "--train.max_steps=1"]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines.count("error: parallel.ep=3 must divide the number of ranks (2)  (--debug shows the traceback)") == 2
    assert lines[-1].startswith("anyseek train: ranks 0, 1 failed (first: rank"), proc.stderr
    assert len(lines) == 4 and "Traceback" not in proc.stderr and "Root Cause" not in proc.stderr, proc.stderr


def test_a_library_warning_is_one_line_on_the_command_line(trained, tmp_path):
    """A folder whose config.json asks for more MTP layers than it holds (as every folder transformers saves): the
    command says so in one `warning:` line, not with Python's source file, line and code echo."""
    import os
    import shutil
    import subprocess

    run, _ = trained
    folder = tmp_path / "more_mtp"
    shutil.copytree(run / "step-2", folder)
    (folder / "checkpoint.json").unlink()  # a plain model folder (a changed step-N would be refused as damaged)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    cmd = [sys.executable, "-m", "anyseek", "generate", str(folder), "--prompt", "the", "--max-new-tokens", "1"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "MTP layers" in line]
    want = (f"warning: {folder}: config.json asks for 2 MTP layers but the checkpoint holds 1 (no model.layers.3.*); "
            "loading with num_nextn_predict_layers=1")
    assert said == [want], proc.stderr
    assert "UserWarning" not in proc.stderr and ".py:" not in proc.stderr, proc.stderr


def test_balance_on_the_progress_line_is_per_moe_layer():
    """The balance loss is 1.0 per MoE layer at a perfectly even load (DeepSeek-V3's sequence-wise loss, worked by
    hand), the model sums it over its MoE layers (MTP's included: 4.0 for tiny at init), and the line divides."""
    import io

    import torch

    from anyseek.model.config import ModelConfig
    from anyseek.model.layout import PackedLayout
    from anyseek.model.moe import sequence_balance_loss
    from anyseek.model.transformer import DeepSeekV3
    from anyseek.train.metrics import TrainProgress

    # E=4 experts, K=2, one document of 4 tokens, each expert picked twice, equal scores:
    # f_e = E / (K L) * hits_e = 4 / 8 * 2 = 1, P_e = 1/4, sum_e f_e P_e = 1
    layout = PackedLayout.build(torch.tensor([0, 4]), 4)
    even = sequence_balance_loss(torch.ones(4, 4), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), layout)
    assert even.item() == pytest.approx(1.0)
    cfg = ModelConfig.from_name("tiny", vocab_size=64)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) + cfg.num_nextn_predict_layers
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (256,))
    out = DeepSeekV3(cfg)(ids, cu_seqlens=torch.tensor([0, 256]), targets=ids.roll(-1), max_seqlen=256)
    assert n_moe == 4 and out.balance_loss.item() == pytest.approx(n_moe, rel=0.05)  # near-even routing at init
    stream = io.StringIO()
    TrainProgress(10, stream=stream, every=1, balance_layers=n_moe).update(1, 5.0, 100.0, {"balance": 4.0044})
    assert " balance 1.001 " in stream.getvalue(), stream.getvalue()


def test_loss_plot_axes_are_linear_with_room_and_the_title_is_short(tmp_path, monkeypatch):

    from anyseek.train import plot

    assert plot.short_title("tiny on /home/me/data/enwiki/") == "tiny on enwiki"
    assert plot.short_title("small on corpus/*.jsonl") == "small on corpus"
    assert plot.short_title("tiny on wiki-sample") == "tiny on wiki-sample"
    train = [(s, 4.0 + 8.0 / s) for s in range(10, 1001, 10)]
    val = [(250, 4.1), (500, 4.05), (1000, 3.9)]  # the last validation point is the lowest and the last
    img = plot._draw(train, val, "")
    red = [(x, y) for y in range(plot.MARGIN_T + 40, plot.H) for x in range(plot.W)
           if img[y][3 * x: 3 * x + 3] == bytes((214, 39, 40))]  # fmt: skip
    last = [(x, y) for x, y in red if x > plot.W - plot.MARGIN_R - 40]
    assert len(last) == 49, last  # the whole 7x7 square ...
    assert max(y for _, y in last) < plot.H - plot.MARGIN_B - 1 and max(x for x, _ in last) < plot.W - plot.MARGIN_R
    # ... inside the frame; the x axis is linear: tick marks at 0, 250, ..., 1000 evenly spaced
    assert plot.ticks(0, 1000) == [0, 250, 500, 750, 1000]
    marks = [x for x in range(plot.W) if img[plot.H - plot.MARGIN_B + 3][3 * x] == 0]
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    assert len(marks) == 5 and marks[0] == plot.MARGIN_L and max(gaps) - min(gaps) <= 1, marks
    titles = []
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the built-in drawing, as on a fresh machine
    monkeypatch.setattr(plot, "_draw", lambda t, v, title: titles.append(title) or [bytearray(3 * plot.W)])
    plot.write_loss_curve(tmp_path / "loss.png", train, val, "tiny on /home/me/data/enwiki")
    assert titles == ["tiny on enwiki"]


def test_the_python_snippet_in_docs_inference_runs(trained, capsys, tmp_path):
    """docs/inference.md's Python block, run as written on a tiny checkpoint in place of runs/tiny/step-1000."""
    import re
    import runpy
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "inference.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL) if "load_pretrained" in c]
    assert "runs/tiny/step-1000" in code  # (the openai block runs in tests/test_serve.py)
    run, _ = trained
    script = tmp_path / "snippet.py"
    script.write_text(code.replace("runs/tiny/step-1000", str(run / "step-2")))
    runpy.run_path(str(script))
    tokens_per_second, acceptance = capsys.readouterr().out.split()
    assert float(tokens_per_second) > 0 and 0 <= float(acceptance) <= 1


# The peak from /proc's VmHWM, not getrusage's ru_maxrss: Linux carries the parent's resident size at the fork into
# the child's ru_maxrss across the exec (here: the pytest process, 1.8 GiB late in the suite).
_PEAK_SCRIPT = """
import json, sys
from pathlib import Path
from anyseek.train.config import load_run_config
from anyseek.train.trainer import Trainer
said = []
cfg = load_run_config("tiny", sys.argv[2:])
Trainer(cfg, Path(sys.argv[1]), log=said.append).run()
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"said": said, "peak_kib": int(hwm.split()[1])}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc")
def test_cpu_memory_estimate_is_within_10_percent_of_the_peak_rss(trained, tmp_path):
    """Two steps of the tiny flavor at its 4,096 tokens per step, in a process of their own (the CPU trainer's
    first steps, an evaluation, a checkpoint and a sample): its peak resident memory against what the run printed
    first. Before the CPU terms the estimate said 0.30 GiB for what peaks at ~0.76 (the process itself, the CPU
    kernels' saved tensors, the optimizer step's buffer)."""
    import os
    import re
    import subprocess

    _, data = trained
    args = [f"--data.path={data}", "--data.tokens_per_batch=4096", "--data.max_seqlen=512", "--train.max_steps=2",
            "--train.eval_tokens=2048", "--train.sample_tokens=2", "--train.tensorboard=false"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "run"), *args], check=False,
                          capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    said = "\n".join(result["said"])
    estimate = float(re.search(r"expected peak memory ([\d.]+) GiB", said).group(1))
    peak = result["peak_kib"] / 2**20
    assert abs(estimate / peak - 1) < 0.10, (estimate, peak, said)
    assert re.search(r"^time: about \d+ (s|min) for 2 steps on this CPU", said, flags=re.MULTILINE), said


def test_a_run_of_days_on_the_cpu_is_said_before_it_starts():
    """`small`'s 5,000 steps of 8,192 tokens at ~0.9 GFLOP per token (6 x its ~150M active weights) on a CPU
    matmul of 150 GFLOP/s at 40%: ~8 days, a warning; `tiny`'s 1,000 steps: minutes, no warning."""
    from anyseek.train.config import load_run_config
    from anyseek.train.memory import duration

    small = load_run_config("small", [])
    lines = duration(small.model_config(vocab_size=32000), small, 100, 150e9)
    days = 5000 * 8192 * 0.88e9 / (0.4 * 150e9) / 86400
    assert len(lines) == 2 and lines[1].startswith("warning: this run would take about"), lines
    assert abs(float(lines[1].split("about ")[1].split(" days")[0]) / days - 1) < 0.05, (lines, days)
    tiny = load_run_config("tiny", [])
    (line,) = duration(tiny.model_config(vocab_size=4096), tiny, 135, 150e9)
    assert line.startswith("time: about ") and " min for 1,000 steps on this CPU" in line, line


def test_the_cpu_report_leaves_the_random_stream_alone():
    """The report runs before the model is built: drawing from torch's global generator (the matmul it times) would
    change every CPU run's initial weights, and make a one-process run differ from the same run under torchrun
    (which skips the report)."""
    import torch

    from anyseek.train import memory
    from anyseek.train.config import load_run_config

    cfg = load_run_config("tiny", [])
    torch.manual_seed(0)
    memory.report(cfg.model_config(vocab_size=4096), cfg, torch.device("cpu"), None, torch.float32, lambda s: None)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))
