"""A second renderer of the four synthetic tasks, for evaluation only.

The training code never imports this module (``tests/toy/test_render_eval.py`` checks that),
so a model that scores well here has learned the tasks, not one renderer's pictures. Every
visual choice differs from :mod:`mminfer.offline.synthetic`:

  digits       dot-matrix glyphs (5 x 7 round dots) or single-stroke polylines, never a font
               or seven segments; drawn with a drop shadow, sliding in over their frames
  backgrounds  textures (checkerboard, stripes, rings, plaid) under a lighting gradient and
               a vignette, never flat, gradient or smooth noise
  distractors  stars, crosses, hexagons and rings' arcs on circular / figure-eight paths,
               never circles, rectangles or triangles on straight bounces
  ball         a shaded sphere (highlight, rim darkening, a cast shadow) on a Lissajous path
  flashes      red frames with a texture of two reds and the vignette
  camera       sensor noise, a JPEG round trip, and any frame size (not only squares)

The questions, answer sets and the answers' meaning are synth's (``synth.QUESTIONS``,
``synth.ANSWERS``): same task, other pictures. Seeds draw from streams of their own.
"""

from __future__ import annotations

import io

import numpy as np

from mminfer.offline.synthetic import ANSWERS, COLOURS, QUESTIONS, Example

import colorsys

from PIL import Image, ImageDraw

_TASK_IDS = {"needle": 11, "colour": 12, "count": 13, "order": 14}

# 5 x 7 dot-matrix digits (rows top to bottom, 1 = dot)
_DOTS = {
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11110", "00001", "00001", "01110", "00001", "00001", "11110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
}
# single-stroke digits as polylines in a 0..1 box (x right, y down)
_STROKES = {
    "0": [(0.5, 0), (0.9, 0.2), (0.9, 0.8), (0.5, 1), (0.1, 0.8), (0.1, 0.2), (0.5, 0)],
    "1": [(0.3, 0.2), (0.55, 0), (0.55, 1)],
    "2": [(0.1, 0.25), (0.5, 0), (0.9, 0.25), (0.1, 1), (0.9, 1)],
    "3": [(0.1, 0.1), (0.85, 0.1), (0.45, 0.45), (0.9, 0.7), (0.5, 1), (0.1, 0.85)],
    "4": [(0.7, 1), (0.7, 0), (0.1, 0.7), (0.95, 0.7)],
    "5": [(0.85, 0), (0.2, 0), (0.15, 0.45), (0.75, 0.45), (0.9, 0.75), (0.5, 1), (0.1, 0.9)],
    "6": [(0.8, 0.05), (0.2, 0.45), (0.15, 0.85), (0.5, 1), (0.85, 0.75), (0.5, 0.5),
          (0.2, 0.6)],
    "7": [(0.1, 0), (0.9, 0), (0.4, 1)],
    "8": [(0.5, 0.5), (0.15, 0.25), (0.5, 0), (0.85, 0.25), (0.5, 0.5), (0.1, 0.75),
          (0.5, 1), (0.9, 0.75), (0.5, 0.5)],
    "9": [(0.8, 0.4), (0.5, 0.5), (0.15, 0.25), (0.5, 0), (0.85, 0.2), (0.8, 0.6), (0.4, 1)],
}


def _rng(task: str, seed: int) -> np.random.Generator:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return np.random.default_rng([0xE7A1, _TASK_IDS[task], int(seed)])


def _not_red(rng, lo=0.15, hi=0.85) -> float:
    return float(rng.uniform(lo, hi))       # hue in turns, far from red at 0 / 1


def _hsv_rgb(h, s, v) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v)) * 255.0


# ---------------------------------------------------------------------- backgrounds
def _texture(rng, h: int, w: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    kind = rng.choice(["checker", "stripes", "rings", "plaid"])
    period = rng.uniform(0.06, 0.2) * min(h, w)
    if kind == "checker":
        t = ((xx // period + yy // period) % 2).astype(np.float32)
    elif kind == "stripes":
        a = rng.uniform(0, np.pi)
        t = (np.sin((xx * np.cos(a) + yy * np.sin(a)) * 2 * np.pi / period) > 0) * 1.0
    elif kind == "rings":
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        t = (np.sin(np.hypot(yy - cy, xx - cx) * 2 * np.pi / period) + 1) / 2
    else:
        t = ((np.sin(xx * 2 * np.pi / period) + np.sin(yy * 2 * np.pi / (period * 1.3))) + 2) / 4
    c1 = _hsv_rgb(_not_red(rng), rng.uniform(0.1, 0.45), rng.uniform(0.35, 0.75))
    c2 = _hsv_rgb(_not_red(rng), rng.uniform(0.1, 0.45), rng.uniform(0.35, 0.75))
    img = c1 * t[..., None] + c2 * (1 - t[..., None])
    # lighting: a linear gradient times a vignette
    a = rng.uniform(0, 2 * np.pi)
    g = 0.75 + 0.25 * ((xx / w - 0.5) * np.cos(a) + (yy / h - 0.5) * np.sin(a))
    vig = 1 - 0.35 * (((xx / w - 0.5) ** 2 + (yy / h - 0.5) ** 2) / 0.5)
    return (img * (g * vig)[..., None]).astype(np.float32), str(kind)


# ---------------------------------------------------------------------- shapes
def _polygon(kind: str, r: float, rot: float) -> np.ndarray:
    if kind == "star":
        ang = rot + np.arange(10) * np.pi / 5
        rad = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
    elif kind == "hexagon":
        ang = rot + np.arange(6) * np.pi / 3
        rad = np.full(6, r)
    else:       # cross
        s, t = r, r * 0.33
        pts = [(-t, -s), (t, -s), (t, -t), (s, -t), (s, t), (t, t), (t, s), (-t, s),
               (-t, t), (-s, t), (-s, -t), (-t, -t)]
        c, si = np.cos(rot), np.sin(rot)
        return np.array([(x * c - y * si, x * si + y * c) for x, y in pts])
    return np.stack([rad * np.cos(ang), rad * np.sin(ang)], 1)


def _distractors(rng, n_frames, h, w, neutral):
    shapes = []
    for _ in range(int(rng.integers(1, 5))):
        kind = str(rng.choice(["star", "cross", "hexagon"]))
        r = rng.uniform(0.05, 0.12) * min(h, w)
        col = (_hsv_rgb(0, 0, rng.uniform(0.5, 0.9)) if neutral
               else _hsv_rgb(_not_red(rng), rng.uniform(0.3, 0.8), rng.uniform(0.5, 0.95)))
        t = np.arange(n_frames) * rng.uniform(0.05, 0.3) + rng.uniform(0, 2 * np.pi)
        cx, cy = rng.uniform(0.25, 0.75) * w, rng.uniform(0.25, 0.75) * h
        ax, ay = rng.uniform(0.1, 0.25) * w, rng.uniform(0.1, 0.25) * h
        if rng.random() < 0.5:          # circle path
            x, y = cx + ax * np.cos(t), cy + ay * np.sin(t)
        else:                           # figure eight
            x, y = cx + ax * np.sin(t), cy + ay * np.sin(2 * t)
        spin = rng.uniform(-0.3, 0.3)
        shapes.append((kind, col, r, x, y, spin))
    return shapes


def _draw(frame: np.ndarray, shapes, i: int):
    img = Image.fromarray(frame)
    d = ImageDraw.Draw(img)
    for kind, col, r, x, y, spin in shapes:
        pts = _polygon(kind, r, spin * i) + (x[i], y[i])
        d.polygon([tuple(p) for p in pts], fill=tuple(int(c) for c in col))
    return np.asarray(img).copy()


def _sphere(frame: np.ndarray, cx, cy, r, rgb, light):
    h, w, _ = frame.shape
    # only the box that the shadow and the ball can touch is computed (the rest of the frame
    # is unchanged): the same pixels as over the whole frame, for a fraction of the work
    x0, x1 = max(0, int(cx - r) - 2), min(w, int(cx + 1.45 * r) + 3)
    y0, y1 = max(0, int(cy - r) - 2), min(h, int(cy + 1.9 * r) + 3)
    out = frame.copy()
    if x0 >= x1 or y0 >= y1:
        return out
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    # cast shadow below-right, then the sphere
    sd = np.hypot((xx - cx - 0.25 * r) / 1.2, yy - cy - 0.9 * r) / r
    shadow = np.clip(1 - sd, 0, 1) * 0.45
    box = frame[y0:y1, x0:x1].astype(np.float32) * (1 - shadow[..., None])
    dx, dy = (xx - cx) / r, (yy - cy) / r
    inside = dx * dx + dy * dy <= 1
    nz = np.sqrt(np.clip(1 - dx * dx - dy * dy, 0, 1))
    lx, ly, lz = light
    lam = np.clip(dx * lx + dy * ly + nz * lz, 0, 1)
    shade = 0.55 + 0.45 * lam
    spec = np.clip(lam, 0, 1) ** 40 * 90
    ball = np.array(rgb, np.float32) * shade[..., None] + spec[..., None]
    box[inside] = ball[inside]
    out[y0:y1, x0:x1] = np.clip(box, 0, 255).astype(np.uint8)
    return out


# ---------------------------------------------------------------------- digits
def _digit_mask(rng, text: str, height: int) -> np.ndarray:
    """Float mask [height, width] of the number, dot-matrix or strokes."""
    style = rng.choice(["dots", "strokes"])
    gw = int(height * 0.62)
    gap = max(2, int(height * 0.12))
    W = len(text) * gw + (len(text) - 1) * gap
    img = Image.new("L", (W, height), 0)
    d = ImageDraw.Draw(img)
    for j, ch in enumerate(text):
        x0 = j * (gw + gap)
        if style == "dots":
            cell = min(gw / 5, height / 7)
            rad = cell * rng.uniform(0.32, 0.46)
            for r, row in enumerate(_DOTS[ch]):
                for c, bit in enumerate(row):
                    if bit == "1":
                        cx, cy = x0 + (c + 0.5) * cell, (r + 0.5) * cell
                        d.ellipse([cx - rad, cy - rad, cx + rad, cy + rad], fill=255)
        else:
            wid = max(2, int(height * rng.uniform(0.09, 0.15)))
            pts = [(x0 + px * (gw - wid) + wid / 2, py * (height - wid) + wid / 2)
                   for px, py in _STROKES[ch]]
            d.line(pts, fill=255, width=wid, joint="curve")
    return np.asarray(img, np.float32) / 255.0, str(style)


def _stamp(rng, text: str, h: int, w: int):
    """A paint(frame, k, n) function that draws the number sliding in over k of n frames."""
    gh = int(rng.uniform(0.32, 0.5) * h)
    mask, style = _digit_mask(rng, text, gh)
    if mask.shape[1] > 0.9 * w:
        scale = 0.9 * w / mask.shape[1]
        from PIL import Image
        mask = np.asarray(Image.fromarray((mask * 255).astype(np.uint8)).resize(
            (int(mask.shape[1] * scale), max(4, int(gh * scale)))), np.float32) / 255
    mh, mw = mask.shape
    x = int(rng.integers(0, max(1, w - mw)))
    y = int(rng.integers(0, max(1, h - mh)))
    ink = _hsv_rgb(_not_red(rng), rng.uniform(0, 0.3), rng.choice([0.05, 0.97]))
    dark = ink.mean() < 128
    shadow_col = np.array([255.0, 255, 255]) if dark else np.array([0.0, 0, 0])
    off = max(1, gh // 12)
    slide = int(rng.integers(0, max(1, w // 8)))

    def paint(frame: np.ndarray, k: int, n: int) -> np.ndarray:
        out = frame.astype(np.float32)
        dx = int(slide * (1 - (k + 1) / n))     # slides to its place over the run
        for (oy, ox, col, a) in ((off, off, shadow_col, 0.6), (0, 0, ink, 1.0)):
            y0, x0 = y + oy, min(max(x + ox - dx, 0), w - mw)
            y0 = min(y0, h - mh)
            region = out[y0:y0 + mh, x0:x0 + mw]
            m = (mask * a)[..., None]
            region[:] = region * (1 - m) + col * m
        return np.clip(out, 0, 255).astype(np.uint8)

    return paint, {"style": style, "box": [x, y, mw, mh]}


# ---------------------------------------------------------------------- camera
def _camera(rng, frames: np.ndarray) -> np.ndarray:
    sigma = rng.uniform(2, 7)
    quality = int(rng.integers(30, 75))
    out = np.empty_like(frames)
    noise_rng = np.random.default_rng(rng.integers(1 << 31))
    for i, f in enumerate(frames):
        g = np.clip(f.astype(np.float32) + noise_rng.normal(0, sigma, f.shape), 0, 255)
        buf = io.BytesIO()
        Image.fromarray(g.astype(np.uint8)).save(buf, format="JPEG", quality=quality)
        out[i] = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    return out


def _scene(rng, n_frames, h, w, neutral=False):
    bg, kind = _texture(rng, h, w)
    if neutral:     # the colour task: a grey, dim scene so the ball is the only colour
        bg = bg.mean(-1, keepdims=True).repeat(3, -1) * 0.6
    shapes = _distractors(rng, n_frames, h, w, neutral)
    base = bg.clip(0, 255).astype(np.uint8)
    frames = np.stack([_draw(base, shapes, i) for i in range(n_frames)])
    return frames, {"background": kind, "distractors": [s[0] for s in shapes]}


def _check(n_frames, height, width, min_frames=1):
    if n_frames < min_frames:
        raise ValueError(f"this task needs at least {min_frames} frames, got {n_frames}")
    if height < 32 or width < 32:
        raise ValueError(f"frames must be at least 32x32, got {height}x{width}")


def _run(rng, n_frames, depth=None):
    length = int(rng.integers(1, 4))
    length = min(length, n_frames)
    depth = float(rng.random()) if depth is None else float(depth)
    start = int(round(depth * (n_frames - length)))
    return list(range(start, start + length)), depth


# ---------------------------------------------------------------------- tasks
def needle(seed: int, n_frames: int = 20, height: int = 240, width: int = 320, *,
           depth: float | None = None) -> Example:
    _check(n_frames, height, width)
    rng = _rng("needle", seed)
    number = int(rng.integers(10, 100))
    frames, meta = _scene(rng, n_frames, height, width)
    idx, depth = _run(rng, n_frames, depth)
    paint, desc = _stamp(rng, str(number), height, width)
    for k, i in enumerate(idx):
        frames[i] = paint(frames[i], k, len(idx))
    meta.update(number=number, needle_frames=idx, depth=depth, **desc)
    return Example("needle", _camera(rng, frames), QUESTIONS["needle"], str(number), meta)


def colour(seed: int, n_frames: int = 20, height: int = 240, width: int = 320) -> Example:
    _check(n_frames, height, width)
    rng = _rng("colour", seed)
    name = tuple(COLOURS)[int(rng.integers(len(COLOURS)))]
    frames, meta = _scene(rng, n_frames, height, width, neutral=True)
    rgb = np.clip(np.array(COLOURS[name]) * rng.uniform(0.85, 1.0), 0, 255)
    r = rng.uniform(0.1, 0.17) * min(height, width)
    t = np.arange(n_frames) * rng.uniform(0.1, 0.4)
    ax, ay = rng.uniform(0.15, 0.3) * width, rng.uniform(0.15, 0.3) * height
    fx, fy, ph = rng.uniform(0.7, 1.4), rng.uniform(0.7, 1.4), rng.uniform(0, 2 * np.pi)
    xs, ys = width / 2 + ax * np.sin(fx * t + ph), height / 2 + ay * np.sin(fy * t)
    light = np.array([rng.uniform(-0.6, 0.6), rng.uniform(-0.8, -0.2), 0.7])
    light = light / np.linalg.norm(light)
    for i in range(n_frames):
        frames[i] = _sphere(frames[i], xs[i], ys[i], r, rgb, light)
    meta.update(colour=name, radius=float(r))
    return Example("colour", _camera(rng, frames), QUESTIONS["colour"], name, meta)


def count(seed: int, n_frames: int = 20, height: int = 240, width: int = 320) -> Example:
    _check(n_frames, height, width)
    rng = _rng("count", seed)
    most = min(9, (n_frames + 1) // 2)
    k = int(rng.integers(1, most + 1))
    frames, meta = _scene(rng, n_frames, height, width)
    slots = np.sort(rng.choice(n_frames - k + 1, size=k, replace=False))
    flashes = [int(s + j) for j, s in enumerate(slots)]
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    for i in flashes:
        a, b = np.array([235.0, 20, 25]), np.array([190.0, 10, 40])
        period = rng.uniform(8, 30)
        t = (np.sin((xx + yy * rng.uniform(-1, 1)) * 2 * np.pi / period) > 0)[..., None]
        vig = 1 - 0.25 * (((xx / width - 0.5) ** 2 + (yy / height - 0.5) ** 2) / 0.5)
        frames[i] = np.clip((a * t + b * (1 - t)) * vig[..., None], 0, 255).astype(np.uint8)
    meta.update(count=k, flash_frames=flashes)
    return Example("count", _camera(rng, frames), QUESTIONS["count"], str(k), meta)


def order(seed: int, n_frames: int = 20, height: int = 240, width: int = 320) -> Example:
    _check(n_frames, height, width, min_frames=3)
    rng = _rng("order", seed)
    a, b = (int(v) for v in rng.choice(np.arange(10, 100), size=2, replace=False))
    frames, meta = _scene(rng, n_frames, height, width)
    l1, l2 = (int(v) for v in rng.integers(1, 3, size=2))
    while l1 + l2 + 1 > n_frames:
        l1, l2 = max(1, l1 - 1), max(1, l2 - (l1 == 1))
    s1 = int(rng.integers(0, n_frames - l1 - l2))
    s2 = int(rng.integers(s1 + l1 + 1, n_frames - l2 + 1))
    spans = [list(range(s1, s1 + l1)), list(range(s2, s2 + l2))]
    for num, span in zip((a, b), spans):
        paint, _ = _stamp(rng, str(num), height, width)
        for k, i in enumerate(span):
            frames[i] = paint(frames[i], k, len(span))
    meta.update(numbers=[a, b], needle_frames=spans)
    return Example("order", _camera(rng, frames), QUESTIONS["order"], str(a), meta)


TASKS = {"needle": needle, "colour": colour, "count": count, "order": order}
assert set(TASKS) == set(ANSWERS)


def make_example(task: str, seed: int, **kw) -> Example:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
    return TASKS[task](seed, **kw)
