"""The OpenAI API of `anyseek serve`, without the HTTP: request bodies checked and turned into token ids and
sampling parameters (`Frontend.parse`), chat messages rendered by the model's chat template, tokens turned into
text as they arrive (`TextStream`), and the response and stream-chunk objects.

Every bad request is an `APIError` whose `body()` is OpenAI's error object: {"error": {"message", "type", "param",
"code"}}. Parameters the server cannot honour (logprobs, echo, suffix, best_of, logit_bias, tools, penalties other
than 0) are errors naming the parameter, never silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from anyseek.infer.generate import cut_at_stop
from anyseek.infer.sampling import SamplingParams

# A folder without a chat template gets this one: one line per message, then the assistant's turn. The reply
# ends at eos or where the model starts the next user line (PLAIN_STOP).
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip
PLAIN_STOP = "\nuser:"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP, MAX_N = 4, 128
# parameter -> the values that ask for nothing (anything else asks for a feature this server does not have)
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
               "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "response_format": (None, {"type": "text"}), "prediction": (None,), "audio": (None,)}  # fmt: skip


class APIError(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)


@dataclass
class Spec:
    """A checked request: prompts as token ids (choices: n per prompt, prompt-major), what to sample, how to answer."""

    chat: bool
    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt
    n: int
    params: SamplingParams  # its seed unused: `seed` below
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool


class Frontend:
    """The served model as the API sees it: name, tokenizer, eos, context, chat template, default sampling."""

    def __init__(self, name: str, tokenizer, eos: int | list[int] | None, vocab: int, context: int,
                 chat_template: str | None = None, special: dict | None = None, defaults: dict | None = None,
                 cache_tokens: int | None = None):  # fmt: skip
        self.name, self.tok, self.vocab, self.context = name, tokenizer, vocab, context
        self.room = min(context, (cache_tokens or context + 1) - 1)  # prompt + output of one request, at most
        self.eos = frozenset({eos} if isinstance(eos, int) else eos or ())
        self.plain_chat = chat_template is None
        self.template = _compile(chat_template or PLAIN_TEMPLATE)
        self.special = special or {}
        self.defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **(defaults or {})}

    # ---- the request ------------------------------------------------------------------------------------------
    def parse(self, body, chat: bool) -> Spec:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise bad("you must provide a model parameter", "model")
        if model != self.name:
            raise bad(f"the model {model!r} does not exist; this server serves {self.name!r}", "model",
                      "model_not_found")  # fmt: skip
        for key, ok in UNSUPPORTED.items():
            if key in body and body[key] not in ok:
                raise bad(f"{key} is not supported by anyseek serve", key, "unsupported_parameter")
        prompts = [self._chat_prompt(body.get("messages"))] if chat else self._prompts(body.get("prompt"))
        n = _int(body, "n", 1, 1, MAX_N)
        stream = _bool(body, "stream", False)
        options = body.get("stream_options")
        if options is not None and (not stream or not isinstance(options, dict)):
            raise bad("stream_options is only allowed with stream: true, as an object", "stream_options")
        stop = _stops(body.get("stop"))
        if chat and self.plain_chat:
            stop = stop + [PLAIN_STOP]
        return Spec(chat, prompts, self._max_tokens(body, prompts, chat), n, self._params(body),
                    _int(body, "seed", None, None, None), stop, stream, _bool(options or {}, "include_usage", False),
                    _bool(body, "ignore_eos", False))  # fmt: skip

    def _prompts(self, prompt) -> list[list[int]]:
        """`prompt`: a string, a list of strings, a list of token ids or a list of such lists."""
        ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)  # not bool
        if isinstance(prompt, str) or ids:
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            items = prompt
        else:
            raise bad("prompt must be a string, a list of strings, a list of token ids or a list of those", "prompt")
        return [self._ids(p, "prompt") for p in items]

    def _ids(self, p, param: str, specials: bool = True) -> list[int]:
        if isinstance(p, str):
            ids = list(self.tok.encode(p, add_special_tokens=specials).ids)
        elif all(type(t) is int for t in p):
            ids = list(p)
            if ids and (min(ids) < 0 or max(ids) >= self.vocab):
                raise bad(f"token ids must be in [0, {self.vocab}), got {min(ids)}..{max(ids)}", param)
        else:
            raise bad("a token-id prompt must hold integers only", param)
        if not ids:
            raise bad("the prompt is empty (it encodes to no tokens)", param)
        if len(ids) >= self.context:
            raise bad(f"this model's maximum context length is {self.context} tokens; the prompt has {len(ids)}",
                      param, "context_length_exceeded")  # fmt: skip
        return ids

    def _chat_prompt(self, messages) -> list[int]:
        return self._ids(self.render(messages), "messages", specials=False)

    def render(self, messages) -> str:
        """The chat template applied to checked `messages`, ready for the assistant's reply."""
        if not isinstance(messages, list) or not messages:
            raise bad("messages must be a non-empty list", "messages")
        msgs = [_message(m, i) for i, m in enumerate(messages)]
        try:
            return self.template.render(messages=msgs, add_generation_prompt=True, **self.special)
        except Exception as e:  # a template's raise_exception, or any error in it: the client's messages
            raise bad(f"the chat template rejected the messages: {e}", "messages") from e

    def _max_tokens(self, body: dict, prompts: list[list[int]], chat: bool) -> list[int]:
        """max_tokens (chat: max_completion_tokens too) per prompt; default 16 for completions (as OpenAI), the rest
        of the context for chat (of what the cache holds for one request, if less). prompt + max_tokens beyond the
        context is an error, as at OpenAI."""
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        asked = _int(body, key, None, 1, None)
        if asked is None:
            return [max(1, self.room - len(p)) if chat else min(16, self.context - len(p)) for p in prompts]
        for p in prompts:
            if len(p) + asked > self.context:
                raise bad(f"this model's maximum context length is {self.context} tokens; you requested "
                          f"{len(p) + asked} ({len(p)} in the prompt, {asked} in the completion)", key,
                          "context_length_exceeded")  # fmt: skip
        return [asked] * len(prompts)

    def _params(self, body: dict) -> SamplingParams:
        d = self.defaults
        temperature = _num(body, "temperature", d["temperature"], 0.0, 2.0)
        top_p = _num(body, "top_p", d["top_p"], 0.0, 1.0)
        if top_p <= 0:
            raise bad("top_p must be in (0, 1]", "top_p")
        top_k = _int(body, "top_k", d["top_k"], -1, None)
        penalty = _num(body, "repetition_penalty", 1.0, 0.0, None)
        if penalty <= 0:
            raise bad("repetition_penalty must be > 0", "repetition_penalty")
        return SamplingParams(temperature, max(top_k, 0), top_p, penalty)

    # ---- the response -----------------------------------------------------------------------------------------
    def head(self, spec: Spec, rid: str, created: int) -> dict:
        kind = ("chat.completion" + (".chunk" if spec.stream else "")) if spec.chat else "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": self.name}

    def choice(self, spec: Spec, index: int, text: str | None, finish: str | None, first: bool = False) -> dict:
        """One choice of a response (text: the whole of it) or of a stream chunk (text: what is new)."""
        if not spec.chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        if not spec.stream:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}  # fmt: skip
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    @staticmethod
    def usage(spec: Spec, completion_tokens: int) -> dict:
        prompt = sum(len(p) for p in spec.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}  # fmt: skip


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class TextStream:
    """A choice's text as its tokens arrive: whole characters only (a token may end inside one), never past the
    first stop string, and the last (longest stop - 1) characters held back while a stop string could start there.
    `final` is what a non-streaming answer holds, so the pieces add up to it."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decode to the end of `text`, context for the next piece
        self.text, self.sent = "", 0

    def add(self, ids: list[int]) -> str:
        """Take new token ids -> the text that can be released now."""
        self.ids += ids
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        cut = cut_at_stop(self.text, self.stop)
        ready = len(cut) if len(cut) < len(self.text) else len(self.text) - self.hold
        return self._release(cut, ready)

    def finish(self) -> str:
        """The choice ended -> the rest of its text."""
        final = self.final()
        return self._release(final, len(final))

    def final(self) -> str:
        return cut_at_stop(self.tok.decode(self.ids), self.stop)

    def _release(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        piece, self.sent = text[self.sent : upto], upto
        return piece


# ---------------------------------------------------------------------------------------------------- helpers


def _int(body: dict, key: str, default, lo: int | None, hi: int | None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(f"{key} must be an integer, got {v!r}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"{key} must be {span}, got {v}", key)
    return v


def _num(body: dict, key: str, default: float, lo: float, hi: float | None) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise bad(f"{key} must be a number, got {v!r}", key)
    if v < lo or (hi is not None and v > hi):
        raise bad(f"{key} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", key)
    return float(v)


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {v!r}", key)
    return v


def _stops(stop) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return list(stops)


def _message(m, i: int) -> dict:
    """A chat message checked: a known role and text content (a string, or a list of text parts)."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise bad(f"{param} must be an object with a role in {', '.join(ROLES)}", param)
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):  # fmt: skip
            raise bad(f"{param}.content: only text parts are supported", f"{param}.content")
        content = "".join(p["text"] for p in content)
    elif content is None and m["role"] == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise bad(f"{param}.content must be a string or a list of text parts", f"{param}.content")
    return {**m, "content": content}


def _compile(template: str):
    """A Jinja2 chat template in a sandbox, with the helpers Hugging Face templates call (as transformers sets up)."""
    from datetime import datetime

    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(template)


def chat_template(folder: Path) -> tuple[str | None, dict]:
    """The folder's chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`; None when it
    has none) and the special tokens a template may name (bos_token, eos_token, ...)."""
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            special[key] = v
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(), special
    t = cfg.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t if isinstance(t, str) and t else None), special


def generation_defaults(folder: Path) -> dict:
    """temperature / top_p / top_k from the folder's generation_config.json, where it sets them."""
    try:
        cfg = json.loads((folder / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out = {k: cfg[k] for k in ("temperature", "top_p", "top_k") if isinstance(cfg.get(k), (int, float))}
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    return out
