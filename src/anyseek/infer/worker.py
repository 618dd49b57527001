"""The decode thread of `anyseek serve`: the one thread that owns the `Generator` (model, engine, cache, CUDA graphs).

    event loop (HTTP)                         decode thread
    submit(job) / cancel(job) --inbox-->      between steps: queue or drop the job's requests
                                              gen.step(): admit, prefill, decode, retire (pages freed)
    job.queue  <--call_soon_threadsafe--      each step's new tokens and finishes, one hand-over per step

A job is one HTTP request: its sequences (n choices per prompt) and an asyncio queue on the server's event loop.
Its events are (choice, new token ids, finish reason or None); a failed step hands every live job the exception.
The bound on waiting work is counted here: at most max_batch + max_queue sequences in the system, beyond that
`submit` raises `Overloaded` (the server answers 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from anyseek.infer.generate import Generator, Request


class Overloaded(RuntimeError):
    """The queue is full (or the server is draining): try again later."""


@dataclass(eq=False)
class Job:
    """One HTTP request's sequences, and the asyncio queue (on `loop`) its events go to."""

    requests: list[Request]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: list[int] = field(default_factory=list)  # tokens handed over so far, per choice (decode thread only)
    done: bool = False  # every choice finished (the event loop's side)

    def __post_init__(self):
        self.sent = [0] * len(self.requests)


class Worker:
    """Runs `gen` on its own thread; `submit`, `cancel` and the counters are for the event loop's thread."""

    def __init__(self, gen: Generator, max_queue: int):
        self.gen, self.max_queue = gen, max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ids = itertools.count()
        self._lock = threading.Lock()
        self.live = 0  # sequences submitted and not yet finished or dropped
        self._owner: dict[int, tuple[Job, int]] = {}  # request id -> (job, choice); decode thread only
        self.draining, self.error = False, None
        self.tokens, self.finished = 0, 0
        self.rounds, self.round_seconds = 0, 0.0  # the decode thread's rounds (step + hand-over) and their time
        self.thread = threading.Thread(target=self._run, name="anyseek-decode", daemon=True)

    # ---- the event loop's side --------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def new_id(self) -> int:
        return next(self.ids)

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise Overloaded when it would take the system past max_batch + max_queue sequences."""
        with self._lock:
            if self.draining or self.live + len(job.requests) > self.gen.max_batch + self.max_queue:
                raise Overloaded("the server is draining" if self.draining else "the request queue is full")
            self.live += len(job.requests)
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Drop what is left of `job` (its client left): its pages are freed at the next step."""
        self.inbox.put(("cancel", job))

    def stop(self, timeout: float = 10.0) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    def health(self) -> dict:
        gen, cache = self.gen, self.gen.engine.cache
        return {"running": len(gen.running), "waiting": len(gen.waiting), "live": self.live,
                "max_batch": gen.max_batch, "max_queue": self.max_queue, "pages_total": gen.engine.num_pages,
                "pages_in_use": gen.engine.num_pages - cache.num_free_pages, "page_tokens": cache.page,
                "tokens_generated": self.tokens, "sequences_finished": self.finished, "steps": gen.stats.steps,
                # where the decode thread's time goes (cumulative; a client takes differences between two reads)
                "decode_seconds": gen.stats.decode_seconds, "decode_rows": gen.stats.decode_rows,
                "prefill_seconds": gen.stats.prefill_seconds, "rounds": self.rounds,
                "round_seconds": self.round_seconds, "error": self.error}  # fmt: skip

    # ---- the decode thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        device = self.gen.engine.device
        if device.type == "cuda":  # a new thread starts on GPU 0: streams and graph replays belong on the model's
            import torch

            torch.cuda.set_device(device)
        while True:
            idle = not (self.gen.waiting or self.gen.running)
            try:
                cmds = [self.inbox.get(block=idle)]
            except queue.Empty:
                cmds = []
            while True:
                try:
                    cmds.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for cmd, job in cmds:
                if cmd == "stop":
                    self._drop_all(None)
                    return
                (self._take if cmd == "submit" else self._cancel)(job)
            if self.gen.waiting or self.gen.running:
                self._step()

    def _take(self, job: Job) -> None:
        try:
            for r in job.requests:
                self.gen.submit(r)  # the server checked them: this raises only on a bug
        except Exception as e:  # noqa: BLE001
            for r in job.requests:
                self.gen.cancel(r)
            self._done(len(job.requests))
            job.loop.call_soon_threadsafe(_deliver, {job: [e]})
            return
        for c, r in enumerate(job.requests):
            self._owner[r.id] = (job, c)

    def _cancel(self, job: Job) -> None:
        for r in job.requests:
            if self._owner.pop(r.id, None) is not None:
                self.gen.cancel(r)
                self._done(1)

    def _done(self, n: int) -> None:
        with self._lock:
            self.live -= n

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            self._emit(self.gen.step(on_prefill=self._emit))
        except Exception as e:  # noqa: BLE001 - the server stays up: every live request gets the error
            traceback.print_exc(file=sys.stderr)
            self.error = f"{type(e).__name__}: {e}"
            self._drop_all(e)
        self.rounds += 1
        self.round_seconds += time.perf_counter() - t0

    def _emit(self, touched: list[Request]) -> None:
        """Hand the new tokens and finishes of `touched` to their jobs: one call into the event loop."""
        events: dict[Job, list] = {}
        for r in touched:
            owner = self._owner.get(r.id)
            if owner is None:
                continue
            job, c = owner
            new, fin = r.tokens[job.sent[c] :], r.finish_reason
            job.sent[c] = len(r.tokens)
            self.tokens += len(new)
            if fin is not None:
                del self._owner[r.id]
                self.finished += 1
                self._done(1)
            if new or fin is not None:
                events.setdefault(job, []).append((c, new, fin))
        if events:
            next(iter(events)).loop.call_soon_threadsafe(_deliver, events)

    def _drop_all(self, error: Exception | None) -> None:
        """After a failed step (or at exit): every request out of the generator, its pages freed; each live job
        gets `error` (if any)."""
        jobs = {job for job, _ in self._owner.values()}
        self._done(len(self._owner))
        self._owner.clear()
        self.gen.reset()
        if error is not None and jobs:
            next(iter(jobs)).loop.call_soon_threadsafe(_deliver, {job: [error] for job in jobs})


def _deliver(events: dict[Job, list]) -> None:
    """On the event loop: each job's events of one step into its queue."""
    for job, items in events.items():
        for item in items:
            job.queue.put_nowait(item)
