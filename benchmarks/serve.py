"""`anyseek serve` against `transformers serve` under concurrent streaming clients (the official `openai` client).

Per client count N: N clients each send streaming completions back to back (a random --prompt-tokens prompt,
--max-tokens new tokens, greedy, a fixed length: `ignore_eos` for anyseek, min_new_tokens for transformers) until
each has sent --rounds requests, or --level-seconds have passed: then the requests in flight are cut, and count with
the tokens they got (a peer that serves one request at a time would otherwise take many minutes per level; the table
says how many were cut and how many had no token yet, which the TTFT percentiles leave out). Measured at the client:
output tokens/s over the level (usage.completion_tokens, or the chunks of a cut request, summed / wall time), time
to first token, inter-token latency (the gaps between streamed chunks), time per output token; p50 / p99. The
clients run in several processes: the openai client parses each chunk in Python, and one process reading 64 streams
would measure itself.

The peers run one after the other on the same device and checkpoint, localhost only: `anyseek serve` and
`transformers serve --continuous-batching`. When transformers' continuous batching fails on the model (5.24's paged
cache sizes K/V by `head_dim`, but its DeepseekV3 caches the one-head MLA latent, and the first request kills its
worker), the peer is restarted without it and the table says so.

--soak S: 64 clients for S seconds against anyseek serve: random lengths, streamed and not, a third dropped mid-way
(a stream closed, a request timed out); every error other than the documented 503 is counted, and the server's page
count must return to 0. The greedy check compares one greedy answer through the server with
`anyseek generate --temperature 0` on the same folder (not with --random-weights on --peer none: no folder).

--random-weights builds the flavor with seed 0 and a word-level tokenizer (`w1 w2 ...`: one word, one token). With
--peer none the server builds it in memory (the 16B flavor's 31 GB never touch the disk); otherwise it is written
in bf16 (fp32 on the CPU) for both servers.

    python benchmarks/serve.py --flavor small --random-weights --clients 1,8,32,64 --peer transformers --soak 60
    python benchmarks/serve.py --flavor 16B --random-weights --clients 1,8,32,64 --peer none
    python benchmarks/serve.py --checkpoint runs/small --clients 1,8
    python benchmarks/serve.py --flavor tiny --random-weights --clients 1,4 --max-tokens 16 --peer none --soak 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

NAME = "bench"


# ------------------------------------------------------------------------------------------------- the checkpoint


def word_tokenizer(vocab: int, folder: Path) -> None:
    """A word-level tokenizer of exactly `vocab` ids into `folder` (id 0 is eos), as transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False}))  # fmt: skip


def random_model(flavor: str, device: str):
    """The flavor with random weights (seed 0), in bf16 on a GPU, fp32 on the CPU."""
    import torch

    from anyseek.model.config import ModelConfig
    from anyseek.model.flavors import FLAVORS
    from anyseek.model.transformer import DeepSeekV3

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DeepSeekV3(ModelConfig(**FLAVORS[flavor]), device=device, dtype=dtype).eval()


def write_random(flavor: str, folder: Path, device: str) -> None:
    """The flavor with random weights (built on the CPU) as a folder: bf16 for a GPU, fp32 for the CPU."""
    import torch

    from anyseek import hf

    model = random_model(flavor, "cpu")
    hf.save_pretrained(model, folder, dtype=torch.bfloat16 if device.startswith("cuda") else None)
    word_tokenizer(model.config.vocab_size, folder)


def serve_random(argv: list[str]) -> int:
    """(subprocess) `anyseek serve` of a random flavor built in memory: argv = FLAVOR then serve's arguments, the
    checkpoint being a folder with the tokenizer only."""
    from anyseek.infer import serve
    from anyseek.infer.layers import join_weights

    parser = argparse.ArgumentParser()
    serve.configure(parser)
    args = parser.parse_args(argv[1:])
    device = args.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
    model = random_model(argv[0], device)
    join_weights(model)  # as `loading.load_model` lays out a model it loads
    word_tokenizer(model.config.vocab_size, Path(args.checkpoint))
    return serve.serve(model, Path(args.checkpoint), args)


def prompts_for(folder: Path | None, vocab: int | None, n: int, length: int, seed: int = 0) -> list[str]:
    """n random prompts of about `length` tokens: words of the word-level tokenizer, or random ids decoded."""
    rng = random.Random(seed)
    if folder is None or vocab is not None:
        return [" ".join(f"w{rng.randrange(1, vocab)}" for _ in range(length)) for _ in range(n)]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    V = tok.get_vocab_size()
    return [tok.decode([rng.randrange(V) for _ in range(length)]) for _ in range(n)]


# ------------------------------------------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server subprocess on localhost: started, waited for, stopped with SIGTERM (its exit code kept)."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict | None = None):
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ,
                                                                                               **(env or {})})
        print(f"# {name}: {shlex.join(cmd)}", flush=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name} did not start in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 120) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_anyseek(args, folder: Path | None, work: Path, max_batch: int) -> Proc:
    port = free_port()
    flags = ["--port", str(port), "--max-batch", str(max_batch), "--served-model-name", NAME,
             *(["--device", args.device] if args.device else []), *shlex.split(args.server_args)]  # fmt: skip
    if folder is None:  # random weights in memory
        cmd = [sys.executable, __file__, "--_serve-random", args.flavor, str(work / "tokenizer"), *flags]
    else:
        cmd = [sys.executable, "-m", "anyseek", "serve", str(folder), *flags]
    p = Proc("anyseek serve", cmd, port, work / "anyseek.log")
    p.wait_ready(args.start_timeout)
    p.model = NAME
    return p


def start_transformers(args, folder: Path, work: Path, cb: bool) -> Proc:
    port = free_port()
    cmd = ["transformers", "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
           "--device", args.device or ("cuda" if _cuda() else "cpu"),
           *(["--continuous-batching"] if cb else []), *shlex.split(args.peer_args)]  # fmt: skip
    p = Proc("transformers serve" + (" --continuous-batching" if cb else ""), cmd, port,
             work / f"transformers{'-cb' if cb else ''}.log", env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    p.wait_ready(args.start_timeout)
    try:
        p.model = p.get("/v1/models")["data"][0]["id"]
    except (urllib.error.URLError, KeyError, IndexError):  # 5.17 answers 500 (it scans the hub cache): the folder
        p.model = str(folder)                              # names the model, as `transformers serve` loads it
    return p


def probe(p: Proc, extra: dict) -> str | None:
    """One short completion: None if it worked, else what went wrong."""
    body = json.dumps({"model": p.model, "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0, **extra}).encode()
    req = urllib.request.Request(p.url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
    except Exception as e:  # noqa: BLE001 - any failure is the answer
        return f"{type(e).__name__}: {e}"
    return None if out.get("choices") else str(out)[:300]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------------ clients


async def _stream_one(client, model: str, prompt: str, max_tokens: int, extra: dict, rec: dict) -> None:
    """One streamed request, its timings written into `rec` as they happen (a request cut at the level's end keeps
    what it got: `cut` stays True)."""
    rec.update(send=time.monotonic(), first=None, end=None, gaps=[], chunks=0, tokens=None, cut=True)
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body=extra)  # fmt: skip
    async for ch in stream:
        now = time.monotonic()
        if getattr(ch, "usage", None) is not None:
            rec["tokens"] = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].text:
            rec["chunks"] += 1
            if rec["first"] is None:
                rec["first"] = now
            else:
                rec["gaps"].append(now - rec["end"])
            rec["end"] = now
    rec["cut"] = False


async def _clients(url, model, n, rounds, seconds, prompts, max_tokens, extra, start, seed) -> list[dict]:
    """n clients sending `rounds` requests each, one after the other; at `seconds` the ones in flight are cut."""
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    start.wait()
    rng, records = random.Random(seed), []

    async def one_client() -> None:
        for _ in range(rounds):
            rec = {}
            records.append(rec)
            try:
                await _stream_one(client, model, rng.choice(prompts), max_tokens, extra, rec)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - counted, the level goes on
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"

    tasks = [asyncio.create_task(one_client()) for _ in range(n)]
    _, late = await asyncio.wait(tasks, timeout=seconds)
    for t in late:
        t.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    await client.close()
    return records


def _client_proc(q, *a) -> None:
    import asyncio

    q.put(asyncio.run(_clients(*a)))


def run_clients(target, fn, n: int, procs: int, *a) -> list[dict]:
    """`n` clients of `fn` spread over up to `procs` processes, released together; their records."""
    ctx = mp.get_context("spawn")
    q, start = ctx.Queue(), ctx.Event()
    shares = [n // procs + (i < n % procs) for i in range(min(procs, n))]
    ps = [ctx.Process(target=fn, args=(q, target.url, target.model, k, *a, start, 1000 + i))
          for i, k in enumerate(shares)]  # fmt: skip
    for p in ps:
        p.start()
    time.sleep(2.0)  # the processes import openai before the start
    start.set()
    out = [r for _ in ps for r in q.get()]
    for p in ps:
        p.join()
    return out


def summarize(server: str, clients: int, records: list[dict]) -> dict:
    """A level's row: output tokens/s over its wall time (usage's count; chunks for a cut request), TTFT, ITL, TPOT."""
    import numpy as np

    ok = [r for r in records if "error" not in r and r.get("first") is not None]
    errors = [r["error"] for r in records if "error" in r]
    row = {"server": server, "clients": clients, "requests": len(ok), "cut": sum(r.get("cut", False) for r in ok),
           "never_started": sum(1 for r in records if "error" not in r and r.get("first") is None),
           "errors": len(errors), "first_error": errors[0] if errors else None}  # fmt: skip
    if not ok:
        return row
    count = [r["tokens"] if r["tokens"] is not None else r["chunks"] for r in ok]
    wall = max(r["end"] for r in ok) - min(r["send"] for r in records if "send" in r)
    ttft = np.array([r["first"] - r["send"] for r in ok]) * 1e3
    itl = np.array([g for r in ok for g in r["gaps"]] or [0.0]) * 1e3
    tpot = np.array([(r["end"] - r["first"]) / (k - 1) for r, k in zip(ok, count) if k > 1 and not r["cut"]]
                    or [0.0]) * 1e3  # fmt: skip
    row.update(tok_s=sum(count) / wall, ttft_p50=float(np.percentile(ttft, 50)),
               ttft_p99=float(np.percentile(ttft, 99)), itl_p50=float(np.percentile(itl, 50)),
               itl_p99=float(np.percentile(itl, 99)), tpot_p50=float(np.percentile(tpot, 50)),
               tokens_per_request=sum(count) / len(ok))  # fmt: skip
    return row


def run_levels(target, name: str, args, levels: list[int], prompts: list[str], extra: dict) -> list[dict]:
    run_clients(target, _client_proc, min(max(levels), 8), args.client_procs, 1, 120, prompts, 16, extra)  # warm-up
    rows = []
    for c in levels:
        before = _counters(target)
        recs = run_clients(target, _client_proc, c, args.client_procs, args.rounds, args.level_seconds, prompts,
                           args.max_tokens, extra)  # fmt: skip
        rows.append(summarize(name, c, recs))
        rows[-1].update(_server_side(before, _counters(target)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _counters(target) -> dict | None:
    """anyseek serve's cumulative decode-thread counters (its /health), or None (another server)."""
    try:
        h = target.get("/health")
    except Exception:  # noqa: BLE001 - a peer without them
        return None
    return h if "round_seconds" in h else None


def _server_side(a: dict | None, b: dict | None) -> dict:
    """Over a level, from two reads of the counters: the decode thread's ms per round (a decode step, the prefills
    admitted with it, the hand-over of its tokens), ms per decode step (the host's wait for the tokens included),
    the mean decode batch, prefill seconds, and the share of the level's rounds' time in decode steps."""
    if a is None or b is None or b["rounds"] == a["rounds"]:
        return {}
    rounds, steps = b["rounds"] - a["rounds"], max(b["steps"] - a["steps"], 1)
    round_s, decode_s = b["round_seconds"] - a["round_seconds"], b["decode_seconds"] - a["decode_seconds"]
    return {"server_round_ms": 1e3 * round_s / rounds, "server_decode_ms": 1e3 * decode_s / steps,
            "server_batch": (b["decode_rows"] - a["decode_rows"]) / steps,
            "server_prefill_s": b["prefill_seconds"] - a["prefill_seconds"], "server_rounds_s": round_s}


async def _soak(url, model, n, seconds, prompts, start, seed) -> dict:
    import asyncio
    from collections import Counter

    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    start.wait()
    deadline, rng, counts = time.monotonic() + seconds, random.Random(seed), Counter()

    async def one() -> None:
        kw = {"model": model, "prompt": rng.choice(prompts), "max_tokens": rng.randint(4, 512),
              "temperature": rng.choice([0, 0.8]), "extra_body": {"ignore_eos": True}}  # fmt: skip
        drop = rng.random() < 1 / 3
        if rng.random() < 0.8:
            stream, cut, n = await client.completions.create(stream=True, **kw), rng.randint(1, 64), 0
            async for _ in stream:
                n += 1
                if drop and n >= cut:
                    await stream.close()
                    counts["dropped"] += 1
                    return
        elif drop:
            try:
                await asyncio.wait_for(client.completions.create(**kw), rng.uniform(0.05, 1.0))
            except asyncio.TimeoutError:
                counts["dropped"] += 1
                return
        else:
            await client.completions.create(**kw)
        counts["ok"] += 1

    async def loop() -> None:
        while time.monotonic() < deadline:
            try:
                await one()
            except openai.APIStatusError as e:
                counts[f"HTTP {e.status_code}"] += 1
                if e.status_code == 503:
                    await asyncio.sleep(1.0)  # the Retry-After
            except Exception as e:  # noqa: BLE001 - every other error is what the soak looks for
                counts[type(e).__name__] += 1

    await asyncio.gather(*(loop() for _ in range(n)))
    await client.close()
    return dict(counts)


def _soak_proc(q, *a) -> None:
    import asyncio

    q.put([asyncio.run(_soak(*a))])


def soak(target, args, prompts: list[str]) -> dict:
    from collections import Counter

    total = Counter()
    for part in run_clients(target, _soak_proc, 64, args.client_procs, args.soak, prompts):
        total.update(part)
    deadline, h = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        h = target.get("/health")
        if h["pages_in_use"] == h["running"] == h["waiting"] == 0:
            break
        time.sleep(0.5)
    errors = {k: v for k, v in total.items() if k not in ("ok", "dropped", "HTTP 503")}
    out = {"seconds": args.soak, "clients": 64, "counts": dict(total), "errors": errors,
           "pages_in_use_after": h.get("pages_in_use"), "running_after": h.get("running")}  # fmt: skip
    print(json.dumps({"soak": out}), flush=True)
    return out


# ---------------------------------------------------------------------------------------------------- the report


def greedy_answer(target, prompt: str, n: int) -> str:
    body = json.dumps({"model": target.model, "prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request(target.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["text"]


def greedy_check(args, folder: Path, prompt: str, served: str) -> dict:
    cmd = [sys.executable, "-m", "anyseek", "generate", str(folder), "--prompt", prompt, "--temperature", "0",
           "--max-new-tokens", "64", *(["--device", args.device] if args.device else [])]  # fmt: skip
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    cli = out.stdout.removesuffix("\n")
    first = next((i for i, (a, b) in enumerate(zip(served, cli)) if a != b), min(len(served), len(cli)))
    return {"equal": served == cli, "first_difference_at_char": None if served == cli else first,
            "served_chars": len(served), "generate_chars": len(cli)}  # fmt: skip


def table(rows: list[dict]) -> str:
    head = ("| server | clients | requests | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | "
            "tokens / request | errors |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "tok_s" not in r:
            lines.append(f"| {r['server']} | {r['clients']} | 0 | - | - | - | - | - | {r['errors']} "
                         f"({r['first_error']}) |")
            continue
        cut = f" (+{r['cut']} cut, {r['never_started']} without a token)" if r["cut"] or r["never_started"] else ""
        lines.append(f"| {r['server']} | {r['clients']} | {r['requests'] - r['cut']}{cut} | {r['tok_s']:,.0f} | "
                     f"{r['ttft_p50']:.0f} / "
                     f"{r['ttft_p99']:.0f} | {r['itl_p50']:.1f} / {r['itl_p99']:.1f} | {r['tpot_p50']:.1f} | "
                     f"{r['tokens_per_request']:.0f} | {r['errors']} |")  # fmt: skip
    inside = [r for r in rows if "server_round_ms" in r]
    if inside:  # anyseek serve's own account of the level (its /health counters)
        lines += ["", "| server | clients | decode thread: ms a round | ms a decode step | mean batch | prefill s "
                  "| rounds s |", "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['server']} | {r['clients']} | {r['server_round_ms']:.2f} | {r['server_decode_ms']:.2f} | "
                  f"{r['server_batch']:.1f} | {r['server_prefill_s']:.2f} | {r['server_rounds_s']:.1f} |"
                  for r in inside]
    ours = {r["clients"]: r for r in rows if r["server"] == "anyseek serve" and "tok_s" in r}
    peer = {r["clients"]: r for r in rows if r["server"] != "anyseek serve" and "tok_s" in r}
    if peer:
        lines += ["", "| clients | anyseek tok/s | peer tok/s | ratio |", "| --- | --- | --- | --- |"]
        for c in sorted(c for c in ours if c in peer):
            a, b = ours[c]["tok_s"], peer[c]["tok_s"]
            lines.append(f"| {c} | {a:,.0f} | {b:,.0f} | {a / b:.1f}x |")
    return "\n".join(lines)


def meta(args) -> dict:
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("torch", "triton", "transformers", "fastapi", "uvicorn", "openai"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None  # fmt: skip
    device = torch.cuda.get_device_name() if _cuda() and args.device != "cpu" else f"cpu ({os.cpu_count()} cores)"
    return {"device": device, "date": time.strftime("%Y-%m-%d"), "commit": commit, **versions,
            "checkpoint": args.checkpoint or f"{args.flavor}, random weights", "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "server_args": args.server_args}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- main


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a model folder (or run folder) with its tokenizer")
    src.add_argument("--flavor", help="tiny, small, 16B: with --random-weights")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--clients", default="1,8,32,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="requests per client per level (at most)")
    ap.add_argument("--level-seconds", type=float, default=60,
                    help="a level's cap: requests still in flight then are cut (their tokens so far count)")
    ap.add_argument("--peer-clients", type=lambda s: [int(x) for x in s.split(",")],
                    help="client counts for the peer (default: --clients)")
    ap.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    ap.add_argument("--soak", type=float, default=0, help="seconds of 64 clients with disconnects (0: none)")
    ap.add_argument("--device", help="cuda (default when there is one) or cpu")
    ap.add_argument("--server-args", default="", help="more `anyseek serve` flags")
    ap.add_argument("--peer-args", default="", help="more `transformers serve` flags")
    ap.add_argument("--client-procs", type=int, default=8)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", help="folder for serve.json and serve.md")
    args = ap.parse_args()
    if args.flavor and not args.random_weights:
        ap.error("--flavor needs --random-weights")
    return args


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_serve-random":
        return serve_random(sys.argv[2:])
    args = parse()
    work = Path(tempfile.mkdtemp(prefix="anyseek-serve-bench-"))
    info = meta(args)
    print(json.dumps(info), flush=True)
    report = {"meta": info, "rows": [], "notes": []}
    try:
        run(args, work, report)
    finally:
        print("\n" + table(report["rows"]))
        for note in report["notes"]:
            print(f"\nnote: {note}")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "serve.json").write_text(json.dumps(report, indent=1))
            (out / "serve.md").write_text(table(report["rows"]) + "\n")
            for log in work.glob("*.log"):
                shutil.copy2(log, out / log.name)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run(args, work: Path, report: dict) -> None:
    device = args.device or ("cuda" if _cuda() else "cpu")
    folder, vocab = (Path(args.checkpoint) if args.checkpoint else None), None
    if args.random_weights:
        from anyseek.model.flavors import FLAVORS

        vocab = FLAVORS[args.flavor]["vocab_size"]
        if args.peer != "none":
            folder = work / "model"
            write_random(args.flavor, folder, device)
    prompts = prompts_for(folder, vocab, 64, args.prompt_tokens)
    ours = start_anyseek(args, folder, work, max(max(args.clients), 64 if args.soak else 1))
    try:
        served = greedy_answer(ours, prompts[0], 64)
        report["rows"] += run_levels(ours, "anyseek serve", args, args.clients, prompts, {"ignore_eos": True})
        if args.soak:
            report["soak"] = soak(ours, args, prompts)
    finally:
        report["anyseek_exit_code_after_sigterm"] = ours.stop()
    if folder is not None:
        report["greedy_equals_generate"] = greedy_check(args, folder, prompts[0], served)
        print(json.dumps({"greedy_equals_generate": report["greedy_equals_generate"]}), flush=True)
    if args.peer == "transformers":
        # its way to a fixed length (it refuses unknown fields such as ignore_eos): min_new_tokens in generation_config
        extra = {"generation_config": json.dumps({"do_sample": False, "max_new_tokens": args.max_tokens,
                                                  "min_new_tokens": args.max_tokens})}  # fmt: skip
        peer = start_transformers(args, folder, work, cb=True)
        failed = probe(peer, extra)
        if failed:
            peer.stop()
            report["notes"].append(f"transformers serve --continuous-batching failed on this model ({failed}); the "
                                   "peer ran without continuous batching")  # fmt: skip
            peer = start_transformers(args, folder, work, cb=False)
        try:
            report["rows"] += run_levels(peer, peer.name, args, args.peer_clients or args.clients, prompts, extra)
        finally:
            peer.stop()


if __name__ == "__main__":
    sys.exit(main())
