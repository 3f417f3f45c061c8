"""Procedurally generated video QA tasks, reproducible from a seed.

Four tasks, each a function ``task(seed, n_frames, height, width, **options) -> Example``:

  needle  a two-digit number (10-99) shows on one frame or a short run of frames;
          "What number appears in the video?"
  colour  one ball moves through the video; "What color is the ball?"
  count   1-9 single frames flash full-screen red; "How many red flashes are there?"
  order   two needles with different numbers; "Which number appears first?"

Renderings vary (digit fonts: PIL's bitmap font scaled up, PIL's built-in vector font,
system TrueType fonts when present, our own seven-segment glyphs; sizes, italics,
outlines and plates; backgrounds; distractor shapes and their motion) so that a model
learns the task rather than one picture. The answer is never visible by accident: digits
appear only in needles, red full-screen frames only as counted flashes, distractor shapes
are never red, and in the colour task the ball is the only circle and the only saturated
object.

Generation is seeded per (task, seed) and does not depend on the machine, except that the
"system" font style draws with whatever TrueType fonts are installed (DejaVu on Debian);
where none are, it uses PIL's built-in vector font, and the random stream is unchanged.
Frames are sized for small models too: at 56-112 px the digits stay about 30-55 % of the
frame height and the ball is at least about a tenth of the frame side across.
"""
from __future__ import annotations

import colorsys
import glob
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache

import av
import numpy as np
from PIL import Image, ImageDraw, ImageFont

QUESTIONS = {
    "needle": "What number appears in the video?",
    "colour": "What color is the ball?",
    "count": "How many red flashes are there?",
    "order": "Which number appears first?",
}

# Canonical ball colours (RGB); a generated ball is jittered around its entry.
COLOURS = {
    "red": (225, 30, 30),
    "orange": (255, 140, 0),
    "yellow": (250, 230, 25),
    "green": (30, 185, 45),
    "blue": (35, 85, 235),
    "purple": (140, 45, 195),
    "pink": (255, 125, 195),
    "white": (245, 245, 245),
}

NUMBERS = tuple(str(n) for n in range(10, 100))
ANSWERS = {
    "needle": NUMBERS,
    "colour": tuple(COLOURS),
    "count": tuple(str(n) for n in range(1, 10)),
    "order": NUMBERS,
}


def _question_words(q: str) -> list[str]:
    return q.lower().replace("?", " ?").split()


def _vocab() -> tuple[str, ...]:
    words: list[str] = []
    for q in QUESTIONS.values():
        words += [w for w in _question_words(q) if w not in words]
    for task in ("colour", "count", "needle"):
        words += [a for a in ANSWERS[task] if a not in words]
    return tuple(words)


# Every word a question or an answer can hold (questions lower-cased, "?" its own word).
ANSWER_VOCAB = _vocab()

_TASK_IDS = {"needle": 1, "colour": 2, "count": 3, "order": 4}


@dataclass
class Example:
    task: str
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    question: str
    answer: str
    meta: dict = field(default_factory=dict)


# ------------------------------------------------------------------------ colours

def _hsv(h, s, v) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v)) * 255.0


def _non_red_hue(rng) -> float:
    # Keep saturated colours at least ~30 degrees of hue away from red, so nothing but a
    # counted flash (or the colour task's red ball) reads as red.
    return float(rng.uniform(0.085, 0.915))


def _luma(rgb) -> float:
    r, g, b = rgb
    return 0.299 * r + 0.587 * g + 0.114 * b


def red_frames(frames: np.ndarray) -> list[int]:
    """Indices of frames that are mostly red (the count task's flashes)."""
    f = np.asarray(frames).astype(np.int16)
    red = (f[..., 0] > 150) & (f[..., 1] < 90) & (f[..., 2] < 90)
    return [int(i) for i in np.nonzero(red.mean(axis=(1, 2)) > 0.5)[0]]


# ---------------------------------------------------------------------- backgrounds

def _background(rng, h: int, w: int, neutral: bool) -> tuple[np.ndarray, str]:
    """A float32 [H, W, 3] background: solid, gradient or smooth noise, never red.

    ``neutral``: dark, nearly grey (the colour task, so the ball's hue stands out)."""
    def pick():
        if neutral:
            return _hsv(rng.random(), rng.uniform(0, 0.15), rng.uniform(0.05, 0.35))
        return _hsv(_non_red_hue(rng), rng.uniform(0, 0.55), rng.uniform(0.1, 0.9))

    base = pick()
    style = ("solid", "gradient", "noise")[rng.integers(3)]
    img = np.broadcast_to(base, (h, w, 3)).astype(np.float32)
    if style == "gradient":
        # saturation <= 0.55 keeps every channel >= 45 % of the brightest one, so no
        # blend of two such colours reads as red either
        other = pick()
        angle = rng.uniform(0, 2 * math.pi)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        t = ((xx / max(w - 1, 1) - 0.5) * math.cos(angle)
             + (yy / max(h - 1, 1) - 0.5) * math.sin(angle))
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        img = base * (1 - t[..., None]) + other * t[..., None]
    elif style == "noise":
        amp = 12 if neutral else 30
        coarse = rng.uniform(-amp, amp, (4, 4, 1)).astype(np.float32)
        ys = np.linspace(0, 3, h)
        xs = np.linspace(0, 3, w)
        # bilinear upsampling of a 4x4 grid: soft blotches, no edges to mistake for objects
        y0 = np.minimum(ys.astype(int), 2)
        x0 = np.minimum(xs.astype(int), 2)
        fy = (ys - y0)[:, None, None]
        fx = (xs - x0)[None, :, None]
        c = coarse
        up = (c[y0][:, x0] * (1 - fy) * (1 - fx) + c[y0 + 1][:, x0] * fy * (1 - fx)
              + c[y0][:, x0 + 1] * (1 - fy) * fx + c[y0 + 1][:, x0 + 1] * fy * fx)
        img = img + up
    return np.clip(img, 0, 255).astype(np.float32), style


# --------------------------------------------------------------------------- motion

def _bounce(p0: float, v: float, lo: float, hi: float, n: int) -> np.ndarray:
    """Positions of a point moving at speed v and reflecting off [lo, hi]."""
    span = max(hi - lo, 1e-6)
    x = (p0 - lo + v * np.arange(n)) % (2 * span)
    return lo + np.where(x > span, 2 * span - x, x)


def _path(rng, n: int, h: int, w: int, r: float) -> tuple[np.ndarray, np.ndarray, str]:
    """Centre positions (x, y) of an object of radius r over n frames, inside the frame."""
    kind = ("bounce", "orbit", "wave")[rng.integers(3)]
    lo_x, hi_x, lo_y, hi_y = r, w - 1 - r, r, h - 1 - r
    t = np.arange(n)
    if kind == "bounce":
        speed = rng.uniform(0.03, 0.12) * min(h, w)
        a = rng.uniform(0, 2 * math.pi)
        x = _bounce(rng.uniform(lo_x, hi_x), speed * math.cos(a), lo_x, hi_x, n)
        y = _bounce(rng.uniform(lo_y, hi_y), speed * math.sin(a), lo_y, hi_y, n)
    elif kind == "orbit":
        cx, cy = (lo_x + hi_x) / 2, (lo_y + hi_y) / 2
        rad = rng.uniform(0.3, 1.0) * min(hi_x - cx, hi_y - cy)
        om = rng.uniform(0.1, 0.5) * rng.choice([-1, 1])
        ph = rng.uniform(0, 2 * math.pi)
        x, y = cx + rad * np.cos(ph + om * t), cy + rad * np.sin(ph + om * t)
    else:
        speed = rng.uniform(0.02, 0.08) * w
        x = _bounce(rng.uniform(lo_x, hi_x), speed * rng.choice([-1, 1]), lo_x, hi_x, n)
        cy, amp = (lo_y + hi_y) / 2, rng.uniform(0.2, 0.9) * (hi_y - lo_y) / 2
        y = cy + amp * np.sin(rng.uniform(0.2, 0.8) * t + rng.uniform(0, 2 * math.pi))
    return x, y, kind


@dataclass
class _Shape:
    kind: str  # circle, rect, triangle
    colour: tuple
    r: float
    x: np.ndarray
    y: np.ndarray
    spin: float
    angle0: float


def _distractors(rng, n_frames, h, w, *, neutral: bool, kinds, bg_value: float) -> list[_Shape]:
    n = int(rng.integers(2, 6))
    shapes = []
    for _ in range(n):
        kind = kinds[rng.integers(len(kinds))]
        r = rng.uniform(0.05, 0.13) * min(h, w)
        if neutral:  # grey, far enough from the background's brightness to be seen
            v = (bg_value + rng.uniform(0.2, 0.6)) % 1.0
            v = min(max(v, 0.2), 0.85)
            colour = tuple(int(c) for c in np.full(3, v * 255))
        else:
            colour = tuple(int(c) for c in _hsv(_non_red_hue(rng), rng.uniform(0.3, 1.0),
                                                 rng.uniform(0.35, 1.0)))
        x, y, _ = _path(rng, n_frames, h, w, r)
        shapes.append(_Shape(kind, colour, r, x, y, rng.uniform(-0.4, 0.4),
                             rng.uniform(0, 2 * math.pi)))
    return shapes


def _draw_scene(bg: np.ndarray, shapes: list[_Shape], n_frames: int) -> np.ndarray:

    base = Image.fromarray(bg.astype(np.uint8))
    frames = []
    for t in range(n_frames):
        im = base.copy()
        d = ImageDraw.Draw(im)
        for s in shapes:
            x, y, r = float(s.x[t]), float(s.y[t]), s.r
            if s.kind == "circle":
                d.ellipse((x - r, y - r, x + r, y + r), fill=s.colour)
            else:
                k = 4 if s.kind == "rect" else 3
                a = s.angle0 + s.spin * t
                pts = [(x + r * math.cos(a + 2 * math.pi * j / k),
                        y + r * math.sin(a + 2 * math.pi * j / k)) for j in range(k)]
                d.polygon(pts, fill=s.colour)
        frames.append(np.asarray(im))
    return np.stack(frames)


def _scene(rng, n_frames, h, w, *, neutral=False, kinds=("circle", "rect", "triangle")):
    bg, bg_style = _background(rng, h, w, neutral)
    bg_value = float(bg.mean()) / 255.0
    shapes = _distractors(rng, n_frames, h, w, neutral=neutral, kinds=kinds, bg_value=bg_value)
    return bg, shapes, {"background": bg_style, "distractors": len(shapes)}


# ---------------------------------------------------------------------------- digits

_SEGMENTS = {  # seven-segment digits: a b c d e f g
    "0": "abcdef", "1": "bc", "2": "abdeg", "3": "abcdg", "4": "bcfg",
    "5": "acdfg", "6": "acdefg", "7": "abc", "8": "abcdefg", "9": "abcdfg",
}
FONT_STYLES = ("bitmap", "vector", "system", "segment")


@lru_cache(maxsize=1)
def _system_fonts() -> tuple[str, ...]:
    # Bold and regular sans/serif/mono faces with plain digits; sorted for a stable order.
    found = []
    for d in ("/usr/share/fonts", "/usr/local/share/fonts", os.path.expanduser("~/.fonts")):
        found += glob.glob(os.path.join(d, "**", "*.ttf"), recursive=True)
    keep = [f for f in found if "DejaVu" in os.path.basename(f)
            and not any(k in os.path.basename(f) for k in ("ExtraLight", "Math"))]
    return tuple(sorted(keep))


def _segment_glyph(digit: str, h: int, thick: float) -> np.ndarray:
    """Anti-aliased seven-segment glyph (float mask [h, 0.55 h]) drawn at 4x and averaged."""

    s = 4
    H, W = h * s, max(int(h * 0.55), 3) * s
    T = max(thick * H, s)
    im = Image.new("L", (W, H), 0)
    d = ImageDraw.Draw(im)
    mid = H / 2
    segs = {
        "a": (T, 0, W - T, T), "d": (T, H - T, W - T, H),
        "g": (T, mid - T / 2, W - T, mid + T / 2),
        "f": (0, T / 2, T, mid), "b": (W - T, T / 2, W, mid),
        "e": (0, mid, T, H - T / 2), "c": (W - T, mid, W, H - T / 2),
    }
    for name in _SEGMENTS[digit]:
        d.rectangle(segs[name], fill=255)
    a = np.asarray(im, dtype=np.float32) / 255.0
    return a.reshape(h, s, W // s, s).mean(axis=(1, 3))


def _font_mask(rng, text: str, height: int) -> tuple[np.ndarray, str]:
    """An anti-aliased mask (float32 [h, w] in [0, 1]) of ``text`` whose ink is ``height``
    pixels tall, in a randomly chosen font style."""

    style = FONT_STYLES[rng.integers(len(FONT_STYLES))]
    u_font, u_bold, u_slant, u_wide = rng.random(4)
    slant = (u_slant - 0.5) * 0.5 if u_slant > 0.65 or u_slant < 0.15 else 0.0
    widen = 0.8 + 0.45 * u_wide
    if style == "segment":
        thick = 0.11 + 0.09 * u_bold
        gap = np.zeros((height, max(1, int(0.18 * height))), np.float32)
        parts = []
        for c in text:
            parts += [_segment_glyph(c, height, thick), gap]
        a = np.concatenate(parts[:-1], axis=1)
        mask = _resize(a, height, int(a.shape[1] * widen))
        return (_shear(mask, slant) if slant else mask), style
    if style == "bitmap":
        font, size, stroke = ImageFont.load_default_imagefont(), None, 0
    else:
        size = int(height * 1.5)
        stroke = int(u_bold * 0.09 * size)
        font = None
        if style == "system" and _system_fonts():
            fonts = _system_fonts()
            font = ImageFont.truetype(fonts[int(u_font * len(fonts))], size)
        if font is None:
            font = ImageFont.load_default(size=size)
    l, t, r, b = ImageDraw.Draw(Image.new("L", (1, 1))).textbbox(
        (0, 0), text, font=font, stroke_width=stroke)
    im = Image.new("L", (r - l + 4, b - t + 4), 0)
    ImageDraw.Draw(im).text((2 - l, 2 - t), text, font=font, fill=255, stroke_width=stroke,
                            stroke_fill=255)
    a = np.asarray(im, dtype=np.float32) / 255.0
    ys, xs = np.nonzero(a > 0.05)
    a = a[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1]
    nearest = style == "bitmap"  # keep the scaled-up bitmap font blocky
    w = int(round(a.shape[1] * height / a.shape[0] * widen))
    mask = _resize(a, height, w, nearest=nearest)
    if slant and not nearest:  # a sheared 7-pixel font turns 5 into $
        mask = _shear(mask, slant)
    return mask, style


def _resize(a: np.ndarray, h: int, w: int, nearest: bool = False) -> np.ndarray:

    im = Image.fromarray((np.clip(a, 0, 1) * 255).astype(np.uint8))
    im = im.resize((max(w, 1), max(h, 1)), Image.NEAREST if nearest else Image.BILINEAR)
    return np.asarray(im, dtype=np.float32) / 255.0


def _shear(a: np.ndarray, slant: float) -> np.ndarray:
    """Italicise a mask: row y moves right by slant * (h/2 - y)."""

    h, w = a.shape
    extra = int(math.ceil(abs(slant) * h / 2)) + 1
    im = Image.fromarray((np.pad(a, ((0, 0), (extra, extra))) * 255).astype(np.uint8))
    im = im.transform(im.size, Image.AFFINE, (1, slant, -slant * h / 2, 0, 1, 0),
                      resample=Image.BILINEAR)
    out = np.asarray(im, dtype=np.float32) / 255.0
    cols = np.nonzero(out.max(axis=0) > 0.05)[0]
    return out[:, cols.min(): cols.max() + 1]


def _dilate(a: np.ndarray, k: int) -> np.ndarray:
    out = a.copy()
    p = np.pad(a, k)
    h, w = a.shape
    for dy in range(-k, k + 1):
        for dx in range(-k, k + 1):
            if dy * dy + dx * dx <= k * k:
                out = np.maximum(out, p[k + dy: k + dy + h, k + dx: k + dx + w])
    return out


_BRIGHT = ((255, 255, 255), (255, 235, 60), (90, 255, 255), (170, 255, 120), (255, 200, 120))
_DARK = ((0, 0, 0), (20, 20, 90), (40, 40, 40), (10, 70, 30), (70, 20, 90))


def _text_stamp(rng, text: str, h: int, w: int, bg: np.ndarray):
    """Where and how a number is drawn: returns a function that paints it onto a frame,
    its box (x0, y0, x1, y1) and a description for the metadata."""
    th = int(round(rng.uniform(0.3, 0.55) * h))
    mask, font = _font_mask(rng, text, th)
    if mask.shape[1] > 0.9 * w:  # too wide: shrink to fit
        s = 0.9 * w / mask.shape[1]
        mask = _resize(mask, max(int(mask.shape[0] * s), 8), int(mask.shape[1] * s))
    mh, mw = mask.shape
    pad = max(2, int(0.06 * mh))
    x0 = int(rng.integers(pad, max(pad + 1, w - mw - pad + 1)))
    y0 = int(rng.integers(pad, max(pad + 1, h - mh - pad + 1)))
    region = bg[y0: y0 + mh, x0: x0 + mw].reshape(-1, 3).mean(0)
    deco = ("plain", "outline", "plate")[rng.integers(3)]
    dark_text = _luma(region) > 128
    if deco == "plate":  # the plate sets the contrast, whatever is underneath
        dark_text = bool(rng.integers(2))
    palette = _DARK if dark_text else _BRIGHT
    colour = np.array(palette[rng.integers(len(palette))], np.float32)
    other = np.array((_BRIGHT if dark_text else _DARK)[rng.integers(len(_DARK))], np.float32)
    if deco == "plate":
        plate_val = rng.uniform(200, 245) if dark_text else rng.uniform(10, 60)
        plate = np.full(3, plate_val, np.float32)
    outline = _dilate(mask, max(1, int(round(0.07 * mh)))) if deco == "outline" else None

    def paint(frame: np.ndarray) -> np.ndarray:
        out = frame.astype(np.float32)
        if deco == "plate":
            out[max(0, y0 - pad): y0 + mh + pad, max(0, x0 - pad): x0 + mw + pad] = plate
        sub = out[y0: y0 + mh, x0: x0 + mw]
        if outline is not None:
            sub[:] = sub * (1 - outline[..., None]) + other * outline[..., None]
        sub[:] = sub * (1 - mask[..., None]) + colour * mask[..., None]
        return np.clip(out + 0.5, 0, 255).astype(np.uint8)

    desc = {"font": font, "text_height": mh, "decoration": deco,
            "colour": [int(c) for c in colour]}
    return paint, (x0, y0, x0 + mw, y0 + mh), desc


# ----------------------------------------------------------------------------- tasks

def _rng(task: str, seed: int) -> np.random.Generator:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return np.random.default_rng([_TASK_IDS[task], int(seed)])


def _check_size(n_frames, height, width, min_frames=1):
    if n_frames < min_frames:
        raise ValueError(f"this task needs at least {min_frames} frames, got {n_frames}")
    if height < 16 or width < 16:
        raise ValueError(f"frames must be at least 16x16, got {height}x{width}")


def _needle_span(rng, n_frames, length, depth):
    length = int(rng.integers(1, 3)) if length is None else int(length)
    length = min(length, n_frames)
    depth = float(rng.random()) if depth is None else float(depth)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    start = int(round(depth * (n_frames - length)))
    return list(range(start, start + length)), depth


def needle(seed: int, n_frames: int = 20, height: int = 224, width: int = 224, *,
           number: int | None = None, depth: float | None = None,
           needle_frames: int | None = None) -> Example:
    """A two-digit number on ``needle_frames`` consecutive frames (1 or 2 when None) at
    ``depth`` (0 = first frame, 1 = last) of a video of moving shapes."""
    _check_size(n_frames, height, width)
    rng = _rng("needle", seed)
    number = int(rng.integers(10, 100)) if number is None else int(number)
    if not 10 <= number <= 99:
        raise ValueError(f"number must be two digits (10-99), got {number}")
    bg, shapes, meta = _scene(rng, n_frames, height, width)
    frames = _draw_scene(bg, shapes, n_frames)
    idx, depth = _needle_span(rng, n_frames, needle_frames, depth)
    paint, box, desc = _text_stamp(rng, str(number), height, width, bg)
    for i in idx:
        frames[i] = paint(frames[i])
    meta.update(number=number, needle_frames=idx, depth=depth, box=box, **desc)
    return Example("needle", frames, QUESTIONS["needle"], str(number), meta)


def colour(seed: int, n_frames: int = 20, height: int = 224, width: int = 224, *,
           colour: str | None = None) -> Example:
    """One ball, jittered around a named colour, moving over a dark near-grey background
    with grey non-circular distractors."""
    _check_size(n_frames, height, width)
    rng = _rng("colour", seed)
    names = tuple(COLOURS)
    name = names[rng.integers(len(names))] if colour is None else colour
    if name not in COLOURS:
        raise ValueError(f"unknown colour {name!r}; use one of {', '.join(names)}")
    bg, shapes, meta = _scene(rng, n_frames, height, width, neutral=True,
                              kinds=("rect", "triangle"))
    rgb = tuple(int(c) for c in np.clip(np.array(COLOURS[name]) + rng.integers(-12, 13, 3),
                                        0, 255))
    r = rng.uniform(0.09, 0.16) * min(height, width)
    x, y, path = _path(rng, n_frames, height, width, r)
    shapes.append(_Shape("circle", rgb, r, x, y, 0.0, 0.0))  # drawn last: always on top
    frames = _draw_scene(bg, shapes, n_frames)
    meta.update(colour=name, rgb=list(rgb), radius=float(r), path=path,
                centres=np.stack([x, y], 1).round(1).tolist())
    return Example("colour", frames, QUESTIONS["colour"], name, meta)


def count(seed: int, n_frames: int = 20, height: int = 224, width: int = 224, *,
          count: int | None = None) -> Example:
    """``count`` single red frames (1-9), never two in a row, among moving shapes."""
    _check_size(n_frames, height, width)
    rng = _rng("count", seed)
    most = min(9, (n_frames + 1) // 2)
    k = int(rng.integers(1, most + 1)) if count is None else int(count)
    if not 1 <= k <= most:
        raise ValueError(f"count must be in [1, {most}] for {n_frames} frames, got {k}")
    bg, shapes, meta = _scene(rng, n_frames, height, width)
    frames = _draw_scene(bg, shapes, n_frames)
    # k flashes with at least one ordinary frame between: choose k of n-k+1 slots and
    # spread them apart by their rank.
    slots = np.sort(rng.choice(n_frames - k + 1, size=k, replace=False))
    flashes = [int(s + j) for j, s in enumerate(slots)]
    for i in flashes:
        red = np.array([rng.uniform(200, 255), rng.uniform(0, 35), rng.uniform(0, 35)])
        shade = rng.uniform(0.92, 1.0, (height, 1, 1)) if rng.random() < 0.5 else 1.0
        flash = np.broadcast_to(red, (height, width, 3)) * shade
        frames[i] = np.clip(flash, 0, 255).astype(np.uint8)
    meta.update(count=k, flash_frames=flashes)
    return Example("count", frames, QUESTIONS["count"], str(k), meta)


def order(seed: int, n_frames: int = 20, height: int = 224, width: int = 224, *,
          numbers: tuple[int, int] | None = None) -> Example:
    """Two needles with different numbers, at different times; the answer is the first."""
    _check_size(n_frames, height, width, min_frames=3)
    rng = _rng("order", seed)
    if numbers is None:
        a, b = (int(v) for v in rng.choice(np.arange(10, 100), size=2, replace=False))
    else:
        a, b = (int(v) for v in numbers)
    if a == b or not (10 <= a <= 99 and 10 <= b <= 99):
        raise ValueError(f"numbers must be two different two-digit numbers, got {numbers}")
    bg, shapes, meta = _scene(rng, n_frames, height, width)
    frames = _draw_scene(bg, shapes, n_frames)
    l1, l2 = (int(v) for v in rng.integers(1, 3, size=2))
    while l1 + l2 + 1 > n_frames:  # short videos: shorten the runs
        l1, l2 = max(1, l1 - 1), max(1, l2 - (l1 == 1))
    s1 = int(rng.integers(0, n_frames - l1 - l2))  # leave a gap frame before the second
    s2 = int(rng.integers(s1 + l1 + 1, n_frames - l2 + 1))
    spans = [list(range(s1, s1 + l1)), list(range(s2, s2 + l2))]
    boxes, descs = [], []
    for num, span in zip((a, b), spans):
        paint, box, desc = _text_stamp(rng, str(num), height, width, bg)
        for i in span:
            frames[i] = paint(frames[i])
        boxes.append(box)
        descs.append(desc)
    meta.update(numbers=[a, b], needle_frames=spans, boxes=boxes, needles=descs)
    return Example("order", frames, QUESTIONS["order"], str(a), meta)


TASKS = {"needle": needle, "colour": colour, "count": count, "order": order}


def make_example(task: str, seed: int, **kw) -> Example:
    """``TASKS[task](seed, **kw)`` with a clear error for an unknown task."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
    return TASKS[task](seed, **kw)


# ---------------------------------------------------------------------------- output

def write_mp4(frames: np.ndarray, path, fps: float = 2.0, *, crf: int = 20) -> None:
    """Write RGB uint8 frames [T, H, W, 3] as H.264 / yuv420p (odd sides padded by
    repeating the last row/column, as yuv420p needs even dimensions)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"frames must be [T, H, W, 3] with T >= 1, got {frames.shape}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    frames = frames.astype(np.uint8, copy=False)
    _, h, w, _ = frames.shape
    if h % 2 or w % 2:
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(os.fspath(path), "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=rate, options={"crf": str(crf), "preset": "medium"})
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
