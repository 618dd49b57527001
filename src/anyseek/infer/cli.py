"""`anyseek generate CHECKPOINT --prompt TEXT | --prompts FILE.jsonl [--out FILE.jsonl] | --interactive`

Streams the continuation to stdout as it is produced; status lines go to stderr. Greedy with --temperature 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a step-N folder, a run folder (its newest checkpoint) or a Hugging Face "
                                           "DeepseekV3 folder with tokenizer.json")  # fmt: skip
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text to continue")
    src.add_argument("--prompts", help='JSONL file: one {"prompt": TEXT} (or {"prompt_ids": [...]}) per line')
    src.add_argument("--interactive", action="store_true", help="read prompts from stdin, one per line")
    parser.add_argument("--out", help="with --prompts: write one JSON result per line here (default: stdout)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (deterministic)")
    parser.add_argument("--top-k", type=int, default=40, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--speculative", choices=["mtp"], help="draft with the model's MTP module")
    parser.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (--prompts)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the GPU if any)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on a GPU, fp32 on the CPU")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from anyseek.infer.loading import CLIError

    try:
        return _run(args)
    except CLIError as e:
        print(f"anyseek generate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from anyseek.infer import loading
    from anyseek.infer.generate import GenerationError, Generator
    from anyseek.infer.loading import CLIError
    from anyseek.infer.sampling import SamplingParams

    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)
    except ValueError as e:
        raise CLIError(str(e)) from e
    folder = loading.resolve(args.checkpoint)
    tok, eos = loading.load_tokenizer(folder)
    jobs = _read_prompts(Path(args.prompts)) if args.prompts else None
    if args.prompt is not None and not args.prompt.strip():
        raise CLIError("empty prompt")
    model = loading.load_model(folder, args.device, args.dtype)
    status(f"model {folder} | {model.num_parameters() / 1e6:.1f}M parameters | {model.lm_head.weight.device} "
           f"{str(model.lm_head.weight.dtype).removeprefix('torch.')}")  # fmt: skip
    max_batch = min(args.max_batch, len(jobs)) if jobs else 1
    try:
        gen = Generator(model, max_batch=max(1, max_batch), speculative=args.speculative)
    except GenerationError as e:
        raise CLIError(str(e)) from e
    if args.speculative and gen.engine.cpu is not None:
        status(SLOW_SPECULATION)
    ctx = _Context(gen, tok, eos, params, args)
    try:
        if jobs is not None:
            ctx.batch(jobs, args.out)
        elif args.interactive:
            ctx.interactive()
        else:
            ctx.one(args.prompt)
    except GenerationError as e:
        raise CLIError(str(e)) from e
    return 0


# Why --speculative warns on the CPU: with the CPU fast path (`cpu_decode.CpuDecoder`) a plain step
# is a few ops, while a speculative step verifies two tokens through the general eager path and drafts with the MTP
# module. Measured (tiny flavor, batch 1, greedy, 1 thread, CPU time): ~1.5 ms per plain step, ~9.5 ms per
# speculative one, so 6x slower with no draft accepted and still ~3x with every draft accepted (two tokens per step).
SLOW_SPECULATION = ("warning: --speculative mtp is 3-6x slower on the CPU (plain decoding has a few-op CPU step that "
                    "verifying drafts cannot use); leave it out for speed")


def status(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _read_prompts(path: Path) -> list[dict]:
    from anyseek.infer.loading import CLIError

    if not path.is_file():
        raise CLIError(f"{path}: no such file")
    jobs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CLIError(f"{path}:{n}: not JSON ({e})") from e
        row = {"prompt": row} if isinstance(row, str) else row
        if not isinstance(row, dict) or not ("prompt" in row or "prompt_ids" in row):
            raise CLIError(f'{path}:{n}: expected {{"prompt": TEXT}} or {{"prompt_ids": [ids]}}')
        jobs.append(row)
    if not jobs:
        raise CLIError(f"{path}: no prompts")
    return jobs


class _Context:
    def __init__(self, gen, tok, eos, params, args):
        self.gen, self.tok, self.eos, self.params, self.args = gen, tok, eos, params, args

    def _stop(self):
        from anyseek.infer.generate import _stop_strings

        return _stop_strings(self.tok, self.args.stop) if self.args.stop else None

    def _note_context(self, reqs) -> None:
        """Say when requests ended at the model's context, not at --max-new-tokens (both finish as "length")."""
        cut = [r for r in reqs if r.finish_reason == "length" and len(r.tokens) < r.max_new_tokens]
        if not cut:
            return
        context = self.gen.max_len - 2
        if len(reqs) == 1:
            r = cut[0]
            status(f"note: stopped after {len(r.tokens)} of --max-new-tokens {r.max_new_tokens} new tokens: the prompt "
                   f"({len(r.prompt)} tokens) and the output filled the context of {context} tokens "
                   f"(max_position_embeddings)")
        else:
            status(f"note: {len(cut)} of {len(reqs)} prompts stopped before --max-new-tokens "
                   f"{self.args.max_new_tokens}: prompt and output filled the context of {context} tokens "
                   f"(max_position_embeddings; fewest new tokens {min(len(r.tokens) for r in cut)})")

    def _report(self, stats) -> None:
        acc = f" | MTP acceptance {stats.acceptance_rate:.0%}" if stats.acceptance_rate is not None else ""
        status(f"[{stats.new_tokens} tokens in {stats.seconds:.2f} s, {stats.tokens_per_second:.1f} tokens/s, "
               f"prefill {stats.prefill_seconds * 1000:.0f} ms{acc}]")  # fmt: skip

    def one(self, text: str) -> None:
        """Generate for one prompt, printing text as soon as it is stable (complete characters, no stop string)."""
        from anyseek.infer.generate import GenerationError, cut_at_stop

        ids = self.tok.encode(text).ids
        if not ids:
            raise GenerationError("empty prompt (it encodes to no tokens)")
        tokens, printed = [], [0]
        hold = max((len(s) for s in self.args.stop), default=1) - 1

        def on_token(i: int, t: int) -> None:
            tokens.append(t)
            out = self.tok.decode(tokens)
            stable = len(out) - hold if not out.endswith("\ufffd") else len(out.rstrip("\ufffd")) - hold
            if stable > printed[0]:
                sys.stdout.write(out[printed[0] : stable])
                sys.stdout.flush()
                printed[0] = stable

        reqs, stats = self.gen.run([ids], self.args.max_new_tokens, self.params, self.eos, self._stop(), on_token)
        final = cut_at_stop(self.tok.decode(reqs[0].tokens), self.args.stop)
        sys.stdout.write(final[printed[0] :] + "\n")
        sys.stdout.flush()
        self._note_context(reqs)
        self._report(stats)

    def interactive(self) -> None:
        status("type a prompt and press Enter; an empty line or Ctrl-D ends")
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                break
            if not line.strip():
                break
            from anyseek.infer.generate import GenerationError

            try:
                self.one(line)
            except GenerationError as e:
                status(f"error: {e}")

    def batch(self, jobs: list[dict], out: str | None) -> None:
        from anyseek.infer.generate import cut_at_stop

        prompts = [row["prompt_ids"] if "prompt_ids" in row else self.tok.encode(row["prompt"]).ids for row in jobs]
        for n, p in enumerate(prompts, 1):
            if not p:
                from anyseek.infer.generate import GenerationError

                raise GenerationError(f"prompt {n} is empty")
        reqs, stats = self.gen.run(prompts, self.args.max_new_tokens, self.params, self.eos, self._stop())
        sink = open(out, "w") if out else sys.stdout  # noqa: SIM115
        try:
            for row, r in zip(jobs, reqs):
                text = cut_at_stop(self.tok.decode(r.tokens), self.args.stop)
                sink.write(json.dumps({**row, "completion": text, "completion_ids": r.tokens,
                                       "finish_reason": r.finish_reason}) + "\n")  # fmt: skip
        finally:
            if out:
                sink.close()
        self._note_context(reqs)
        self._report(stats)
