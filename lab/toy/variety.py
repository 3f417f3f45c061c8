"""Randomised renderings of the four synthetic tasks, for training the embedded model.

``synth`` draws one look; a model trained only on it reads synth's digits and nothing else.
This module draws the same tasks (same questions, answers and rules: digits only in needles,
red full frames only as counted flashes, never red distractors, in the colour task the ball
the only circle and the only saturated object) with every visual property randomised per
clip, synth's own look being one option among many:

  frame size  any source size and aspect (square, 4:3, 3:4, 16:9, 9:16, small), resized
              with the adapter's own rule (``smart_resize`` to the model's pixel budget, then
              its bicubic resize): the model sees the grids real videos give (6 x 6 ... 6 x 10
              patches), not only 8 x 8
  backgrounds synth's, flat, linear / radial / four-corner gradients, multi-octave value
              noise, soft blobs, a horizon (sky over ground); a slow camera pan
  distractors ellipses, rectangles, rounded rectangles, triangles, diamonds, pentagons,
              random convex polygons, bars; filled or outlined, pulsing in size, on bounce,
              drift-and-wrap, random-walk, zig-zag and way-point paths
  digits      synth's fonts, every TrueType face found (the bundled DejaVu subsets, the
              bundled glyph atlas ``fonts/glyphs.npz``: 75 faces of 20 families, from
              script to old-style figures, drawn most often; system fonts), PIL's built-in faces,
              bevelled-segment displays; per-digit size / baseline / spacing jitter, then
              generic glyph transforms: bold / thin, outline-only, broken strokes, halftone
              fill, drop-out noise, blur, shear, rotation, perspective, elastic warp, aspect;
              ink of any non-red hue with a contrast floor, gradient ink, plates, halos
  flashes     red of varied depth: flat, gradients, smooth mottling, the scene showing
              faintly through
  ball        flat, gradient-lit, speckled, soft-edged or slightly elliptic discs
  camera      lighting (gradient, vignette, colour cast, brightness, contrast, gamma,
              flicker), blur, Gaussian / salt-and-pepper noise, JPEG, a yuv420 round trip,
              posterisation, resolution loss

Everything is numpy + PIL on the CPU (the training bank's worker processes). Nothing here
imports ``render_eval`` (the evaluation-only renderer): its families (dot-matrix and
single-stroke digits, checkerboard / stripe / ring / plaid textures, stars / crosses /
hexagons, circular / figure-eight / Lissajous paths, the shaded sphere, drop shadows,
sliding digits) are deliberately not drawn here, so that evaluating on it measures
generalisation.
"""

from __future__ import annotations

import colorsys
import glob
import io
import math
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from mminfer.offline import synthetic as synth

from PIL import Image, ImageDraw, ImageFont, ImageFilter
import torch

from mminfer.models.qwen2_5_vl import smart_resize, resize_frames

FONTS_DIR = Path(__file__).resolve().parent / "fonts"
ATLAS = FONTS_DIR / "glyphs.npz"

# model-side frame sizes (h, w) the adapter's smart_resize gives at <= 112 x 112 pixels
SIZES = ((112, 112), (84, 112), (112, 84), (84, 140), (140, 84), (84, 84))
SLOT = 140                  # the bank's frame slot: every size fits, top-left aligned
MAX_PIXELS = 112 * 112
MIN_PIXELS = 56 * 56

# source aspect families (w / h ranges) and their weights
_ASPECTS = (("square", 0.30, 0.95, 1.05), ("4:3", 0.30, 1.25, 1.42), ("3:4", 0.10, 0.70, 0.80),
            ("16:9", 0.15, 1.70, 1.85), ("9:16", 0.05, 0.54, 0.59), ("small", 0.10, 0.95, 1.05))

BACKGROUNDS = ("synth", "flat", "linear", "radial", "corners", "noise", "blobs", "horizon",
               "cells", "bricks", "posterized", "scribbles", "mosaic")
SHAPES = ("ellipse", "rect", "rounded", "triangle", "diamond", "pentagon", "polygon", "bar")
PATHS = ("bounce", "drift", "walk", "zigzag", "waypoints", "still")
FONTS = ("synth", "ttf", "atlas", "pil", "bevel")
GLYPH_FX = ("bold", "thin", "outline", "broken", "halftone", "dropout", "blur", "shear",
            "rotate", "perspective", "warp", "aspect")
INKS = ("solid", "gradient", "plate", "halo", "outlined")
FLASHES = ("flat", "linear", "radial", "mottled", "through")
BALLS = ("flat", "gradient", "speckled", "soft", "elliptic")
CODECS = ("none", "jpeg", "yuv420", "posterize", "downscale")


# ----------------------------------------------------------------------- sizes
def smart_size(h: int, w: int) -> tuple[int, int]:
    """The model-side size of an h x w source frame: the adapter's rule (its own function)."""
    return smart_resize(h, w, 28, MIN_PIXELS, MAX_PIXELS)


def pick_size(rng, size_class: int | None = None) -> tuple[int, int, int]:
    """(source h, source w, index into SIZES); ``size_class`` forces the model-side size."""
    for _ in range(200):
        fam = _ASPECTS[rng.choice(len(_ASPECTS), p=[a[1] for a in _ASPECTS])]
        ar = rng.uniform(fam[2], fam[3])
        if fam[0] == "small":
            h = int(rng.integers(64, 100))
        else:
            h = int(rng.integers(120, 300) if ar >= 1 else rng.integers(180, 340))
        w = max(32, int(round(h * ar)))
        t = smart_size(h, w)
        if t in SIZES and (size_class is None or SIZES.index(t) == size_class):
            return h, w, SIZES.index(t)
    th, tw = SIZES[size_class or 0]
    return th * 2, tw * 2, SIZES.index((th, tw))


def resize_to(frames: np.ndarray, h: int, w: int) -> np.ndarray:
    """uint8 [T, H, W, 3] -> uint8 [T, h, w, 3], the adapter's bicubic antialiased resize."""
    x = resize_frames(torch.from_numpy(np.ascontiguousarray(frames)), h, w)
    return x.permute(0, 2, 3, 1).to(torch.uint8).numpy()


def to_slot(frames: np.ndarray) -> np.ndarray:
    """Pad [T, h, w, 3] into [T, SLOT, SLOT, 3] (top-left; the rest zero)."""
    T, h, w, _ = frames.shape
    out = np.zeros((T, SLOT, SLOT, 3), np.uint8)
    out[:, :h, :w] = frames
    return out


# ----------------------------------------------------------------------- colours
def _hsv(h, s, v) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v), np.float32) * 255.0


def _hue(rng) -> float:
    return synth._non_red_hue(rng)          # noqa: SLF001 (the same never-red rule)


def _colour(rng, neutral: bool) -> np.ndarray:
    if neutral:
        return _hsv(rng.random(), rng.uniform(0, 0.12), rng.uniform(0.05, 0.42))
    return _hsv(_hue(rng), rng.uniform(0, 0.6), rng.uniform(0.08, 0.95))


def _luma(rgb) -> float:
    return float(0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2])


# ----------------------------------------------------------------------- smooth noise
def value_noise(rng, h: int, w: int, cells: int) -> np.ndarray:
    """Smooth noise in [0, 1], [h, w]: a random (cells+1)^2 grid, bilinearly upsampled."""
    g = rng.random((cells + 1, cells + 1)).astype(np.float32)
    ys = np.linspace(0, cells, h, dtype=np.float32)
    xs = np.linspace(0, cells, w, dtype=np.float32)
    y0 = np.minimum(ys.astype(int), cells - 1)
    x0 = np.minimum(xs.astype(int), cells - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    fy, fx = fy * fy * (3 - 2 * fy), fx * fx * (3 - 2 * fx)      # smoothstep: no creases
    a, b = g[y0][:, x0], g[y0][:, x0 + 1]
    c, d = g[y0 + 1][:, x0], g[y0 + 1][:, x0 + 1]
    return a * (1 - fy) * (1 - fx) + b * (1 - fy) * fx + c * fy * (1 - fx) + d * fy * fx


def _fbm(rng, h, w, octaves=3, base=3) -> np.ndarray:
    out = np.zeros((h, w), np.float32)
    amp, tot = 1.0, 0.0
    for o in range(octaves):
        out += amp * value_noise(rng, h, w, base * 2 ** o)
        tot += amp
        amp *= 0.5
    return out / tot


# ----------------------------------------------------------------------- backgrounds
def background(rng, h: int, w: int, neutral: bool = False, kind: str | None = None):
    """float32 [h, w, 3] background, never red; returns (image, kind)."""
    kind = kind or BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    u, v = xx / max(w - 1, 1), yy / max(h - 1, 1)
    c1, c2 = _colour(rng, neutral), _colour(rng, neutral)
    if kind == "synth":
        img, _ = synth._background(rng, h, w, neutral)          # noqa: SLF001
    elif kind == "flat":
        img = np.broadcast_to(c1, (h, w, 3)).astype(np.float32)
    elif kind == "linear":
        a = rng.uniform(0, 2 * math.pi)
        t = (u - 0.5) * math.cos(a) + (v - 0.5) * math.sin(a)
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        img = c1 * (1 - t[..., None]) + c2 * t[..., None]
    elif kind == "radial":
        cx, cy = rng.uniform(-0.2, 1.2), rng.uniform(-0.2, 1.2)
        t = np.clip(np.hypot(u - cx, v - cy) / rng.uniform(0.5, 1.4), 0, 1)
        img = c1 * (1 - t[..., None]) + c2 * t[..., None]
    elif kind == "corners":
        cs = [_colour(rng, neutral) for _ in range(4)]
        uu, vv = u[..., None], v[..., None]
        img = (cs[0] * (1 - uu) * (1 - vv) + cs[1] * uu * (1 - vv) + cs[2] * (1 - uu) * vv
               + cs[3] * uu * vv)
    elif kind == "noise":
        t = _fbm(rng, h, w, octaves=int(rng.integers(2, 5)), base=int(rng.integers(2, 6)))
        img = c1 * (1 - t[..., None]) + c2 * t[..., None]
    elif kind == "blobs":
        img = np.broadcast_to(c1, (h, w, 3)).astype(np.float32).copy()
        for _ in range(int(rng.integers(2, 7))):
            cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.1, 0.45)
            m = np.exp(-((u - cx) ** 2 + (v - cy) ** 2) / (2 * r * r))[..., None]
            img = img * (1 - m) + _colour(rng, neutral) * m
    elif kind == "horizon":
        y0 = rng.uniform(0.25, 0.75) + 0.1 * np.sin(u * rng.uniform(2, 8) + rng.uniform(0, 6))
        soft = rng.uniform(0.005, 0.05)
        t = np.clip((v - y0) / soft + 0.5, 0, 1)[..., None]
        sky = c1 * (1 - 0.3 * v[..., None]) + 0.3 * v[..., None] * c2
        ground = _colour(rng, neutral) * (0.85 + 0.3 * _fbm(rng, h, w, 2, 6)[..., None])
        img = sky * (1 - t) + ground * t
    elif kind in _BUSY:
        img = _BUSY[kind](rng, h, w, neutral, u, v)
    else:
        raise ValueError(kind)
    return np.clip(img, 0, 255).astype(np.float32), kind


# Busy backgrounds: sharp edges at every scale down to a few pixels, so a model learns to
# find a number on clutter and not only on smooth ground (real video is mostly clutter).
def _palette(rng, neutral, n):
    return np.stack([_colour(rng, neutral) for _ in range(n)])


def _cells(rng, h, w, neutral, u, v):
    """Voronoi cells of a few colours, optionally with dark or light borders."""
    n = int(rng.integers(6, 60))
    pts = rng.random((n, 2)).astype(np.float32) * np.array([w, h], np.float32)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    d = (xx[..., None] - pts[:, 0]) ** 2 + (yy[..., None] - pts[:, 1]) ** 2
    order = np.sort(d, -1)
    pal = _palette(rng, neutral, int(rng.integers(2, 5)))
    img = pal[rng.integers(len(pal), size=n)][d.argmin(-1)]
    if rng.random() < 0.6:
        edge = (np.sqrt(order[..., 1]) - np.sqrt(order[..., 0])) < rng.uniform(0.8, 2.5)
        img = np.where(edge[..., None], _colour(rng, neutral), img)
    return img


def _bricks(rng, h, w, neutral, u, v):
    """Running-bond courses with mortar; per-brick shade jitter."""
    bh = rng.uniform(0.05, 0.2) * h
    bw = bh * rng.uniform(1.5, 3.5)
    mortar = rng.uniform(0.6, 2.5)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    row = np.floor(yy / bh)
    xs = xx + (row % 2) * bw * rng.uniform(0.3, 0.7)
    col = np.floor(xs / bw)
    c1, c2 = _colour(rng, neutral), _colour(rng, neutral)
    jit = rng.uniform(0.75, 1.2, size=(int(h / bh) + 2, int(w / bw) + 3))
    shade = jit[row.astype(int), col.astype(int) % jit.shape[1]][..., None]
    joint = ((yy - row * bh) < mortar) | ((xs - col * bw) < mortar)
    return np.where(joint[..., None], c2, c1 * shade)


def _posterized(rng, h, w, neutral, u, v):
    """Smooth noise cut into 2-4 flat levels: blotches with hard edges (camouflage)."""
    t = _fbm(rng, h, w, octaves=int(rng.integers(2, 5)), base=int(rng.integers(3, 10)))
    levels = int(rng.integers(2, 5))
    edges = np.quantile(t, np.linspace(0, 1, levels + 1)[1:-1])
    return _palette(rng, neutral, levels)[np.digitize(t, edges)]


def _scribbles(rng, h, w, neutral, u, v):
    """Random smooth curves of several widths over a plain or graded ground."""
    base = _colour(rng, neutral)
    im = Image.new("RGB", (w, h), tuple(int(c) for c in base))
    d = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(4, 30))):
        n = int(rng.integers(3, 8))
        x = np.cumsum(rng.normal(0, 0.25 * w, n)) + rng.uniform(0, w)
        y = np.cumsum(rng.normal(0, 0.25 * h, n)) + rng.uniform(0, h)
        d.line(list(zip(x.tolist(), y.tolist())), width=int(rng.integers(1, 7)),
               fill=tuple(int(c) for c in _colour(rng, neutral)), joint="curve")
    return np.asarray(im, np.float32)


def _mosaic(rng, h, w, neutral, u, v):
    """Rectangles split recursively (a Mondrian), thin lines between some of them."""
    img = np.empty((h, w, 3), np.float32)
    pal = _palette(rng, neutral, int(rng.integers(2, 6)))
    line = _colour(rng, neutral) if rng.random() < 0.6 else None
    lw = int(rng.integers(1, 3))
    boxes, out = [(0, 0, h, w)], []
    while boxes:
        y0, x0, y1, x1 = boxes.pop()
        if (y1 - y0) * (x1 - x0) > rng.uniform(0.004, 0.08) * h * w and min(y1 - y0, x1 - x0) > 6:
            if (y1 - y0 > x1 - x0) ^ (rng.random() < 0.3):
                m = int(rng.integers(y0 + 3, y1 - 2))
                boxes += [(y0, x0, m, x1), (m, x0, y1, x1)]
            else:
                m = int(rng.integers(x0 + 3, x1 - 2))
                boxes += [(y0, x0, y1, m), (y0, m, y1, x1)]
        else:
            out.append((y0, x0, y1, x1))
    for y0, x0, y1, x1 in out:
        img[y0:y1, x0:x1] = pal[rng.integers(len(pal))]
        if line is not None:
            img[y0:y0 + lw, x0:x1] = line
            img[y0:y1, x0:x0 + lw] = line
    return img


_BUSY = {"cells": _cells, "bricks": _bricks, "posterized": _posterized,
         "scribbles": _scribbles, "mosaic": _mosaic}


# ----------------------------------------------------------------------- motion
def path(rng, n: int, h: int, w: int, r: float, kind: str | None = None):
    """Centre positions (x, y) over n frames of an object of radius r; (x, y, kind)."""
    kind = kind or PATHS[rng.integers(len(PATHS))]
    lo_x, hi_x, lo_y, hi_y = r, max(w - 1 - r, r + 1), r, max(h - 1 - r, r + 1)
    t = np.arange(n, dtype=np.float64)
    if kind == "bounce":
        sp = rng.uniform(0.02, 0.12) * min(h, w)
        a = rng.uniform(0, 2 * math.pi)
        x = synth._bounce(rng.uniform(lo_x, hi_x), sp * math.cos(a), lo_x, hi_x, n)  # noqa
        y = synth._bounce(rng.uniform(lo_y, hi_y), sp * math.sin(a), lo_y, hi_y, n)  # noqa
    elif kind == "drift":           # straight on, leaving one side and coming in the other
        sp = rng.uniform(0.02, 0.1) * min(h, w)
        a = rng.uniform(0, 2 * math.pi)
        x = lo_x + (rng.uniform(0, hi_x - lo_x) + sp * math.cos(a) * t) % (hi_x - lo_x)
        y = lo_y + (rng.uniform(0, hi_y - lo_y) + sp * math.sin(a) * t) % (hi_y - lo_y)
    elif kind == "walk":
        step = rng.uniform(0.01, 0.05) * min(h, w)
        dx = np.convolve(rng.standard_normal(n + 4), np.ones(5) / 5, "valid")[:n] * step
        dy = np.convolve(rng.standard_normal(n + 4), np.ones(5) / 5, "valid")[:n] * step
        x = np.clip(rng.uniform(lo_x, hi_x) + np.cumsum(dx), lo_x, hi_x)
        y = np.clip(rng.uniform(lo_y, hi_y) + np.cumsum(dy), lo_y, hi_y)
    elif kind == "zigzag":          # a triangle wave across, steady along
        per = rng.uniform(4, 16)
        tri = np.abs((t / per + rng.random()) % 2 - 1)
        along = synth._bounce(rng.uniform(lo_x, hi_x), rng.uniform(0.01, 0.06) * w  # noqa
                              * rng.choice([-1, 1]), lo_x, hi_x, n)
        across = lo_y + (hi_y - lo_y) * (0.2 + 0.6 * tri)
        x, y = (along, across) if rng.random() < 0.5 else (
            lo_x + (hi_x - lo_x) * (0.2 + 0.6 * tri), np.clip(along * h / w, lo_y, hi_y))
    elif kind == "waypoints":
        k = int(rng.integers(2, 5))
        px, py = rng.uniform(lo_x, hi_x, k + 1), rng.uniform(lo_y, hi_y, k + 1)
        s = np.linspace(0, k, n) if n > 1 else np.zeros(1)
        i = np.minimum(s.astype(int), k - 1)
        f = s - i
        x, y = px[i] * (1 - f) + px[i + 1] * f, py[i] * (1 - f) + py[i + 1] * f
    elif kind == "still":
        j = rng.uniform(0, 0.01) * min(h, w)
        x = np.clip(rng.uniform(lo_x, hi_x) + rng.standard_normal(n) * j, lo_x, hi_x)
        y = np.clip(rng.uniform(lo_y, hi_y) + rng.standard_normal(n) * j, lo_y, hi_y)
    else:
        raise ValueError(kind)
    return np.asarray(x, np.float64), np.asarray(y, np.float64), kind


# ----------------------------------------------------------------------- distractors
def _outline(kind: str, r: float, aspect: float, a: float, verts: np.ndarray | None):
    if kind == "triangle":
        k = 3
    elif kind == "diamond":
        k = 4
    elif kind == "pentagon":
        k = 5
    elif kind == "polygon":
        ang = a + verts[:, 0]
        return np.stack([r * verts[:, 1] * np.cos(ang), r * verts[:, 1] * np.sin(ang) * aspect], 1)
    elif kind in ("rect", "rounded", "bar"):
        hw, hh = r, r * aspect * (0.25 if kind == "bar" else 1.0)
        pts = np.array([(-hw, -hh), (hw, -hh), (hw, hh), (-hw, hh)])
        c, s = math.cos(a), math.sin(a)
        return pts @ np.array([[c, s], [-s, c]])
    else:
        raise ValueError(kind)
    ang = a + 2 * math.pi * np.arange(k) / k
    return np.stack([r * np.cos(ang), r * aspect * np.sin(ang)], 1)


class Shapes:
    """Moving distractor shapes (never red; grey in the colour task, never circles there)."""

    def __init__(self, rng, n_frames, h, w, *, neutral, bg_value, allow_ellipse=True):
        kinds = SHAPES if allow_ellipse else tuple(k for k in SHAPES if k != "ellipse")
        self.items = []
        for _ in range(int(rng.integers(0, 7))):
            kind = kinds[rng.integers(len(kinds))]
            r = rng.uniform(0.04, 0.15) * min(h, w)
            if neutral:
                val = (bg_value + rng.uniform(0.2, 0.6)) % 1.0
                col = np.full(3, min(max(val, 0.2), 0.85) * 255)
            else:
                col = _hsv(_hue(rng), rng.uniform(0.25, 1.0), rng.uniform(0.3, 1.0))
            x, y, _ = path(rng, n_frames, h, w, r)
            verts = None
            if kind == "polygon":
                k = int(rng.integers(5, 9))
                verts = np.stack([np.sort(rng.uniform(0, 2 * math.pi, k)),
                                  rng.uniform(0.6, 1.0, k)], 1)
            pulse = rng.uniform(0, 0.25) if rng.random() < 0.3 else 0.0
            self.items.append(dict(
                kind=kind, col=tuple(int(c) for c in col), r=r, x=x, y=y,
                aspect=rng.uniform(0.6, 1.4), spin=rng.uniform(-0.3, 0.3) * (rng.random() < 0.6),
                a0=rng.uniform(0, 2 * math.pi), verts=verts, pulse=pulse,
                ph=rng.uniform(0, 2 * math.pi), outline=rng.random() < 0.2,
                width=max(1, int(r * rng.uniform(0.12, 0.3)))))

    def draw(self, d, t: int):
        for s in self.items:
            r = s["r"] * (1 + s["pulse"] * math.sin(0.5 * t + s["ph"]))
            x, y = float(s["x"][t]), float(s["y"][t])
            fill = None if s["outline"] else s["col"]
            line = s["col"] if s["outline"] else None
            wd = s["width"] if s["outline"] else 0
            if s["kind"] == "ellipse":
                ry = r * s["aspect"]
                d.ellipse((x - r, y - ry, x + r, y + ry), fill=fill, outline=line, width=wd)
            elif s["kind"] == "rounded":
                ry = r * s["aspect"]
                d.rounded_rectangle((x - r, y - ry, x + r, y + ry), radius=r * 0.35,
                                    fill=fill, outline=line, width=wd)
            else:
                pts = _outline(s["kind"], r, s["aspect"], s["a0"] + s["spin"] * t, s["verts"])
                pts = [(float(px + x), float(py + y)) for px, py in pts]
                if s["outline"]:
                    d.line(pts + [pts[0]], fill=line, width=wd)
                else:
                    d.polygon(pts, fill=fill)


def scene(rng, n_frames: int, h: int, w: int, *, neutral: bool = False,
          allow_ellipse: bool = True):
    """Frames uint8 [n, h, w, 3] of a scene (background, optional pan, moving shapes) and the
    background as float32 [h, w, 3] (for the digits' contrast) and a description."""
    pan = rng.random() < 0.3
    m = int(0.12 * max(h, w)) if pan else 0
    bg_big, kind = background(rng, h + 2 * m, w + 2 * m, neutral)
    shapes = Shapes(rng, n_frames, h, w, neutral=neutral, bg_value=float(bg_big.mean()) / 255,
                    allow_ellipse=allow_ellipse)
    if pan:
        ox = np.clip(m + np.cumsum(np.full(n_frames, rng.uniform(-1.5, 1.5))), 0, 2 * m)
        oy = np.clip(m + np.cumsum(np.full(n_frames, rng.uniform(-1.0, 1.0))), 0, 2 * m)
    else:
        ox = oy = np.zeros(n_frames)
    big = bg_big.astype(np.uint8)
    frames = np.empty((n_frames, h, w, 3), np.uint8)
    for t in range(n_frames):
        x0, y0 = int(ox[t]), int(oy[t])
        im = Image.fromarray(np.ascontiguousarray(big[y0:y0 + h, x0:x0 + w]))
        shapes.draw(ImageDraw.Draw(im), t)
        frames[t] = np.asarray(im)
    bg = bg_big[m:m + h, m:m + w]
    return frames, bg, {"background": kind, "pan": pan, "distractors": len(shapes.items)}


# ----------------------------------------------------------------------- fonts
@lru_cache(maxsize=1)
def ttf_fonts() -> tuple[str, ...]:
    """Every TrueType face with digits we can find: the bundled DejaVu subsets, then
    system fonts (sorted, so the choice for a seed is stable on one machine)."""
    found = sorted(str(p) for p in FONTS_DIR.glob("*.ttf"))
    sys_fonts = []
    for d in ("/usr/share/fonts", "/usr/local/share/fonts", os.path.expanduser("~/.fonts")):
        sys_fonts += glob.glob(os.path.join(d, "**", "*.tt[fc]"), recursive=True)
    bundled = {Path(f).name for f in found}
    keep = [f for f in sorted(sys_fonts) if Path(f).name not in bundled
            and not any(k in Path(f).name for k in ("Math", "Symbol", "Emoji", "Dings"))]
    return tuple(found + keep)


@lru_cache(maxsize=1)
def atlas():
    """The bundled glyph atlas: {face: [10 digit masks (float32, 64 px tall)]}."""
    if not ATLAS.is_file():
        return {}
    z = np.load(ATLAS)
    out = {}
    for k in z.files:
        face, d = k.rsplit("_", 1)
        out.setdefault(face, [None] * 10)[int(d)] = z[k].astype(np.float32) / 255.0
    return {k: v for k, v in out.items() if all(g is not None for g in v)}


@lru_cache(maxsize=256)
def _font(path: str, size: int):
    return ImageFont.truetype(path, size)


def _crop(a: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(a > 0.05)
    if len(ys) == 0:
        return a
    return a[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1]


def _render_char(font, ch: str, stroke: int = 0) -> np.ndarray:
    l, t, r, b = ImageDraw.Draw(Image.new("L", (1, 1))).textbbox((0, 0), ch, font=font,
                                                                   stroke_width=stroke)
    im = Image.new("L", (r - l + 4, b - t + 4), 0)
    ImageDraw.Draw(im).text((2 - l, 2 - t), ch, font=font, fill=255, stroke_width=stroke,
                            stroke_fill=255)
    return _crop(np.asarray(im, np.float32) / 255.0)


def _bevel_glyph(digit: str, h: int, thick: float, gap: float) -> np.ndarray:
    """A segment-display digit with bevelled (hexagonal) segments and gaps between them, as
    LCD / LED displays draw them (synth's segments are plain touching rectangles)."""
    s = 4
    H, W = h * s, max(int(h * 0.56), 4) * s
    T = max(thick * H, s)
    g = gap * H
    im = Image.new("L", (W, H), 0)
    d = ImageDraw.Draw(im)

    def hseg(y, x0, x1):
        d.polygon([(x0 + g, y), (x0 + g + T / 2, y - T / 2), (x1 - g - T / 2, y - T / 2),
                   (x1 - g, y), (x1 - g - T / 2, y + T / 2), (x0 + g + T / 2, y + T / 2)],
                  fill=255)

    def vseg(x, y0, y1):
        d.polygon([(x, y0 + g), (x + T / 2, y0 + g + T / 2), (x + T / 2, y1 - g - T / 2),
                   (x, y1 - g), (x - T / 2, y1 - g - T / 2), (x - T / 2, y0 + g + T / 2)],
                  fill=255)

    L, R, top, mid, bot = T / 2, W - T / 2, T / 2, H / 2, H - T / 2
    segs = {"a": lambda: hseg(top, L, R), "g": lambda: hseg(mid, L, R),
            "d": lambda: hseg(bot, L, R), "f": lambda: vseg(L, top, mid),
            "b": lambda: vseg(R, top, mid), "e": lambda: vseg(L, mid, bot),
            "c": lambda: vseg(R, mid, bot)}
    for name in synth._SEGMENTS[digit]:        # noqa: SLF001 (which segments: a fact)
        segs[name]()
    a = np.asarray(im, np.float32) / 255.0
    return a.reshape(h, s, W // s, s).mean(axis=(1, 3))


def _resize_mask(a: np.ndarray, h: int, w: int) -> np.ndarray:
    im = Image.fromarray((np.clip(a, 0, 1) * 255).astype(np.uint8))
    return np.asarray(im.resize((max(w, 1), max(h, 1)), Image.BILINEAR), np.float32) / 255.0


def glyphs(rng, text: str, height: int, font: str | None = None):
    """Anti-aliased mask (float32 [h, w]) of ``text`` whose ink is about ``height`` px tall:
    one digit at a time, with per-digit size, baseline and spacing jitter. (mask, font)."""
    font = font or FONTS[rng.choice(len(FONTS), p=(0.2, 0.2, 0.35, 0.1, 0.15))]
    if font == "synth":
        return synth._font_mask(rng, text, height)[0], font    # noqa: SLF001
    at = atlas()
    if font == "atlas" and not at:
        font = "ttf"
    chars = []
    if font == "ttf":
        faces = ttf_fonts()
        path_ = faces[rng.integers(len(faces))] if faces else None
        size = int(height * 1.45)
        stroke = int(rng.uniform(0, 0.06) * size) if rng.random() < 0.3 else 0
        for c in text:
            if path_ is None:
                from PIL import ImageFont
                chars.append(_render_char(ImageFont.load_default(size=size), c, stroke))
            else:
                chars.append(_render_char(_font(path_, size), c, stroke))
    elif font == "atlas":
        names = sorted(at)
        face = at[names[rng.integers(len(names))]]
        chars = [face[int(c)] for c in text]
    elif font == "pil":
        from PIL import ImageFont
        if rng.random() < 0.5:
            f = ImageFont.load_default(size=int(height * 1.45))
            chars = [_render_char(f, c) for c in text]
        else:   # the 11 px bitmap face, scaled up bilinearly (synth scales it nearest)
            f = ImageFont.load_default_imagefont()
            chars = [_render_char(f, c) for c in text]
    elif font == "bevel":
        thick, gap = rng.uniform(0.08, 0.16), rng.uniform(0.0, 0.025)
        chars = [_bevel_glyph(c, height, thick, gap) for c in text]
    else:
        raise ValueError(font)
    widen = rng.uniform(0.75, 1.3)
    parts = []
    for ch in chars:
        gh = int(round(height * rng.uniform(0.9, 1.08)))
        gw = max(2, int(round(ch.shape[1] * gh / max(ch.shape[0], 1) * widen)))
        parts.append(_resize_mask(ch, gh, gw))
    H = max(p.shape[0] for p in parts) + 4
    space = [int(rng.uniform(0.05, 0.3) * height) for _ in parts[1:]]
    W = sum(p.shape[1] for p in parts) + sum(space) + 4
    out = np.zeros((H, W), np.float32)
    x = 2
    for i, p in enumerate(parts):
        y = int(rng.integers(0, H - p.shape[0] + 1)) if rng.random() < 0.3 else \
            H - 2 - p.shape[0]
        out[y:y + p.shape[0], x:x + p.shape[1]] = np.maximum(
            out[y:y + p.shape[0], x:x + p.shape[1]], p)
        x += p.shape[1] + (space[i] if i < len(space) else 0)
    return _crop(out), font


# ----------------------------------------------------------------------- glyph transforms
def _pil(a):
    return Image.fromarray((np.clip(a, 0, 1) * 255).astype(np.uint8))


def _np(im):
    return np.asarray(im, np.float32) / 255.0


def _maxf(a, k):
    return _np(_pil(a).filter(ImageFilter.MaxFilter(k)))


def _minf(a, k):
    return _np(_pil(a).filter(ImageFilter.MinFilter(k)))


def _warp(rng, a: np.ndarray, amp: float) -> np.ndarray:
    """Elastic warp: a smooth random displacement field, bilinear resampling."""
    h, w = a.shape
    dx = (value_noise(rng, h, w, 3) - 0.5) * 2 * amp
    dy = (value_noise(rng, h, w, 3) - 0.5) * 2 * amp
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    sx, sy = np.clip(xx + dx, 0, w - 1.001), np.clip(yy + dy, 0, h - 1.001)
    x0, y0 = sx.astype(int), sy.astype(int)
    fx, fy = sx - x0, sy - y0
    return (a[y0, x0] * (1 - fx) * (1 - fy) + a[y0, x0 + 1] * fx * (1 - fy)
            + a[y0 + 1, x0] * (1 - fx) * fy + a[y0 + 1, x0 + 1] * fx * fy)


def _perspective(rng, a: np.ndarray, k: float) -> np.ndarray:
    h, w = a.shape
    p = np.pad(a, ((h // 4, h // 4), (w // 4, w // 4)))
    H, W = p.shape
    src = [(0, 0), (W, 0), (W, H), (0, H)]
    dst = [(x + rng.uniform(-k, k) * W, y + rng.uniform(-k, k) * H) for x, y in src]
    A, B = [], []
    for (x, y), (u, v) in zip(dst, src):     # PIL maps output (x, y) -> input (u, v)
        A += [[x, y, 1, 0, 0, 0, -u * x, -u * y], [0, 0, 0, x, y, 1, -v * x, -v * y]]
        B += [u, v]
    coef = np.linalg.lstsq(np.array(A, float), np.array(B, float), rcond=None)[0]
    return _crop(_np(_pil(p).transform((W, H), Image.PERSPECTIVE, tuple(coef),
                                       resample=Image.BILINEAR)))


# Share of numbers redrawn as LED-matrix cells (``led``). Off by default, and not one of
# GLYPH_FX: a glyph sampled on a coarse grid is the look of render_eval's dot-matrix digits
# (other glyph shapes, square / diamond cells, not round dots), so training on it stops that
# renderer measuring dot-matrix digits as unseen. ``train_embedded.py --led`` turns it on for
# an experiment that asks whether the needle gap is the look or the model.
LED_SHARE = 0.0


def use_led(share: float) -> None:
    global LED_SHARE
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"LED share {share} is not in [0, 1]")
    LED_SHARE = float(share)


def led(rng, mask: np.ndarray) -> np.ndarray:
    """The glyph sampled on a coarse grid (6-8 rows, cells of >= 4 px), each lit cell drawn
    as a square or a diamond with a gap around it. A glyph too small for 6 rows of 4 px
    comes back as it was."""
    h, w = mask.shape
    rows = min(int(rng.integers(6, 9)), h // 4)
    if rows < 6:
        return mask
    cell = h / rows
    cols = max(1, int(round(w / cell)))
    cover = _np(_pil(mask).resize((cols, rows), Image.BOX))
    lit = cover > rng.uniform(0.35, 0.55) * cover.max()      # thin faces keep their cells
    if not lit.any():
        return mask
    shape = rng.choice(["square", "diamond"])
    r = cell * rng.uniform(0.22, 0.36)
    W = int(round(cols * cell))
    img = Image.new("L", (W, h), 0)
    d = ImageDraw.Draw(img)
    for i, j in zip(*np.nonzero(lit)):
        cx, cy = (j + 0.5) * cell, (i + 0.5) * cell
        if shape == "square":
            d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=255)
        else:
            q = min(r * 1.3, cell * 0.4)
            d.polygon([(cx, cy - q), (cx + q, cy), (cx, cy + q), (cx - q, cy)], fill=255)
    return _np(img)


def glyph_fx(rng, mask: np.ndarray) -> tuple[np.ndarray, list]:
    """A random subset of generic robustness transforms; the result stays legible (each
    keeps most of the ink's shape). (mask, names applied)."""
    applied = []
    if LED_SHARE > 0 and rng.random() < LED_SHARE:     # no draw when off: looks unchanged
        mask = led(rng, mask)
        applied.append("led")
    h = mask.shape[0]
    plain, ink = mask, float((mask > 0.05).sum())
    k = int(rng.choice([0, 1, 1, 2, 2, 3]))
    for name in rng.permutation(GLYPH_FX)[:k]:
        if (mask > 0.05).sum() < 4:
            break        # earlier transforms (thin + broken + dropout) ate the glyph: stop here
        if name == "bold":
            mask = _maxf(mask, 3 if h < 40 else 5)
        elif name == "thin" and h >= 30:
            mask = _minf(mask, 3)
        elif name == "outline" and h >= 24:
            thick = _maxf(mask, 3 if h < 48 else 5)
            mask = np.clip(thick - _minf(thick, 5 if h < 48 else 7), 0, 1)
        elif name == "broken":
            n = value_noise(rng, *mask.shape, cells=int(rng.integers(3, 7)))
            mask = mask * (n > rng.uniform(0.15, 0.3))
        elif name == "halftone":
            pitch = rng.uniform(2.0, 3.5)
            a = rng.uniform(0, math.pi)
            yy, xx = np.mgrid[0:mask.shape[0], 0:mask.shape[1]].astype(np.float32)
            u = (xx * math.cos(a) + yy * math.sin(a)) / pitch
            v = (-xx * math.sin(a) + yy * math.cos(a)) / pitch
            screen = (np.cos(2 * math.pi * u) + np.cos(2 * math.pi * v) + 2) / 4
            mask = mask * (screen < rng.uniform(0.55, 0.8))
        elif name == "dropout":
            mask = mask * (rng.random(mask.shape) > rng.uniform(0.05, 0.3))
        elif name == "blur":
            mask = _np(_pil(mask).filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 1.5))))
        elif name == "shear":
            mask = synth._shear(mask, float(rng.uniform(-0.35, 0.35)))   # noqa: SLF001
        elif name == "rotate":
            mask = _crop(_np(_pil(np.pad(mask, h // 3)).rotate(
                float(rng.uniform(-15, 15)), resample=Image.BILINEAR)))
        elif name == "perspective":
            mask = _perspective(rng, mask, rng.uniform(0.04, 0.12))
        elif name == "warp":
            mask = _warp(rng, np.pad(mask, 2), rng.uniform(0.03, 0.07) * h)
        elif name == "aspect":
            s = rng.uniform(0.65, 1.4)
            mask = _resize_mask(mask, mask.shape[0], int(mask.shape[1] * s))
        else:
            continue
        applied.append(str(name))
    if (mask > 0.05).sum() < 0.2 * ink:
        # an unreadable number would teach a wrong answer: keep the plain glyph instead
        return plain.astype(np.float32), []
    return mask.astype(np.float32), applied


# ----------------------------------------------------------------------- numbers
def number_stamp(rng, text: str, h: int, w: int, bg: np.ndarray):
    """How a number is drawn on a scene of this size: ``(paint(frame, k) -> frame,
    box (x0, y0, x1, y1), description)``; ``k`` is the frame's place in the run (a run may
    drift by a few pixels)."""
    th = int(round(rng.uniform(0.22, 0.6) * h))
    th = max(th, 10)
    mask, font = glyphs(rng, text, th)
    mask, fx = glyph_fx(rng, mask)
    if mask.shape[1] > 0.92 * w or mask.shape[0] > 0.8 * h:
        s = min(0.92 * w / mask.shape[1], 0.8 * h / mask.shape[0])
        mask = _resize_mask(mask, max(int(mask.shape[0] * s), 6), max(int(mask.shape[1] * s), 6))
    mh, mw = mask.shape
    pad = max(2, int(0.06 * mh))
    drift = rng.integers(-3, 4, 2) * (rng.random() < 0.3)
    x0 = int(rng.integers(pad + 3, max(pad + 4, w - mw - pad - 2)))
    y0 = int(rng.integers(pad + 3, max(pad + 4, h - mh - pad - 2)))
    x0, y0 = min(x0, max(w - mw, 0)), min(y0, max(h - mh, 0))
    region = bg[y0:y0 + mh, x0:x0 + mw].reshape(-1, 3).mean(0)
    ink_kind = INKS[rng.integers(len(INKS))]
    bl = _luma(region)
    plate = None
    if ink_kind == "plate":
        bl = rng.uniform(10, 245)
        plate = _hsv(_hue(rng), rng.uniform(0, 0.5), bl / 255) if rng.random() < 0.5 else \
            np.full(3, bl, np.float32)
        bl = _luma(plate)
    # ink: any non-red hue, at least ~90 levels of luma away from what is under it
    for _ in range(20):
        ink = _hsv(_hue(rng), rng.uniform(0, 1), rng.uniform(0, 1))
        if abs(_luma(ink) - bl) > 90:
            break
    else:
        ink = np.zeros(3, np.float32) if bl > 128 else np.full(3, 255, np.float32)
    ink2 = None
    if ink_kind == "gradient":
        for _ in range(20):
            ink2 = _hsv(_hue(rng), rng.uniform(0, 1), rng.uniform(0, 1))
            if abs(_luma(ink2) - bl) > 90:
                break
        else:
            ink2 = ink
    halo = None
    if ink_kind in ("halo", "outlined"):
        k = 3 if mh < 40 else 5
        halo = _maxf(mask, k)
        if ink_kind == "halo":
            halo = _np(_pil(halo).filter(ImageFilter.GaussianBlur(k / 2)))
        halo_col = np.zeros(3, np.float32) if _luma(ink) > 128 else np.full(3, 255, np.float32)
    alpha = rng.uniform(0.8, 1.0)
    grad = np.linspace(0, 1, mh, dtype=np.float32)[:, None, None]

    def paint(frame: np.ndarray, k: int = 0) -> np.ndarray:
        out = frame.astype(np.float32)
        x, y = x0 + int(drift[0]) * k, y0 + int(drift[1]) * k
        x, y = min(max(x, 0), w - mw), min(max(y, 0), h - mh)
        if plate is not None:
            out[max(0, y - pad): y + mh + pad, max(0, x - pad): x + mw + pad] = plate
        sub = out[y:y + mh, x:x + mw]
        if halo is not None:
            sub[:] = sub * (1 - halo[..., None]) + halo_col * halo[..., None]
        col = ink if ink2 is None else ink * (1 - grad) + ink2 * grad
        m = (mask * alpha)[..., None]
        sub[:] = sub * (1 - m) + col * m
        return np.clip(out + 0.5, 0, 255).astype(np.uint8)

    desc = {"font": font, "fx": fx, "ink": ink_kind, "text_height": mh}
    return paint, (x0, y0, x0 + mw, y0 + mh), desc


# ----------------------------------------------------------------------- camera
class Camera:
    """One clip's lighting and camera: the same gains for every frame of the clip (and for
    the needle frames painted on it), fresh sensor noise for each call."""

    def __init__(self, rng, h: int, w: int, *, mild_colour: bool = False):
        self.rng = rng
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        u, v = xx / max(w - 1, 1) - 0.5, yy / max(h - 1, 1) - 0.5
        gain = np.ones((h, w), np.float32)
        self.kinds = []
        if rng.random() < 0.5:
            a = rng.uniform(0, 2 * math.pi)
            gain *= 1 + rng.uniform(0.1, 0.4) * (u * math.cos(a) + v * math.sin(a))
            self.kinds.append("gradient")
        if rng.random() < 0.35:
            gain *= 1 - rng.uniform(0.15, 0.5) * (u * u + v * v) / 0.5
            self.kinds.append("vignette")
        if rng.random() < 0.2:      # an uneven lamp: a soft bright spot
            cx, cy, r = rng.uniform(-0.4, 0.4), rng.uniform(-0.4, 0.4), rng.uniform(0.2, 0.5)
            gain *= 1 + rng.uniform(0.1, 0.35) * np.exp(-((u - cx) ** 2 + (v - cy) ** 2)
                                                      / (2 * r * r))
            self.kinds.append("spot")
        self.gain = gain[..., None]
        cast = 0.04 if mild_colour else 0.1
        self.cast = (1 + rng.uniform(-cast, cast, 3)).astype(np.float32) \
            if rng.random() < 0.4 else np.ones(3, np.float32)
        self.bright = rng.uniform(0.75, 1.2) if rng.random() < 0.6 else 1.0
        # colour-critical frames (the ball, the flashes): milder tone curves, so a colour
        # stays its own name
        tone = 0.15 if mild_colour else 0.3
        self.contrast = rng.uniform(1 - tone, 1 + tone) if rng.random() < 0.5 else 1.0
        self.gamma = rng.uniform(1 - tone, 1 + tone) if rng.random() < 0.3 else 1.0
        self.flicker = rng.uniform(0, 0.05) if rng.random() < 0.2 else 0.0
        self.blur = rng.uniform(0.4, 1.2) if rng.random() < 0.2 else 0.0
        self.sigma = rng.uniform(0, 8) if rng.random() < 0.6 else 0.0
        self.salt = rng.uniform(0.001, 0.01) if rng.random() < 0.08 else 0.0
        self.codec = CODECS[rng.choice(len(CODECS), p=(0.25, 0.35, 0.2, 0.08, 0.12))]
        self.quality = int(rng.integers(20, 95))
        self.bits = int(rng.integers(4, 7))
        self.down = rng.uniform(0.4, 0.8)
        self.mul = None

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        rng = self.rng
        T, h, w, _ = frames.shape
        if self.mul is None:        # lighting, cast, brightness and contrast as one affine map
            c = self.contrast
            self.mul = (self.gain * self.cast * self.bright * c).astype(np.float32)
            self.add = np.float32(128 * (1 - c) + 0.5)
            self.lut = None if self.gamma == 1.0 else np.clip(
                255 * (np.arange(256) / 255) ** self.gamma + 0.5, 0, 255).astype(np.uint8)
        f = frames.astype(np.float32)
        f *= self.mul
        f += self.add
        if self.flicker:
            f *= (1 + rng.uniform(-self.flicker, self.flicker, (T, 1, 1, 1))).astype(np.float32)
        if self.sigma:
            f += noise(rng, f.shape) * np.float32(self.sigma)
        np.clip(f, 0, 255, out=f)
        out = f.astype(np.uint8)
        if self.lut is not None:
            out = self.lut[out]
        if self.salt:
            m = rng.random((T, h, w)) < self.salt
            out[m] = (rng.random((int(m.sum()), 1)) < 0.5) * 255
        if self.blur or self.codec in ("jpeg", "downscale"):
            for i in range(T):
                im = Image.fromarray(out[i])
                if self.blur:
                    im = im.filter(ImageFilter.GaussianBlur(self.blur))
                if self.codec == "downscale":
                    im = im.resize((max(8, int(w * self.down)), max(8, int(h * self.down))),
                                   Image.BILINEAR).resize((w, h), Image.BILINEAR)
                elif self.codec == "jpeg":
                    buf = io.BytesIO()
                    im.save(buf, format="JPEG", quality=self.quality)
                    im = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
                out[i] = np.asarray(im)
        if self.codec == "yuv420" and h % 2 == 0 and w % 2 == 0:
            out = yuv420(out)
        elif self.codec == "posterize":
            step = 2 ** (8 - self.bits)
            out = (out // step * step + step // 2).astype(np.uint8)
        return out


_NOISE = None


def noise(rng, shape) -> np.ndarray:
    """Standard normal noise of ``shape`` (float32), cut at a random offset from one fixed
    table: a fraction of the cost of drawing it, still fresh enough per frame."""
    global _NOISE
    if _NOISE is None:
        _NOISE = np.random.default_rng(0x401E).standard_normal(1 << 22, dtype=np.float32)
    n = int(np.prod(shape))
    if n > len(_NOISE):
        return rng.standard_normal(shape, dtype=np.float32)
    o = int(rng.integers(0, len(_NOISE) - n + 1))
    return _NOISE[o:o + n].reshape(shape)


def yuv420(frames: np.ndarray) -> np.ndarray:
    """BT.601 limited-range yuv420p round trip (2 x 2 chroma), what H.264 streams store."""
    f = frames.astype(np.float32)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    y = np.round(16 + (65.481 * r + 128.553 * g + 24.966 * b) / 255)
    cb = 128 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255
    cr = 128 + (112.0 * r - 93.786 * g - 18.214 * b) / 255
    T, H, W = y.shape
    cb = np.round(cb.reshape(T, H // 2, 2, W // 2, 2).mean((2, 4))).repeat(2, 1).repeat(2, 2)
    cr = np.round(cr.reshape(T, H // 2, 2, W // 2, 2).mean((2, 4))).repeat(2, 1).repeat(2, 2)
    yy, cbb, crr = (y - 16) * 255 / 219, (cb - 128) * 255 / 224, (cr - 128) * 255 / 224
    out = np.stack([yy + 1.402 * crr, yy - 0.344136 * cbb - 0.714136 * crr, yy + 1.772 * cbb], -1)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


# ----------------------------------------------------------------------- flashes, ball
def red_flash(rng, h: int, w: int, under: np.ndarray | None = None):
    """A full-frame red flash (float32 [h, w, 3]): mostly red everywhere, of varied depth."""
    kind = FLASHES[rng.integers(len(FLASHES))]
    if kind == "through" and under is None:
        kind = "flat"

    def red():
        return np.array([rng.uniform(160, 255), rng.uniform(0, 40), rng.uniform(0, 45)],
                        np.float32)
    a, b = red(), red()
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    u, v = xx / max(w - 1, 1), yy / max(h - 1, 1)
    if kind == "flat":
        img = np.broadcast_to(a, (h, w, 3))
    elif kind == "linear":
        ang = rng.uniform(0, 2 * math.pi)
        t = np.clip((u - 0.5) * math.cos(ang) + (v - 0.5) * math.sin(ang) + 0.5, 0, 1)
        img = a * (1 - t[..., None]) + b * t[..., None]
    elif kind == "radial":
        t = np.clip(np.hypot(u - rng.uniform(0.2, 0.8), v - rng.uniform(0.2, 0.8)) / 0.8, 0, 1)
        img = a * (1 - t[..., None]) + b * t[..., None]
    elif kind == "mottled":
        t = _fbm(rng, h, w, 2, int(rng.integers(2, 5)))
        img = a * (1 - t[..., None]) + b * t[..., None]
    else:                       # the scene faintly through a red wash
        al = rng.uniform(0.88, 0.95)
        img = a * al + under.astype(np.float32) * (1 - al)
    return np.clip(img, 0, 255).astype(np.float32), kind


def ball_clip(rng, frames: np.ndarray, rgb, *, kind: str | None = None):
    """Draw the colour task's ball over ``frames`` (uint8 [T, h, w, 3], in place); the ball
    is drawn last, on top of everything."""
    T, h, w, _ = frames.shape
    kind = kind or BALLS[rng.integers(len(BALLS))]
    r = rng.uniform(0.08, 0.17) * min(h, w)
    x, y, pth = path(rng, T, h, w, r)
    ry = r * (rng.uniform(0.8, 0.95) if kind == "elliptic" else 1.0)
    col = np.clip(np.array(rgb, np.float32) * rng.uniform(0.75, 1.05), 0, 255)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    speck = rng.uniform(0.9, 1.1, (h, w, 1)).astype(np.float32) if kind == "speckled" else None
    ang = rng.uniform(0, 2 * math.pi)
    soft = rng.uniform(1.0, 2.5) if kind == "soft" else 0.6
    for t in range(T):
        d = np.sqrt(((xx - x[t]) / r) ** 2 + ((yy - y[t]) / ry) ** 2)
        m = np.clip((1 - d) * r / soft + 0.5, 0, 1)[..., None]
        c = np.broadcast_to(col, (h, w, 3)).astype(np.float32)
        if kind == "gradient":  # a linear light across the disc (no highlight, no rim)
            g = ((xx - x[t]) * math.cos(ang) + (yy - y[t]) * math.sin(ang)) / r
            c = c * (1 + 0.15 * np.clip(g, -1, 1))[..., None]
        elif speck is not None:
            c = c * speck
        frames[t] = np.clip(frames[t] * (1 - m) + c * m, 0, 255).astype(np.uint8)
    return {"ball": kind, "path": pth, "radius": float(r)}


def build_atlas(font_files, out=ATLAS, height: int = 64) -> Path:
    """Write the glyph atlas: the digits 0-9 of each font file rasterised ``height`` px tall
    (uint8), so training draws these faces on machines that do not have them installed.
    ``python -c "from lab.toy import variety as V; V.build_atlas(FILES)"``"""
    arrays = {}
    for f in font_files:
        face = Path(f).stem.replace("_", "-")
        font = _font(str(f), int(height * 1.45))
        for d in "0123456789":
            g = _render_char(font, d)
            g = _resize_mask(g, height, max(2, int(round(g.shape[1] * height / g.shape[0]))))
            arrays[f"{face}_{d}"] = (g * 255).round().astype(np.uint8)
    np.savez_compressed(out, **arrays)
    return Path(out)
