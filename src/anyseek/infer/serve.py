"""`anyseek serve CHECKPOINT`: an OpenAI-compatible HTTP server with continuous batching on the paged latent cache.

    GET  /health                  status, running / waiting sequences, cache pages in use
    GET  /v1/models               the one served model
    POST /v1/completions          prompt(s) -> text, `stream` as server-sent events ending in `data: [DONE]`
    POST /v1/chat/completions     messages -> the chat template -> the same

FastAPI routes on uvicorn's event loop parse and check a request (`openai_api.Frontend`), hand its sequences to
the decode thread (`worker.Worker`, the one owner of the model and its CUDA graphs) and await their tokens on an
asyncio queue. Requests join the running batch at the next step and leave it when done; a client that leaves
mid-answer has its sequences dropped and its pages freed at the next step. A full queue is 503 with Retry-After.
SIGTERM stops new requests (503), lets the in-flight ones finish for up to --drain-timeout seconds, exits 0.
"""

import argparse  # no `from __future__ import annotations`: FastAPI reads the routes' annotations at run time
import asyncio
import json
import random
import signal
import sys
import time
import uuid
from dataclasses import replace

RETRY_AFTER_S = 1
# Two threads share the GIL: the event loop (JSON, SSE writes) and the decode thread, which releases it while it waits
# for the GPU. When the step is done the decode thread must get the GIL back at once, or the GPU idles: Python makes a
# waiting thread wait up to the switch interval, 5 ms by default, a third of a 64-row decode step of the 16B flavor.
SWITCH_INTERVAL_S = 0.0005


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a step-N folder, a run folder (its newest checkpoint) or a Hugging Face "
                                           "DeepseekV3 folder with tokenizer.json")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--max-tokens-in-flight", type=int, help="the latent cache in tokens (prompt + output of every "
                        "running sequence, each counted at its longest); default max-batch x max-len")  # fmt: skip
    parser.add_argument("--max-len", type=int, help="prompt + output of one request (default: the model's context)")
    parser.add_argument("--prefill-tokens", type=int, default=4096,
                        help="prompt tokens prefilled per step beside the decoding sequences")  # fmt: skip
    parser.add_argument("--admit", choices=["now", "batched"], default="now",
                        help="now: each arrival is prefilled at the next step; batched: while sequences decode, "
                             "arrivals wait to be prefilled together as long as waiting costs less than a prefill's "
                             "stall (for large models, whose prefill is launch-bound)")  # fmt: skip
    parser.add_argument("--lookahead", choices=["auto", "on", "off"], default="auto",
                        help="launch each decode step before the previous one's tokens are read back (auto: where "
                             "decode steps are CUDA graphs and --speculative is off)")  # fmt: skip
    parser.add_argument("--max-queue", type=int, default=256, help="sequences waiting beyond the batch; then 503")
    parser.add_argument("--speculative", choices=["mtp"], help="draft with the model's MTP module (same output)")
    parser.add_argument("--served-model-name", help="the `model` clients name (default: CHECKPOINT as given)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for open requests")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the GPU if any)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--log-level", default="warning", help="uvicorn's (info logs every request)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from anyseek.infer.loading import CLIError

    try:
        return _run(args)
    except CLIError as e:
        print(f"anyseek serve: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from anyseek.infer import loading
    from anyseek.infer.loading import CLIError

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CLIError(f"anyseek serve needs FastAPI and uvicorn ({e.name} is missing): "
                       "pip install 'anyseek[serve]'") from e  # fmt: skip
    for flag in ("max_batch", "max_tokens_in_flight", "max_len", "prefill_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise CLIError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_queue < 0:
        raise CLIError(f"--max-queue must be >= 0, got {args.max_queue}")
    folder = loading.resolve(args.checkpoint)
    loading.load_tokenizer(folder)  # a missing tokenizer fails before the model loads
    return serve(loading.load_model(folder, args.device, args.dtype), folder, args)


def serve(model, folder, args: argparse.Namespace) -> int:
    """Serve the loaded `model` with the tokenizer and chat template of `folder` until SIGTERM or Ctrl-C (the
    command's second half; benchmarks/serve.py calls it with random weights that never touch the disk)."""
    import uvicorn

    front, worker, banner = _build(model, folder, args)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    config = uvicorn.Config(build_app(front, worker), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=args.drain_timeout)  # fmt: skip
    server = _server_class()(config)
    server.worker, server.banner = worker, banner
    worker.start()
    # uvicorn catches SIGTERM, drains, then raises the signal again under the handler it found: make that one a
    # no-op, so a drained server exits 0
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.stop()
    return 0 if server.started else 1


def _build(model, folder, args: argparse.Namespace):
    """The model's Generator (graphs captured), the API's view of it, the decode thread and a banner line."""
    from anyseek.infer import loading
    from anyseek.infer.generate import GenerationError, Generator
    from anyseek.infer.loading import CLIError
    from anyseek.infer.openai_api import Frontend, chat_template, generation_defaults
    from anyseek.infer.worker import Worker

    tok, eos = loading.load_tokenizer(folder)
    template, special = chat_template(folder)
    try:
        gen = Generator(model, max_batch=args.max_batch, max_len=args.max_len, speculative=args.speculative,
                        cache_tokens=args.max_tokens_in_flight, prefill_tokens=args.prefill_tokens,
                        batch_arrivals=args.admit == "batched",
                        lookahead={"auto": None, "on": True, "off": False}[args.lookahead])  # fmt: skip
    except GenerationError as e:
        raise CLIError(str(e)) from e
    gen.engine.warm_up()
    name = args.served_model_name or args.checkpoint.rstrip("/")
    eng = gen.engine
    front = Frontend(name, tok, eos, model.config.vocab_size, gen.max_len - 2, template, special,
                     generation_defaults(folder), eng.num_pages * eng.cache.page)  # fmt: skip
    w = model.lm_head.weight
    banner = (f"anyseek serve: {name} on http://{args.host}:{args.port} | {model.num_parameters() / 1e6:.1f}M "
              f"parameters, {w.device} {str(w.dtype).removeprefix('torch.')} | max batch {gen.max_batch}, cache "
              f"{eng.num_pages * eng.cache.page} tokens ({eng.num_pages} pages), context {gen.max_len - 2}, queue "
              f"{args.max_queue}{', MTP speculation' if args.speculative else ''}"
              f"{'' if template else ' | no chat template: the plain one'}")  # fmt: skip
    return front, Worker(gen, args.max_queue), banner


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that refuses new requests once a signal asked it to stop, and says when it listens."""

        worker = banner = None

        def handle_exit(self, sig, frame) -> None:
            self.worker.draining = True
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                print(self.banner, file=sys.stderr, flush=True)

    return Server


# ---------------------------------------------------------------------------------------------------- the app


def build_app(front, worker):
    """The FastAPI app over `front` (openai_api.Frontend) and `worker` (worker.Worker, started by the caller)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from starlette.exceptions import HTTPException

    from anyseek.infer.openai_api import APIError

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.stop()

    app = FastAPI(title="anyseek", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())
    model_card = {"id": front.name, "object": "model", "created": started, "owned_by": "anyseek",
                  "max_model_len": front.context}  # fmt: skip

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, exc: HTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), type="invalid_request_error"))

    @app.get("/health")
    async def health():
        status = "error" if worker.error else "draining" if worker.draining else "ok"
        return {"status": status, "model": front.name, **worker.health()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != front.name:
            return error_response(APIError(404, f"the model {model!r} does not exist", "model",
                                           code="model_not_found"))  # fmt: skip
        return model_card

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await answer(request, front, worker, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await answer(request, front, worker, chat=True)

    @app.exception_handler(Exception)
    async def server_error(request: HTTPRequest, exc: Exception):
        return error_response(APIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    return app


def error_response(e):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def answer(request, front, worker, chat: bool):
    """One completions or chat request: checked, queued, answered whole or as a stream."""
    from anyseek.infer.openai_api import APIError, bad
    from anyseek.infer.worker import Overloaded

    try:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON ({e})") from e
        spec = front.parse(body, chat)
        job = _job(spec, front, worker)
        try:
            worker.submit(job)
        except Overloaded as e:
            raise APIError(503, f"{e}; retry after {RETRY_AFTER_S} s", type="server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e  # fmt: skip
    except APIError as e:
        return error_response(e)
    head = front.head(spec, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()))
    if spec.stream:
        return _streaming_response(_stream(job, spec, front, head), lambda: _close(job, worker))
    return await _whole(request, job, spec, front, worker, head)


def _job(spec, front, worker):
    """The request's sequences (n per prompt, prompt-major) on this event loop. A seed gives each sequence the noise
    of `generate(..., seed=seed)` for the same list of prompts; without one, a random seed per request."""
    from anyseek.infer.generate import Request, _stop_strings
    from anyseek.infer.openai_api import bad
    from anyseek.infer.worker import Job

    params = replace(spec.params, seed=spec.seed if spec.seed is not None else random.getrandbits(63))
    eos = frozenset() if spec.ignore_eos else front.eos
    stop = _stop_strings(front.tok, spec.stop) if spec.stop else None
    reqs = []
    for prompt, max_new in zip(spec.prompts, spec.max_tokens):
        for _ in range(spec.n):
            r = Request(prompt, max_new, id=worker.new_id(), key=len(reqs), params=params, eos=eos,
                        stop=None if stop is None else (lambda tokens: stop(0, tokens)))  # fmt: skip
            if worker.gen.pages_needed(r) > worker.gen.engine.num_pages:
                raise bad(f"{len(prompt)} prompt + {max_new} new tokens need more than this server's cache "
                          f"({worker.gen.engine.num_pages * worker.gen.engine.cache.page} tokens)", "max_tokens")
            reqs.append(r)
    if len(reqs) > worker.gen.max_batch + worker.max_queue:
        raise bad(f"{len(reqs)} sequences (prompts x n) are more than this server takes at once "
                  f"({worker.gen.max_batch + worker.max_queue})", "n")  # fmt: skip
    return Job(reqs, asyncio.get_running_loop())


def _close(job, worker) -> None:
    """The response is over (sent, or the client left): drop whatever of the job still runs."""
    if not job.done:
        worker.cancel(job)


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"


class _Chunks:
    """One choice's stream chunks as SSE strings. The JSON around the text is rendered once, so a chunk with text
    costs one json.dumps of that text: the event loop writes one chunk per client per step (thousands a second at
    64 clients), in the thread that shares the GIL with the decode thread."""

    MARK = "\u0000"  # marks the text's place in the rendered template (no id or model name holds a NUL)

    def __init__(self, front, spec, head: dict, c: int, extra: dict):
        self.front, self.spec, self.head, self.c, self.extra = front, spec, head, c, extra
        self.pre, _, self.post = self.render(self.MARK, None).partition(json.dumps(self.MARK, ensure_ascii=False))

    def render(self, text: str | None, finish: str | None, first: bool = False) -> str:
        choice = self.front.choice(self.spec, self.c, text, finish, first)
        return _sse({**self.head, "choices": [choice], **self.extra})

    def __call__(self, text: str, finish: str | None) -> str:
        if text and finish is None:
            return self.pre + json.dumps(text, ensure_ascii=False) + self.post
        return self.render(text, finish)


async def _stream(job, spec, front, head):
    """Server-sent events: a chunk per choice whenever it has new text (the tokens of every step that arrived
    since the last chunk together), its finish reason, then the usage (stream_options.include_usage), [DONE]."""
    from anyseek.infer.openai_api import FINISH, APIError, TextStream

    n = len(job.requests)
    texts, left, tokens = [TextStream(front.tok, spec.stop) for _ in range(n)], n, 0
    extra = {"usage": None} if spec.include_usage else {}
    chunks = [_Chunks(front, spec, head, c, extra) for c in range(n)]
    if spec.chat:
        yield "".join(ch.render(None, None, first=True) for ch in chunks)
    while left:
        items = [await job.queue.get()]
        while not job.queue.empty():
            items.append(job.queue.get_nowait())
        out: dict[int, list] = {}
        for item in items:
            if isinstance(item, BaseException):
                job.done = True
                yield _sse(APIError(500, f"generation failed: {type(item).__name__}: {item}", type="server_error")
                           .body()) + "data: [DONE]\n\n"  # fmt: skip
                return
            c, ids, fin = item
            tokens += len(ids)
            piece = texts[c].add(ids)
            o = out.setdefault(c, ["", None])
            if fin is not None:
                piece += texts[c].finish()
                o[1], left = FINISH[fin], left - 1
            o[0] += piece
        job.done = left == 0
        yield "".join(chunks[c](t, f) for c, (t, f) in sorted(out.items()) if t or f)
    if spec.include_usage:
        yield _sse({**head, "choices": [], "usage": front.usage(spec, tokens)})
    yield "data: [DONE]\n\n"


def _streaming_response(content, on_close):
    from starlette.responses import StreamingResponse

    class Stream(StreamingResponse):
        """A stream that runs `on_close` however it ends (sent, failed, or cancelled when the client left)."""

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                on_close()

    return Stream(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                     "X-Accel-Buffering": "no"})  # fmt: skip


class _Gone(Exception):
    """The client of a non-streaming request disconnected."""


async def _whole(request, job, spec, front, worker, head):
    """A non-streaming answer: wait for every choice (dropping the job if the client disconnects meanwhile)."""
    from fastapi.responses import JSONResponse, Response

    from anyseek.infer.generate import cut_at_stop
    from anyseek.infer.openai_api import FINISH, APIError

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.queue.put_nowait(_Gone())

    watcher = asyncio.create_task(watch())
    n = len(job.requests)
    tokens, fins, left = [[] for _ in range(n)], [None] * n, n
    try:
        while left:
            item = await job.queue.get()
            if isinstance(item, _Gone):
                return Response(status_code=499)  # nobody reads it
            if isinstance(item, BaseException):
                return error_response(APIError(500, f"generation failed: {type(item).__name__}: {item}",
                                               type="server_error"))  # fmt: skip
            c, ids, fin = item
            tokens[c] += ids
            if fin is not None:
                fins[c], left = FINISH[fin], left - 1
    finally:
        watcher.cancel()
        job.done = left == 0
        _close(job, worker)
    choices = [front.choice(spec, c, cut_at_stop(front.tok.decode(t), spec.stop), fins[c])
               for c, t in enumerate(tokens)]  # fmt: skip
    return JSONResponse({**head, "choices": choices, "usage": front.usage(spec, sum(len(t) for t in tokens))})
