"""`anyseek serve` end to end: the real server in a subprocess on a free localhost port, a random tiny model with a
chat template, driven by the official `openai` client (and raw HTTP where a client cannot say it: malformed JSON,
a dropped connection). Greedy answers equal `anyseek.generate` token for token (the text and the count), streamed
or not; seeded answers are reproducible whatever shares the batch; bad requests are 400 OpenAI error objects; a
full queue is 503 with Retry-After; a client that leaves frees its pages; SIGTERM drains and exits 0."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import anyseek

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

NAME = "tiny"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
PROMPT = "The cat sat on the"


class Server:
    """`anyseek serve FOLDER` in a subprocess on a free port (its stderr in a file)."""

    def __init__(self, folder: Path, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        src = str(Path(anyseek.__file__).parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        self.log = folder.parent / f"server-{self.port}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "anyseek", "serve", str(folder), "--port", str(self.port),
                                      "--served-model-name", NAME, *flags], env=env, stdout=subprocess.DEVNULL,
                                     stderr=self.log.open("w"))  # fmt: skip
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=60)  # fmt: skip

    def ready(self) -> Server:
        """Wait until /health answers (the model loaded, the graphs captured)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited: {self.log.read_text()}"
            try:
                if self.get("/health")[0] == 200:
                    return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"the server did not start: {self.log.read_text()}")

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"null")
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, dict]:
        status, _, body = self.request("GET", path)
        return status, body

    def post(self, path: str, body) -> tuple[int, dict, dict]:
        return self.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())

    def health(self) -> dict:
        return self.get("/health")[1]

    def wait_idle(self, timeout: float = 20) -> dict:
        """/health once nothing runs or waits and every page is back (or the last one seen, after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["running"] == h["waiting"] == h["pages_in_use"] == 0) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def folder(base_dir, tmp_path_factory) -> Path:
    """conftest's random tiny model (MTP included) with a chat template in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp("served") / "model"
    shutil.copytree(base_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def servers(folder):
    """Two servers, started together: the tests' (3 sequences at once, 2 more may wait; lookahead decoding, as on a
    GPU by default) and one to stop with SIGTERM (with MTP speculation)."""
    both = [Server(folder, "--max-batch", "3", "--max-queue", "2", "--lookahead", "on"),
            Server(folder, "--speculative", "mtp", "--drain-timeout", "60")]  # fmt: skip
    try:
        yield [s.ready() for s in both]
    finally:
        for s in both:
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def ref(folder):
    """(model, tokenizer, eos) as `anyseek generate` loads them, in this process."""
    from anyseek.infer import loading

    tok, eos = loading.load_tokenizer(folder)
    return loading.load_model(folder, "cpu"), tok, eos


def expected(ref, prompt_ids: list[int], n: int = 24, **kw) -> list[int]:
    model, _, eos = ref
    return anyseek.generate(model, prompt_ids, max_new_tokens=n, temperature=kw.pop("temperature", 0),
                            eos_token_id=eos, **kw)  # fmt: skip


def test_text_stream_pieces_add_up_and_never_show_a_stop_string(ref):
    """Tokens fed one at a time (multi-byte characters split across tokens, stop strings across token edges): the
    released pieces add up to the final text, and no piece ever shows a stop string or text after one."""
    from anyseek.infer.openai_api import TextStream

    tok = ref[1]
    text = "The café sat — naïve 日本 river, over the stone; the cat ran."
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and len(ids) > 20
    for stop in ([], ["sat"], ["e s"], ["日本", "xyz"], ["ran."], [" the st", "zz"]):
        stream, pieces = TextStream(tok, stop), []
        for t in ids:
            pieces.append(stream.add([t]))
            shown = "".join(pieces)
            assert all(s not in shown for s in stop) and text.startswith(shown) and "\ufffd" not in shown
        pieces.append(stream.finish())
        want = min((text[: text.index(s)] for s in stop if s in text), key=len, default=text)
        assert "".join(pieces) == want == stream.final(), (stop, pieces)
        if stop:  # held back: nothing of the stop string was shown before the end
            assert len("".join(pieces[:-1])) <= len(want)


def test_plain_chat_template_and_defaults(ref):
    """A folder without a chat template: one `role: content` line per message, then `assistant:`, and the reply
    stops at the next `user:` line. Chat without max_tokens: the rest of the context, or of what the cache holds."""
    from anyseek.infer.openai_api import PLAIN_STOP, Frontend

    front = Frontend(NAME, ref[1], 0, 400, context=100, cache_tokens=64)
    body = {"model": NAME, "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}  # fmt: skip
    assert front.render(body["messages"]) == "system: Be brief.\nuser: Hi\nassistant:"
    spec = front.parse(body, chat=True)
    assert spec.stop == [PLAIN_STOP] and len(spec.prompts[0]) + spec.max_tokens[0] == 63
    assert front.parse({"model": NAME, "prompt": "Hi"}, chat=False).max_tokens == [16]


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [NAME]
    h = server.health()
    assert h["status"] == "ok" and h["pages_in_use"] == 0 and h["max_batch"] == 3 and h["pages_total"] > 0
    # the decode thread's counters (benchmarks/serve.py reads them per level): 6 tokens of one sequence take the
    # prefill's round (its first token) and 5 decode steps of batch 1
    server.client.completions.create(model=NAME, prompt="x", max_tokens=6, extra_body={"ignore_eos": True})
    after = server.wait_idle()
    assert after["steps"] - h["steps"] == 5 and after["decode_rows"] - h["decode_rows"] == 5, (h, after)
    assert after["rounds"] - h["rounds"] >= 5 and after["round_seconds"] > h["round_seconds"]
    assert after["decode_seconds"] > h["decode_seconds"] and after["prefill_seconds"] > h["prefill_seconds"]


def test_the_openai_snippet_in_docs_inference_runs(server, capsys):
    """docs/inference.md's openai block, run as written against this server (its address and model name)."""
    import re
    import runpy

    doc = (Path(__file__).parents[1] / "docs" / "inference.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL) if "OpenAI(" in c]
    script = Path(server.log).with_name("snippet.py")
    script.write_text(code.replace("http://127.0.0.1:8000", f"http://127.0.0.1:{server.port}")
                      .replace('"runs/tiny"', f'"{NAME}"'))  # fmt: skip
    runpy.run_path(str(script))
    assert "completion_tokens=40" in capsys.readouterr().out


def test_greedy_completion_equals_generate(server, ref):
    """Non-streaming and streamed (with usage) greedy answers: generate's tokens, as text and as a count."""
    tok = ref[1]
    want = expected(ref, tok.encode(PROMPT).ids)
    r = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == tok.decode(want) and r.usage.completion_tokens == len(want)
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT).ids)
    assert r.choices[0].finish_reason == ("length" if len(want) == 24 else "stop")
    chunks = list(server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(want)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    ids = server.client.completions.create(model=NAME, prompt=[5, 17, 33], max_tokens=10, temperature=0)
    assert ids.choices[0].text == tok.decode(expected(ref, [5, 17, 33], 10))


def test_chat_uses_the_folders_template(server, ref):
    tok = ref[1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The dog ran"}]
    rendered = "<system>Be brief.\n<user>The dog ran\n<assistant>"
    want = tok.decode(expected(ref, tok.encode(rendered, add_special_tokens=False).ids, 16))
    r = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    chunks = list(server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0,
                                                        stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_stop_strings_n_and_seeds(server, ref):
    """A stop string cuts the text before it (finish_reason stop), streamed or not; n seeded choices equal
    generate's for the prompt repeated n times with that seed, alone or beside another request."""
    tok = ref[1]
    full = tok.decode(expected(ref, tok.encode(PROMPT).ids))
    k = next(k for k in range(4, len(full) - 3) if full.index(full[k : k + 3]) == k and "\ufffd" not in full[k : k + 3]
             and full[k : k + 3].strip())  # fmt: skip
    stop = full[k : k + 3]
    r = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:k], "stop")
    streamed = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                                stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == full[:k]
    ids = tok.encode(PROMPT).ids
    want = [tok.decode(t) for t in expected(ref, [ids] * 3, 12, temperature=1.0, top_k=0, seed=7)]
    kw = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7,
          "extra_body": {"ignore_eos": False}}  # fmt: skip
    alone = [c.text for c in server.client.completions.create(**kw).choices]
    assert alone == want and len(set(alone)) > 1
    other = threading.Thread(target=server.client.completions.create, kwargs={**kw, "n": 1, "seed": 1,
                                                                              "max_tokens": 100})  # fmt: skip
    other.start()
    beside = [c.text for c in server.client.completions.create(**kw).choices]
    other.join()
    assert beside == want


BAD = [  # (path, body, param or message fragment)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', "not valid JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/v1/completions", {"prompt": "x"}, "model"),
    ("/v1/completions", {"model": NAME}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": 9}, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 100}, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "seed": "s"}, "seed"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": ["a", ""]}, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 3}, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
]  # fmt: skip


def test_bad_requests_are_400_error_objects(server):
    for path, body, what in BAD:
        status, _, got = server.post(path, body)
        err = got["error"]
        assert status == 400 and err["type"] == "invalid_request_error", (body, status, got)
        assert err["param"] == what or what in err["message"], (body, err)
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model="gpt-4", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=NAME, prompt="the cat " * 1500)
    assert e.value.code == "context_length_exceeded"
    status, _, got = server.request("GET", "/v1/nothing")
    assert status == 404 and "error" in got
    assert server.wait_idle()["pages_in_use"] == 0


def _open_stream(server, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens,
                                                        "stream": True, "ignore_eos": True}).encode())  # fmt: skip
    return conn, conn.getresponse()


def test_full_queue_is_503_with_retry_after(server):
    """3 running + 2 waiting fill this server: more requests are refused with 503 and Retry-After until one leaves."""
    streams = [_open_stream(server, 1800) for _ in range(5)]
    assert all(r.status == 200 for _, r in streams)
    refused = [server.post("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 4}) for _ in range(2)]
    for status, headers, body in refused:
        assert status == 503 and int(headers["retry-after"]) >= 1 and body["error"]["code"] == "overloaded"
    with pytest.raises(openai.InternalServerError) as e:  # what the openai client sees (it would retry by default)
        server.client.completions.create(model=NAME, prompt="x", max_tokens=4)
    assert e.value.status_code == 503
    assert server.health()["live"] == 5
    for conn, r in streams:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    assert server.wait_idle()["pages_in_use"] == 0
    # the server serves again (ignore_eos: a random model may sample EOS first, which is a correct empty answer)
    again = server.client.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 4


def test_client_disconnect_frees_pages(server):
    """A stream dropped after a few chunks, and a non-streaming request whose client gives up: the server stops
    their sequences long before their 1,800 tokens (none counts as finished) and every page comes back."""
    before = server.health()
    conn, r = _open_stream(server, 1800)
    for _ in range(3):
        assert r.readline().startswith(b"data: ")
        r.readline()
    assert server.health()["pages_in_use"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    slow = http.client.HTTPConnection("127.0.0.1", server.port, timeout=0.3)
    slow.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 1800,
                                                        "ignore_eos": True}).encode())  # fmt: skip
    with pytest.raises(TimeoutError):
        slow.getresponse()
    slow.close()
    h = server.wait_idle()
    assert h["pages_in_use"] == 0 and h["running"] == 0, h
    assert h["sequences_finished"] == before["sequences_finished"], "a dropped request ran to its end"
    assert h["tokens_generated"] - before["tokens_generated"] < 1800, h
    again = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 2


def test_sigterm_drains_and_exits_0(servers, ref):
    """SIGTERM mid-stream: new requests are refused, the open stream runs to its end, the process exits 0. This
    server decodes with MTP speculation, whose greedy answers equal plain generate's too."""
    tok, s = ref[1], servers[1]
    try:
        r = s.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
        assert r.choices[0].text == tok.decode(expected(ref, tok.encode(PROMPT).ids))
        conn, resp = _open_stream(s, 150)
        assert resp.readline().startswith(b"data: ")
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # refused: the listener is closed, or (not closed yet) 503
            assert s.post("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2})[0] == 503
        except OSError:
            pass
        rest = resp.read().decode()
        conn.close()
        events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert len(events) > 10, "the stream was over before the signal: nothing was drained"
        assert events[-1]["choices"][0]["finish_reason"] == "length" and rest.rstrip().endswith("data: [DONE]")
        assert s.proc.wait(60) == 0, s.log.read_text()
    finally:
        s.stop()


@pytest.mark.cuda
def test_gpu_server_greedy_equals_generate(folder, ref):
    """On the GPU (fp32, CUDA graphs replayed by the decode thread): greedy answers, alone and four at once,
    equal `anyseek.generate` on the GPU; the pages come back."""
    from concurrent.futures import ThreadPoolExecutor

    from anyseek.infer import loading

    tok, eos = ref[1], ref[2]
    model = loading.load_model(folder, "cuda", "fp32")
    prompts = [PROMPT, "A river", "The king and the queen", "stone"]
    want = [tok.decode(t) for t in anyseek.generate(model, [tok.encode(p).ids for p in prompts], max_new_tokens=32,
                                                    temperature=0, eos_token_id=eos)]  # fmt: skip
    s = Server(folder, "--device", "cuda", "--dtype", "fp32").ready()

    def ask(prompt: str) -> str:
        return s.client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0).choices[0].text

    try:
        assert ask(prompts[0]) == want[0]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, prompts)) == want
        assert s.wait_idle()["pages_in_use"] == 0
    finally:
        s.stop()
