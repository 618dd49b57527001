"""Plain helpers that several test modules share (their fixtures are in conftest.py).

Imported one way only, `from helpers import ...`: pytest puts tests/ on sys.path (no __init__.py there), and so do
the processes the tests start (a script's folder; `spawn` hands its parent's sys.path over). A test module never
imports another test module: each would be loaded a second time under another name, fixtures and all
(tests/test_imports.py checks it).

- training runs on the tiny flavor: `tiny_cfg`, `run`, `final_state`, `train_losses`
- ranks as processes: `spawn`, and `train_ranks` (a whole run on each rank, the runs of the `STEPS` settings)
- the overlap's instruments: `batch_key`, `poison`, `count_halts`, `fused_adamw`
- the Hugging Face round trip: `TINY`, `tiny_model`, `token_ids`, `our_logits`, `hf_load`, `assert_logits_close`
- runs that start from a base model (`--init`, LoRA): `write_docs`, `base_model_cfg`, `vocab_of`, `init_cfg`,
  `first_batch`, `train_rows`
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

from anyseek.train.config import load_run_config
from anyseek.train.metrics import read_metrics
from anyseek.train.trainer import Trainer

# ----------------------------------------------------------------------------------------------------- training runs

# the words of the `data_dir` corpus (conftest.py)
WORDS = ["the", "cat", "dog", "bird", "sat", "ran", "flew", "on", "over", "under", "a", "mat", "tree", "roof", "quickly",
         "slowly", "and", "then", "it", "was", "red", "blue", "green", "small", "big", "river", "stone", "city", "king",
         "queen", "north", "south"]  # fmt: skip


def tiny_cfg(data_dir: Path, *overrides: str):
    """The run config of the training tests on `data_dir`: the tiny flavor with 2 layers, 256-token batches of at
    most 64, a log row every step, no TensorBoard; `overrides` as on the command line."""
    base = [f"--data.path={data_dir}", "--data.tokens_per_batch=256", "--data.max_seqlen=64",
            "--model.num_hidden_layers=2", "--train.warmup_steps=2", "--train.lr=3e-3", "--train.log_every=1",
            "--train.eval_every=1000", "--train.eval_tokens=512", "--train.sample_tokens=5", "--train.threads=1",
            "--train.tensorboard=false"]
    return load_run_config("tiny", base + list(overrides))


def run(cfg, out: Path, resume: bool = False) -> dict:
    """One quiet training run into `out` -> its summary."""
    return Trainer(cfg, out, resume=resume, log=lambda s: None).run()


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of a run's folder at tmp_path/run (for a test that changes it)."""
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def final_state(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The weights a one-process run saved at `step`."""
    from safetensors.torch import load_file

    return load_file(str(out / f"step-{step}" / "model.safetensors"))


def train_losses(out: Path) -> dict[int, float]:
    """step -> loss of a run's training rows."""
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


# ------------------------------------------------------------------------------------------------ ranks as processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, target, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    code = 1
    try:
        target(*args)
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        # Leave without running C++ static destructors: gloo's threads at interpreter exit sometimes abort the process
        # ("terminate called without an active exception", exit -6) after its work is done and written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def spawn(target, *args, world: int = 2, timeout: float = 120) -> list[int]:
    """Run target(*args) on `world` ranks (torchrun's variables set, gloo's rendezvous on a free port); return their
    exit codes (killing any still alive after `timeout`). `target` must be a module-level function: each rank
    imports its module afresh."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, target, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


N, EVERY = 20, 4  # steps per run, and a checkpoint every EVERY steps (the last three kept)
LAST, PREV = f"step-{N}", f"step-{N - EVERY}"
# Without clipping: the sharded and the one-process runs sum the gradient norm in different orders, and over N steps
# that rounding in the clip factor can flip a near-tied top-k choice, far beyond rel 1e-5 (seen with train.seed=2, and
# with seed 0 once the balance loss became the step's segment mean); unclipped, 2 ranks and 1 process are bit-identical.
STEPS = [f"--train.max_steps={N}", f"--train.save_every={EVERY}", "--train.keep_last=3",
         "--model.bias_update_speed=0.01", "--train.grad_clip=0"]


def train_ranks(data: str, out: str, overrides: list[str], resume: bool) -> None:
    """One rank's whole run (a `spawn` target); the main rank also writes the routing biases (biases.json) and how
    the step ran (graphs.json: graphs note and replays, overlap, the weights' note)."""
    trainer = Trainer(tiny_cfg(Path(data), *overrides), Path(out), resume=resume, log=lambda s: None)
    trainer.run()
    if trainer.par.env.is_main:
        biases = [m.gate.e_score_correction_bias.tolist() for m in trainer.model.moe_layers()]
        (Path(out) / "biases.json").write_text(json.dumps(biases))
        replays = trainer.graphs.replays if trainer.graphs is not None else 0
        (Path(out) / "graphs.json").write_text(json.dumps({"note": trainer.engine.graphs_note, "replays": replays,
                                                           "overlap": trainer.overlap,
                                                           "weights": trainer.working_note,
                                                           "overflows": trainer.engine.overflows,
                                                           "fixed_from": trainer.engine.fixed_from}))
    trainer.close()  # as `anyseek train` does: the graphs before the process group (`_entry` destroys it)


# ----------------------------------------------------------------------------------------- the overlap's instruments


def batch_key(ids: torch.Tensor) -> tuple:
    """A micro-batch recognised by its first tokens."""
    return tuple(ids[:48].tolist())


def poison(monkeypatch, keys: set) -> None:
    """A NaN loss (and so NaN gradients) for the training micro-batches whose first tokens are in `keys`."""
    from anyseek.model.transformer import DeepSeekV3

    real = DeepSeekV3.forward

    def forward(self, input_ids, *args, **kwargs):
        out = real(self, input_ids, *args, **kwargs)
        if self.training and batch_key(input_ids) in keys:
            out.lm_loss = out.lm_loss * float("nan")
        return out

    monkeypatch.setattr(DeepSeekV3, "forward", forward)


def count_halts(monkeypatch) -> list[bool]:
    """The `halted` flag of every step the trainer settles from now on (True: a step queued behind a bad one, run
    again), appended to the returned list."""
    from anyseek.train.step import StepEngine

    real_settle, halts = StepEngine._settle, []

    def settle(self, item, halted=False):
        halts.append(halted)
        return real_settle(self, item, halted)

    monkeypatch.setattr(StepEngine, "_settle", settle)
    return halts


def fused_adamw(model, cfg, device, masters=None):
    """build_optimizer's groups, fused (the CUDA optimizer; torch has a fused CPU kernel too)."""
    assert masters is None, "fused AdamW updates the weights themselves (fp32 shards)"
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=True)  # fmt: skip


# ------------------------------------------------------------------------------------------- Hugging Face round trip

TINY = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "q_lora_rank": 32,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "num_nextn_predict_layers": 1, "init_std": 0.1,
}  # fmt: skip


def tiny_model(seed: int = 0, **overrides):
    """Random tiny model with non-trivial norms and routing biases (so a dropped tensor changes the logits)."""
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3

    torch.manual_seed(seed)
    model = DeepSeekV3(ModelConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0, 0.1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def token_ids(seed: int = 1) -> torch.Tensor:
    """[2, 13] random token ids of the TINY vocabulary."""
    return torch.randint(0, TINY["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    err, scale = (a.float() - b.float()).abs().max().item(), b.abs().max().item()
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} * max |logit| {scale:.3g}"


@torch.no_grad()
def our_logits(model, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits


def hf_load(folder):
    """transformers' model from `folder` in fp32, eval mode -> (model, loading info)."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


# ------------------------------------------------------------------------------------------------- from a base model

# the words of the `base_data` corpus (conftest.py); its batches
BASE_WORDS = ["the", "cat", "dog", "bird", "sat", "ran", "on", "over", "a", "mat", "tree", "roof", "and", "then", "it",
              "was", "red", "blue", "small", "big", "river", "stone"]  # fmt: skip
TOKENS, SEQ = 256, 64


def write_docs(folder: Path, n: int, seed: int) -> Path:
    """folder/docs.jsonl: n documents of six short sentences of BASE_WORDS."""
    rng = random.Random(seed)
    lines = [json.dumps({"text": f"Doc {i}. " + " ".join(
        " ".join(rng.choice(BASE_WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "." for _ in range(6))})
        for i in range(n)]
    src = folder / "docs.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return src


def base_model_cfg(vocab: int, **kw):
    """The base model's config: the tiny flavor with 2 layers and larger initial weights."""
    from anyseek.model.config import ModelConfig

    return ModelConfig.from_name("tiny", vocab_size=vocab, num_hidden_layers=2, init_std=0.05, **kw)


def vocab_of(data_dir: Path) -> int:
    """The vocabulary size of a prepared corpus."""
    return json.loads((data_dir / "manifest.json").read_text())["vocab_size"]


def init_cfg(data_dir: Path, *overrides: str):
    """The run config of the tests around a base model: the tiny flavor on the CPU, TOKENS-token batches of at most
    SEQ, a log row every step, no TensorBoard; `overrides` as on the command line."""
    base = [f"--data.path={data_dir}", f"--data.tokens_per_batch={TOKENS}", f"--data.max_seqlen={SEQ}",
            "--train.warmup_steps=1", "--train.log_every=1", "--train.eval_every=1000", "--train.eval_tokens=256",
            "--train.sample_tokens=2", "--train.threads=1", "--train.tensorboard=false", "--train.device=cpu"]
    return load_run_config("tiny", base + list(overrides))


def first_batch(data_dir: Path):
    """The first training batch a run of `init_cfg` reads."""
    from anyseek.data.loader import PackedLoader

    return next(iter(PackedLoader(data_dir, split="train", tokens_per_batch=TOKENS, max_seqlen=SEQ, seed=0,
                                  loop=True)))


def train_rows(out: Path) -> list[dict]:
    """A run's training rows."""
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
