"""`anyseek generate` and `anyseek eval` end to end on a tiny checkpoint trained in the test: the CLI prints what the
Python API returns, eval reports the trainer's validation loss, bad input gives one clear line and no traceback."""

from __future__ import annotations

import json
import random
import shutil
import sys

import pytest
import torch

from anyseek.cli import main

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "over", "a", "mat", "tree", "and", "then", "it", "was", "red",
         "blue", "small", "big", "river", "king"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run folder, data folder, trainer summary) after 4 steps of a 2-layer tiny model."""
    from anyseek.data.prepare import prepare
    from anyseek.train.config import load_run_config
    from anyseek.train.trainer import Trainer

    root = tmp_path_factory.mktemp("cli")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(150)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = root / "prepared"
    prepare(source=str(root / "docs.jsonl"), out=data, vocab_size=300, val_fraction=0.1, progress=False)
    cfg = load_run_config("tiny", [f"--data.path={data}", "--data.tokens_per_batch=256", "--data.max_seqlen=64",
                                   "--model.num_hidden_layers=2", "--train.max_steps=4", "--train.eval_every=1000",
                                   "--train.eval_tokens=300", "--train.sample_tokens=4", "--train.threads=1",
                                   "--train.tensorboard=false", "--train.log_every=1"])  # fmt: skip
    summary = Trainer(cfg, root / "run", log=lambda s: None).run()
    return root / "run", data, summary


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_prints_what_the_api_returns(trained, capsys):
    import anyseek
    from anyseek.infer import loading

    run, _, _ = trained
    rc, out, err = cli(capsys, "generate", str(run), "--prompt", "the cat sat", "--temperature", "0",
                       "--max-new-tokens", "12")  # fmt: skip
    assert rc == 0, err
    folder = loading.resolve(run)
    tok, eos = loading.load_tokenizer(folder)
    model = loading.load_model(folder, "cpu")
    want = anyseek.generate(model, "the cat sat", max_new_tokens=12, temperature=0, tokenizer=tok, eos_token_id=eos)
    assert out == want + "\n"
    assert "tokens/s" in err and "parameters" in err
    rc, out_spec, err = cli(capsys, "generate", str(folder), "--prompt", "the cat sat", "--temperature", "0",
                            "--max-new-tokens", "12", "--speculative", "mtp")  # fmt: skip
    assert rc == 0 and out_spec == out and "MTP acceptance" in err


def test_generate_batch_file(trained, capsys, tmp_path):
    run, _, _ = trained
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the dog", "id": 1}\n"a big river"\n{"prompt_ids": [5, 6, 7]}\n')
    out = tmp_path / "o.jsonl"
    rc, _, err = cli(capsys, "generate", str(run), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens",
                     "6", "--seed", "3", "--top-p", "0.9", "--stop", "zzz")  # fmt: skip
    assert rc == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("id") for r in rows] == [1, None, None] and rows[1]["prompt"] == "a big river"
    assert all(len(r["completion_ids"]) <= 6 and r["finish_reason"] in ("length", "eos") for r in rows)


def test_eval_reports_the_trainers_validation_loss(trained, capsys):
    run, data, summary = trained
    rc, out, err = cli(capsys, "eval", str(run), "--data", str(data))
    assert rc == 0, err
    result = json.loads(out)
    assert abs(result["loss"] - summary["val_loss"]) < 1e-5, (result, summary["val_loss"])
    assert result["tokens"] >= 300 and result["tokens_per_s"] > 0 and result["perplexity"] > 1


def test_bad_input_is_one_clear_line(trained, capsys, tmp_path):
    run, data, _ = trained
    no_tok = tmp_path / "no_tok"  # a model folder without its tokenizer
    shutil.copytree(run / "step-4", no_tok, ignore=shutil.ignore_patterns("checkpoint.json", "tokenizer.json"))
    step_no_tok = tmp_path / "damaged" / "step-4"  # a checkpoint that lost a file its checkpoint.json lists
    shutil.copytree(run / "step-4", step_no_tok, ignore=shutil.ignore_patterns("tokenizer.json"))
    cases = [
        (["generate", str(tmp_path / "missing"), "--prompt", "x"], "no such folder"),
        (["generate", str(tmp_path), "--prompt", "x"], "is not a checkpoint"),
        (["generate", str(no_tok), "--prompt", "x"], "no tokenizer.json"),
        (["generate", str(step_no_tok), "--prompt", "x"], "missing tokenizer.json"),
        (["generate", str(run), "--prompt", "  "], "empty prompt"),
        (["generate", str(run), "--prompt", "the cat " * 1500], "does not fit the context"),
        (["generate", str(run), "--prompt", "x", "--top-p", "0"], "top_p"),
        (["eval", str(run), "--data", str(tmp_path)], "not a prepared data folder"),
        (["eval", str(run), "--data", str(data), "--split", "nope"], "split"),
    ]
    for args, msg in cases:
        rc, _, err = cli(capsys, *args)
        assert rc == 2 and msg in err and "Traceback" not in err, (args, err)


def test_generate_cli_loads_on_cpu_in_fp32(trained):
    from anyseek.infer import loading

    model = loading.load_model(loading.resolve(trained[0]), "cpu")
    assert model.lm_head.weight.dtype == torch.float32 and not model.training


def test_serve_without_its_extra_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if FastAPI were not installed
    rc, _, err = cli(capsys, "serve", str(tmp_path))
    assert rc == 2 and "pip install 'anyseek[serve]'" in err and "Traceback" not in err, err
