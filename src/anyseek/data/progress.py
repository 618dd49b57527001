"""PrepareProgress reporting for prepare (tqdm when installed, else a line every few seconds) and a prefetch thread."""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator


class PrepareProgress:
    """MB of text per phase on stderr; silent when `enabled` is False."""

    def __init__(self, enabled: bool = True, every_s: float = 5.0):
        self.enabled, self.every_s = enabled, every_s
        self._bar, self._phase, self._bytes, self._t0, self._last = None, None, 0, 0.0, 0.0

    def update(self, phase: str, nbytes: int) -> None:
        if not self.enabled:
            return
        if phase != self._phase:
            self.end_phase()
            self._phase, self._bytes, self._t0 = phase, 0, time.perf_counter()
            self._last = self._t0
            try:
                from tqdm import tqdm

                self._bar = tqdm(desc=phase, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
            except ImportError:
                self._bar = None
        self._bytes += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            print(f"{self._phase}: {self._bytes / 1e6:.1f} MB, {self._bytes / 1e6 / (now - self._t0):.1f} MB/s",
                  file=sys.stderr, flush=True)  # fmt: skip

    def end_phase(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._phase = None

    def done(self, message: str) -> None:
        self.end_phase()
        if self.enabled:
            print(message, file=sys.stderr, flush=True)


_END = object()


def prefetch(items: Iterable, depth: int = 4) -> Iterator:
    """Run `items` in a background thread, `depth` ahead; exceptions re-raise here; closing stops the thread."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for x in items:
                if not put((True, x)):
                    return
            put((True, _END))
        except BaseException as e:  # noqa: BLE001  handed to the consumer
            put((False, e))

    thread = threading.Thread(target=work, daemon=True, name="anyseek-prefetch")
    thread.start()
    try:
        while True:
            ok, x = q.get()
            if not ok:
                raise x
            if x is _END:
                return
            yield x
    finally:
        stop.set()
        thread.join(timeout=5)
