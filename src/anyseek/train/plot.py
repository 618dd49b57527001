"""The loss-curve PNG written at the end of a run.

Uses matplotlib when it is installed; otherwise draws the curve itself (pure Python + zlib) so a fresh machine still
gets a picture: training loss in blue, validation loss as red squares, with a title, axis labels, tick labels and a
legend in a 3x5 pixel font (upper case). Both draw linear axes with round ticks (steps from 0) and room around the
points, so the last validation point is not cut by the frame.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from pathlib import Path, PurePath

W, H, MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 800, 450, 70, 20, 40, 50


def write_loss_curve(path: Path, train: list[tuple[int, float]], val: list[tuple[int, float]], title: str = "") -> Path:
    """train, val: (step, loss) points. title: "FLAVOR on DATA"; a path for DATA is shown as its folder's name."""
    title = short_title(title)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001  no (or a broken) matplotlib: the built-in drawing
        _write_png(path, _draw(train, val, title))
        return path
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "s-", label="validation loss", ms=4, clip_on=False)
    ax.set_xscale("linear")
    ax.set_xlim(left=0)
    ax.margins(x=0.03, y=0.05)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def short_title(title: str) -> str:
    """'tiny on /home/me/data/enwiki/' -> 'tiny on enwiki': the data folder's name, not its whole path (a file
    pattern such as data/*.jsonl gives its folder's name)."""
    head, sep, where = title.rpartition(" on ")
    if not sep or ("/" not in where and "\\" not in where):
        return title
    p = PurePath(where.rstrip("/\\"))
    name = p.parent.name if any(c in p.name for c in "*?[") else p.name
    return f"{head} on {name or where}"


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values (1, 2, 2.5 or 5 times a power of ten apart) covering [lo, hi]: the first <= lo, the last
    >= hi."""
    span = hi - lo if hi > lo else abs(hi) or 1.0
    raw = span / max(n - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    count = max(1, math.ceil((hi - first) / step - 1e-9))
    return [first + i * step for i in range(count + 1)]


# 3x5 glyphs, rows top to bottom, 3 bits each.
_FONT = {
    "0": [7, 5, 5, 5, 7], "1": [2, 6, 2, 2, 7], "2": [7, 1, 7, 4, 7], "3": [7, 1, 7, 1, 7], "4": [5, 5, 7, 1, 1],
    "5": [7, 4, 7, 1, 7], "6": [7, 4, 7, 5, 7], "7": [7, 1, 1, 1, 1], "8": [7, 5, 7, 5, 7], "9": [7, 5, 7, 1, 7],
    ".": [0, 0, 0, 0, 2], "-": [0, 0, 7, 0, 0], " ": [0, 0, 0, 0, 0], "/": [1, 1, 2, 4, 4], ":": [0, 2, 0, 2, 0],
    "_": [0, 0, 0, 0, 7], "(": [1, 2, 2, 2, 1], ")": [4, 2, 2, 2, 4],
    "A": [2, 5, 7, 5, 5], "B": [6, 5, 6, 5, 6], "C": [3, 4, 4, 4, 3], "D": [6, 5, 5, 5, 6], "E": [7, 4, 6, 4, 7],
    "F": [7, 4, 6, 4, 4], "G": [3, 4, 5, 5, 3], "H": [5, 5, 7, 5, 5], "I": [7, 2, 2, 2, 7], "J": [1, 1, 1, 5, 2],
    "K": [5, 5, 6, 5, 5], "L": [4, 4, 4, 4, 7], "M": [5, 7, 7, 5, 5], "N": [6, 5, 5, 5, 5], "O": [2, 5, 5, 5, 2],
    "P": [6, 5, 6, 4, 4], "Q": [2, 5, 5, 6, 3], "R": [6, 5, 6, 5, 5], "S": [3, 4, 2, 1, 6], "T": [7, 2, 2, 2, 2],
    "U": [5, 5, 5, 5, 7], "V": [5, 5, 5, 5, 2], "W": [5, 5, 7, 7, 5], "X": [5, 5, 2, 5, 5], "Y": [5, 5, 2, 2, 2],
    "Z": [7, 1, 2, 4, 7],
}


def _draw(train: list[tuple[int, float]], val: list[tuple[int, float]], title: str = "") -> list[bytearray]:
    img = [bytearray(b"\xff" * (W * 3)) for _ in range(H)]
    black, blue, red, grey = (0, 0, 0), (31, 119, 180), (214, 39, 40), (200, 200, 200)
    _text(img, title.upper()[: (W - 20) // 8], 10, 8, black, scale=2)
    _text(img, "STEP", (W - 4 * 12) // 2, H - 20, black)
    _text(img, "LOSS", 4, MARGIN_T - 19, black, scale=2)
    points = train + val
    if points:
        _plot(img, train, val, points, black, blue, red, grey)
    legend_u = W - MARGIN_R - 8 * 18 - 30  # legend, top right: a blue line for train, a red square for validation
    for k in range(20):
        _set(img, legend_u + k, MARGIN_T + 8, blue)
    _text(img, "TRAIN LOSS", legend_u + 26, MARGIN_T + 4, black, scale=2)
    for dv in range(-3, 4):
        for du in range(-3, 4):
            _set(img, legend_u + 10 + du, MARGIN_T + 26 + dv, red)
    _text(img, "VALIDATION LOSS", legend_u + 26, MARGIN_T + 22, black, scale=2)
    return img


def _plot(img, train, val, points, black, blue, red, grey) -> None:
    """Axes, round ticks and the points. x: linear from 0 (or the first tick below the first step) to 3% past the
    last step; y: 5% of the range beyond the lowest and highest loss, so no point sits on the frame."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_ticks = ticks(min(0, min(xs)), max(xs))
    x0, x1 = x_ticks[0], max(xs) + 0.03 * ((max(xs) - x_ticks[0]) or 1)
    pad = 0.05 * ((max(ys) - min(ys)) or max(abs(max(ys)), 1e-3))
    y_ticks = [y for y in ticks(min(ys) - pad, max(ys) + pad) if min(ys) - pad <= y <= max(ys) + pad]
    y0, y1 = min(ys) - pad, max(ys) + pad
    x_ticks = [x for x in x_ticks if x <= x1]

    def px(x: float, y: float) -> tuple[int, int]:
        u = MARGIN_L + (x - x0) / (x1 - x0) * (W - MARGIN_L - MARGIN_R)
        v = H - MARGIN_B - (y - y0) / (y1 - y0) * (H - MARGIN_T - MARGIN_B)
        return round(u), round(v)

    def dot(u: int, v: int, rgb: tuple[int, int, int], r: int = 0) -> None:
        for yy in range(v - r, v + r + 1):
            for xx in range(u - r, u + r + 1):
                _set(img, xx, yy, rgb)

    def line(a: tuple[int, int], b: tuple[int, int], rgb: tuple[int, int, int]) -> None:
        n = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(n + 1):
            dot(a[0] + (b[0] - a[0]) * i // n, a[1] + (b[1] - a[1]) * i // n, rgb)

    for y in y_ticks:  # horizontal grid lines with labels
        _, v = px(x0, y)
        line((MARGIN_L, v), (W - MARGIN_R, v), grey)
        _text(img, f"{round(y, 9):g}", 4, v - 5, black, scale=2)
    for x in x_ticks:  # tick marks and labels under the x axis
        u, _ = px(x, y0)
        line((u, H - MARGIN_B), (u, H - MARGIN_B + 4), black)
        label = f"{x:g}"
        _text(img, label, u - 4 * len(label) + 1, H - MARGIN_B + 8, black, scale=2)
    line((MARGIN_L, H - MARGIN_B), (W - MARGIN_R, H - MARGIN_B), black)
    line((MARGIN_L, MARGIN_T), (MARGIN_L, H - MARGIN_B), black)
    for a, b in itertools.pairwise(train):
        line(px(*a), px(*b), blue)
    for p in val:
        dot(*px(*p), red, r=3)


def _set(img: list[bytearray], x: int, y: int, rgb: tuple[int, int, int]) -> None:
    if 0 <= x < W and 0 <= y < H:
        img[y][3 * x: 3 * x + 3] = bytes(rgb)


def _text(img: list[bytearray], s: str, u: int, v: int, rgb: tuple[int, int, int], scale: int = 3) -> None:
    for k, ch in enumerate(s):
        for row, bits in enumerate(_FONT.get(ch.upper(), [7, 5, 5, 5, 7])):
            for col in range(3):
                if bits >> (2 - col) & 1:
                    for dy in range(scale):
                        for dx in range(scale):
                            x, y = u + k * 4 * scale + col * scale + dx, v + row * scale + dy
                            if 0 <= x < W and 0 <= y < H:
                                img[y][3 * x: 3 * x + 3] = bytes(rgb)


def _write_png(path: Path, rows: list[bytearray]) -> None:
    raw = b"".join(b"\x00" + bytes(r) for r in rows)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", W, len(rows), 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
                     + chunk(b"IEND", b""))
