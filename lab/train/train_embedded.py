"""Train the embedded default model (mminfer.models.embedded) on the synthetic video tasks.

    python3 lab/train/train_embedded.py --minutes 5 --out /tmp/model --archive $OUT/model.tar.gz

The shipped mminfer/models/mminfer-embedded came from two such runs (8.6 minutes from scratch, then 4.2 at
the long lengths with ``--init``), calibration and the quality benchmark:
``lab/train/build_embedded.sh`` holds the exact commands.

On the H200 (one GPU, 16 cores) that is the whole job: it renders a frame bank on CPU worker
processes, trains on the GPU for the rest of the time box, evaluates, and writes the final
checkpoint in the Qwen2.5-VL hub layout into --out (copy it to mminfer/models/mminfer-embedded; --archive packs
it into one file). ``--minutes`` bounds the whole run, bank and final save included;
checkpoints are written every ``--ckpt-every`` seconds and always at the end, also when
training stops early (time box, Ctrl-C, repeated errors). ``--resume`` continues from
``--state`` (default ``<out>.state.pt``: weights, optimizer, curriculum) on the same machine;
``--init DIR`` starts a new run from a saved checkpoint's weights (e.g. mminfer/models/mminfer-embedded).

CPU smoke test (a minute on 2 cores; answers are nonsense):

    python3 lab/train/train_embedded.py --minutes 0.5 --max-tokens 128 --workers 0 \
        --out /tmp/embedded-smoke

How the data is made. Training videos are composed from a bank of pre-rendered 112 x 112
frames, the adapter's own pixels (drawn at 224 by ``mminfer.offline.synthetic``'s renderer, resized with
the adapter's resize), so the training distribution is the one the real videos have:

* scene clips: ``synth``'s scene (background, moving non-red distractors), ``--clip-frames``
  coherent frames each, with ``--needles-per-scene`` needle runs (1-2 frames, a number drawn
  by ``synth``'s digit stamp on that scene's frames);
* colour clips: ``synth.colour`` clips (training seeds >= 1,000,000);
* red flash frames, as ``synth.count`` draws them;
* half of the clips pass through a yuv420 round trip plus noise (roughly what H.264 does
  to the sample mp4s).

A video of T frames is then a sequence of clip segments played forwards or backwards from a
small pool of scenes, with the needle run(s) put at their depth inside their own scene's
clip, flashes at ``synth.count``'s positions, or colour clips of one colour, gathered from the
bank on the GPU. Worker processes keep re-rendering the bank while training runs, so the
model keeps seeing fresh renderings. Loss: cross-entropy on the answer token and the
``<|im_end|>`` after it (nothing else of the prompt), plus auxiliary heads on the vision
features that are not part of the saved model: per pair of frames (plain / number / colour /
red, and the two digits of a number) and per merged token of a pair showing a number (which
digit, tens or units, covers that 28 x 28 cell: dense supervision that teaches a small ViT
to read several times faster than the answer alone). Curriculum: the longest video grows
from 4 pairs (64 tokens) to ``--max-tokens`` by doubling when the running accuracy at the
current longest lengths passes 85 % on every task, and at the latest on a schedule that
starts at 40 % of the time and reaches the end at 85 % (``--grow``); shorter videos stay in the mix
(log-uniform lengths). Time-based cosine learning rate, AdamW, bf16 autocast, plain eager
PyTorch with dense SDPA (no torch.compile).

Evaluation during training: real ``synth`` videos of 20 frames (the samples' length; seeds
800,000+), and bank-composed videos at 1K / 8K / 32K tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mminfer.offline import synthetic as synth  # noqa: E402
from lab.toy import embedded as E  # noqa: E402
from lab.toy import grow  # noqa: E402
from lab.toy import variety as V  # noqa: E402

TASKS = ("needle", "colour", "count", "order")
TASK_WEIGHT = {"needle": 1.0, "colour": 0.6, "count": 0.8, "order": 1.0}
COLOURS = tuple(synth.COLOURS)
# auxiliary per-pair classes: 0 plain, 1..90 the number 10..99, 91..98 a colour, 99 red flash
AUX_CLASSES = 100
AUX_RED = 99
# auxiliary per-token classes (needle pairs): 0 none, 1..10 tens digit 0-9, 11..20 units digit
TOK_CLASSES = 21
TOK_SIDE = E.GRID // 2                    # 4 x 4 merged tokens per pair (112 x 112 frames)
TOK_CELL = 28                             # px of the model's frame per merged token
PAIR_TOKENS = E.TOKENS_PER_PAIR           # the curriculum counts 112 x 112 pairs
SIZES = V.SIZES                           # model-side frame sizes a bank clip can have
SLOT = V.SLOT                             # the bank's frame slot (every size fits)
MAX_TOK = max((h // TOK_CELL) * (w // TOK_CELL) for h, w in SIZES)


def size_tokens(cls: int) -> int:
    h, w = SIZES[cls]
    return (h // TOK_CELL) * (w // TOK_CELL)
EVAL_LENGTHS = (64, 512, 2048)      # pairs: 1K, 8K, 32K visual tokens

_T0 = time.time()


def log(msg: str):
    print(f"[{time.time() - _T0:7.1f}s] {msg}", flush=True)


# =============================================================================== rendering
# These run in worker processes (spawned: each imports this module afresh).

def _worker_init(led: float = 0.0):
    torch.set_num_threads(1)
    E.use_bundled_fonts()
    V.ttf_fonts()
    V.use_led(led)


def _codec_like(frames, rng, sigma):
    """yuv420p round trip (``variety.yuv420``), Gaussian noise and a small per-channel offset,
    applied to the 112 px frames: roughly what H.264 at crf 20 (on the 224 px original) leaves
    after the resize (it is cheaper here than at 224, and errs on the blurrier side for
    chroma)."""
    out = V.yuv420(frames).astype(np.float32)
    if sigma > 0:
        out += rng.standard_normal(out.shape, dtype=np.float32) * np.float32(sigma)
    # decoders (decord / swscale) come out ~1-2 levels darker per channel than the source
    out += rng.uniform(-2.5, 0.5, 3).astype(np.float32)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def _pad(frames) -> np.ndarray:
    return V.to_slot(frames)


def _synth_scene_clip(rng, F, K, h, w):
    """synth's look at h x w: scene frames and K needle runs painted by synth's stamp."""
    bg, shapes, _ = synth._scene(rng, F, h, w)          # noqa: SLF001 (same renderer)
    fr = synth._draw_scene(bg, shapes, F)               # noqa: SLF001
    runs = []
    for _ in range(K):
        v = int(rng.integers(10, 100))
        paint, box, _ = synth._text_stamp(rng, str(v), h, w, bg)   # noqa: SLF001
        runs.append((v, (lambda p: (lambda f, k: p(f)))(paint), box))
    return fr, runs


def _variety_scene_clip(rng, F, K, h, w):
    fr, bg, _ = V.scene(rng, F, h, w)
    runs = []
    for _ in range(K):
        v = int(rng.integers(10, 100))
        if rng.random() < 0.15:     # synth's stamp on a new scene
            paint, box, _ = synth._text_stamp(rng, str(v), h, w, bg)   # noqa: SLF001
            runs.append((v, (lambda p: (lambda f, k: p(f)))(paint), box))
        else:
            paint, box, _ = V.number_stamp(rng, str(v), h, w, bg)
            runs.append((v, paint, box))
    return fr, runs


def job_scenes(job: int, run_seed: int, n: int, F: int, K: int, aug_p: float,
               variety: float = 0.0) -> dict:
    """``n`` scene clips of F frames with K needle runs each. A share ``1 - variety`` is
    synth's look at 224 x 224 (the shipped samples' distribution, codec-like with
    probability ``aug_p``); the rest is ``lab.toy.variety``'s randomised looks at
    random source sizes and aspects, resized to the size the adapter would give them."""
    rng = np.random.default_rng([0x5EED, run_seed, 1, job])
    clips = np.zeros((n, F, SLOT, SLOT, 3), np.uint8)
    needles = np.zeros((n, K, 2, SLOT, SLOT, 3), np.uint8)
    num = np.zeros((n, K), np.int16)
    start = np.zeros((n, K), np.int16)
    length = np.zeros((n, K), np.int16)
    boxes = np.zeros((n, K, 4), np.float32)     # (x0, y0, x1, y1) of the number, model px
    cls = np.zeros(n, np.int16)
    for i in range(n):
        if rng.random() >= variety:
            h = w = E.RENDER_SIDE
            c = 0
            fr, runs = _synth_scene_clip(rng, F, K, h, w)
            cam = None
        else:
            h, w, c = V.pick_size(rng)
            fr, runs = (_synth_scene_clip if rng.random() < 0.15 else _variety_scene_clip)(
                rng, F, K, h, w)
            cam = V.Camera(rng, h, w)
        th, tw = SIZES[c]
        nd = np.empty((K, 2, h, w, 3), np.uint8)
        for r, (v, paint, box) in enumerate(runs):
            ln = int(rng.integers(1, 3))
            j = int(rng.integers(0, F - ln + 1))
            nd[r, 0] = paint(fr[j], 0)
            nd[r, 1] = paint(fr[j + 1], 1) if ln == 2 else nd[r, 0]
            num[i, r], start[i, r], length[i, r] = v, j, ln
            boxes[i, r] = np.array(box, np.float32) * np.array([tw / w, th / h] * 2, np.float32)
        nd = nd.reshape(-1, h, w, 3)
        if cam is not None:
            fr, nd = cam(fr), cam(nd)
        fr, nd = V.resize_to(fr, th, tw), V.resize_to(nd, th, tw)
        if cam is None and rng.random() < aug_p:
            sigma = float(rng.uniform(0, 1.5))
            fr, nd = _codec_like(fr, rng, sigma), _codec_like(nd, rng, sigma)
        clips[i, :, :th, :tw] = fr
        needles[i, :, :, :th, :tw] = nd.reshape(K, 2, th, tw, 3)
        cls[i] = c
    return {"kind": "scenes", "frames": clips, "needles": needles, "num": num,
            "start": start, "len": length, "box": boxes, "cls": cls}


def job_colour(job: int, run_seed: int, n: int, F: int, aug_p: float,
               variety: float = 0.0) -> dict:
    """Colour clips: ``synth.colour`` at 224 x 224 (training seeds >= 1,000,000), or a
    randomised neutral scene with the ball drawn by ``variety.ball_clip``."""
    rng = np.random.default_rng([0x5EED, run_seed, 2, job])
    clips = np.zeros((n, F, SLOT, SLOT, 3), np.uint8)
    label = np.zeros(n, np.int16)
    cls = np.zeros(n, np.int16)
    for i in range(n):
        if rng.random() >= variety:
            seed = E.TRAIN_SEED_MIN + (run_seed % 1000) * 10_000_000 + job * n + i
            ex = synth.colour(seed, n_frames=F, height=E.RENDER_SIDE, width=E.RENDER_SIDE)
            f = E.resize_frames_np(ex.frames)
            if rng.random() < aug_p:
                f = _codec_like(f, rng, float(rng.uniform(0, 1.5)))
            c, name = 0, ex.answer
        else:
            h, w, c = V.pick_size(rng)
            name = COLOURS[rng.integers(len(COLOURS))]
            fr, _, _ = V.scene(rng, F, h, w, neutral=True, allow_ellipse=False)
            rgb = np.clip(np.array(synth.COLOURS[name]) + rng.integers(-12, 13, 3), 0, 255)
            V.ball_clip(rng, fr, rgb)
            f = V.resize_to(V.Camera(rng, h, w, mild_colour=True)(fr), *SIZES[c])
        th, tw = SIZES[c]
        clips[i, :, :th, :tw] = f
        label[i] = COLOURS.index(name)
        cls[i] = c
    return {"kind": "colour", "frames": clips, "label": label, "cls": cls}


def job_red(job: int, run_seed: int, n: int, aug_p: float, variety: float = 0.0) -> dict:
    """Full-frame red flashes: as ``synth.count`` draws them (224 x 224), or of varied depth
    and texture (``variety.red_flash``) at a random size, through a random camera."""
    rng = np.random.default_rng([0x5EED, run_seed, 3, job])
    S = E.RENDER_SIDE
    out = np.zeros((n, SLOT, SLOT, 3), np.uint8)
    cls = np.zeros(n, np.int16)
    for i in range(n):
        if rng.random() >= variety:
            red = np.array([rng.uniform(200, 255), rng.uniform(0, 35), rng.uniform(0, 35)])
            shade = rng.uniform(0.92, 1.0, (S, 1, 1)) if rng.random() < 0.5 else 1.0
            f = np.clip(np.broadcast_to(red, (S, S, 3)) * shade, 0, 255).astype(np.uint8)
            f = E.resize_frames_np(f[None])
            if rng.random() < aug_p:
                f = _codec_like(f, rng, float(rng.uniform(0, 1.5)))
            c = 0
        else:
            h, w, c = V.pick_size(rng)
            under, _ = V.background(rng, h, w)
            f, _ = V.red_flash(rng, h, w, under)
            f = V.Camera(rng, h, w, mild_colour=True)(f[None].astype(np.uint8))
            f = V.resize_to(f, *SIZES[c])
        th, tw = SIZES[c]
        out[i, :th, :tw] = f[0]
        cls[i] = c
    return {"kind": "red", "frames": out, "cls": cls}


def job_eval(task: str, seeds: list, n_frames: int) -> dict:
    """Real synth videos (the distribution of the samples), resized as the adapter does."""
    frames, answers = [], []
    for s in seeds:
        f, a, _, _ = E.render_example(task, int(s), n_frames)
        frames.append(f)
        answers.append(a)
    return {"kind": "eval", "task": task, "frames": np.stack(frames), "answers": answers}


def token_labels(box, num, size=(E.FRAME_SIDE, E.FRAME_SIDE)):
    """Per merged token of a needle pair: which digit covers most of its 28 x 28 cell, split
    at the middle of the number's box (tens | units); 0 where the number covers < 1/4.
    ``box [..., 4]`` (x0, y0, x1, y1 in px of the model's ``size`` (h, w) frame), ``num
    [...]`` -> ``[..., (h / 28) * (w / 28)]`` in the merger's row-major token order."""
    box = np.asarray(box, np.float64)
    num = np.asarray(num, np.int64)[..., None]
    x0, y0, x1, y1 = (box[..., i:i + 1] for i in range(4))
    xm = (x0 + x1) / 2
    th, tw = size[0] // TOK_CELL, size[1] // TOK_CELL
    cell = np.arange(th * tw)
    cx0, cy0 = (cell % tw) * TOK_CELL, (cell // tw) * TOK_CELL
    oy = np.clip(np.minimum(cy0 + TOK_CELL, y1) - np.maximum(cy0, y0), 0, None)
    ol = oy * np.clip(np.minimum(cx0 + TOK_CELL, xm) - np.maximum(cx0, x0), 0, None)
    orr = oy * np.clip(np.minimum(cx0 + TOK_CELL, x1) - np.maximum(cx0, xm), 0, None)
    lab = np.where(ol >= orr, 1 + num // 10, 11 + num % 10)
    return np.where(np.maximum(ol, orr) > 0.25 * TOK_CELL ** 2, lab, 0).astype(np.int64)


# =============================================================================== frame bank
class Bank:
    """All training frames in one uint8 tensor on the device: scene clips, needle runs (two
    frame slots each, tied to their scene's slot), colour clips, red flashes. Ring buffers:
    new renderings overwrite the oldest. Every clip and flash has a model-side frame size
    (``SIZES[cls]``), stored top-left in a SLOT x SLOT slot; a video is composed from one
    size only, as a real video has one."""

    def __init__(self, device, scenes: int, needles_per_scene: int, clip_frames: int,
                 colour_clips: int, red: int):
        self.device = device
        self.S, self.K, self.F, self.C, self.R = scenes, needles_per_scene, clip_frames, \
            colour_clips, red
        side = SLOT
        self.scene_base = 0
        self.needle_base = self.S * self.F
        self.colour_base = self.needle_base + self.S * self.K * 2
        self.red_base = self.colour_base + self.C * self.F
        rows = self.red_base + self.R
        self.frames = torch.zeros(rows, side, side, 3, dtype=torch.uint8, device=device)
        self.scene_ok = np.zeros(self.S, bool)
        self.num = np.zeros((self.S, self.K), np.int64)
        self.start = np.zeros((self.S, self.K), np.int64)
        self.len = np.ones((self.S, self.K), np.int64)
        self.tok = np.zeros((self.S, self.K, MAX_TOK), np.int64)
        self.scene_cls = np.zeros(self.S, np.int64)
        self.colour_ok = np.zeros(self.C, bool)
        self.colour_label = np.full(self.C, -1, np.int64)
        self.colour_cls = np.zeros(self.C, np.int64)
        self.red_ok = np.zeros(self.R, bool)
        self.red_cls = np.zeros(self.R, np.int64)
        self.red_n = 0
        self._s = self._c = self._r = 0
        self.inserted = {"scenes": 0, "colour": 0, "red": 0}
        self._refresh()

    def _refresh(self):
        self.valid_scenes = np.flatnonzero(self.scene_ok)
        n = len(SIZES)
        self.scenes_by_cls = [np.flatnonzero(self.scene_ok & (self.scene_cls == k))
                              for k in range(n)]
        self.red_by_cls = [np.flatnonzero(self.red_ok & (self.red_cls == k)) for k in range(n)]
        self.colour_by = [[np.flatnonzero(self.colour_ok & (self.colour_label == c)
                                          & (self.colour_cls == k))
                           for c in range(len(COLOURS))] for k in range(n)]
        self.colours_in = [np.array([c for c in range(len(COLOURS)) if len(self.colour_by[k][c])],
                                    np.int64) for k in range(n)]
        # the size-0 (112 x 112) views the rest of the code and the tests read
        self.colour_by_label = [np.flatnonzero(self.colour_ok & (self.colour_label == c))
                                for c in range(len(COLOURS))]
        self.colours_present = np.array([c for c in range(len(COLOURS))
                                         if len(self.colour_by_label[c])], np.int64)

    def view(self, cls: int):
        """The bank's frames cut to size ``cls`` (a strided view: gathering from it copies
        only those pixels)."""
        h, w = SIZES[cls]
        return self.frames[:, :h, :w]

    def pick_size(self, task: str, rng, weights=None) -> int:
        """A frame size for the next micro-batch of ``task``: as often as the bank holds it
        (or by ``weights``), among the sizes it can compose now."""
        ok = self.sizes_for(task)
        if weights is not None:
            w = np.array([weights[k] for k in ok], np.float64)
        elif task == "colour":
            w = np.array([(self.colour_ok & (self.colour_cls == k)).sum() for k in ok], float)
        else:
            w = np.array([len(self.scenes_by_cls[k]) for k in ok], np.float64)
        if w.sum() <= 0:
            w = np.ones(len(ok))
        return int(ok[rng.choice(len(ok), p=w / w.sum())])

    def sizes_for(self, task: str) -> list:
        """The frame sizes a video of this task can be composed at now."""
        if task == "colour":
            return [k for k in range(len(SIZES)) if len(self.colours_in[k])]
        ok = [k for k in range(len(SIZES)) if len(self.scenes_by_cls[k])]
        if task == "count":
            ok = [k for k in ok if len(self.red_by_cls[k])]
        elif task == "order":
            ok = [k for k in ok if len(self.scenes_by_cls[k]) >= 2 or self.K >= 2]
        return ok

    def _put(self, rows: np.ndarray, data: np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(data.reshape(-1, *data.shape[-3:])))
        self.frames[torch.from_numpy(rows).to(self.device)] = t.to(self.device)

    def add(self, d: dict):
        kind = d["kind"]
        if kind == "scenes":
            n = min(len(d["frames"]), self.S)
            slots = (self._s + np.arange(n)) % self.S
            self._s = (self._s + n) % self.S
            F, K = self.F, self.K
            self._put((self.scene_base + slots[:, None] * F + np.arange(F)).reshape(-1),
                      d["frames"][:n, :F])
            self._put((self.needle_base + (slots[:, None] * K + np.arange(K))[..., None] * 2
                       + np.arange(2)).reshape(-1), d["needles"][:n, :K])
            self.num[slots], self.start[slots], self.len[slots] = \
                d["num"][:n, :K], d["start"][:n, :K], d["len"][:n, :K]
            cls = np.asarray(d.get("cls", np.zeros(n)), np.int64)[:n]
            self.tok[slots] = 0
            for k in np.unique(cls):
                sel = np.flatnonzero(cls == k)
                self.tok[slots[sel], :, :size_tokens(k)] = token_labels(
                    d["box"][sel, :K], d["num"][sel, :K], SIZES[k])
            self.scene_cls[slots] = cls
            self.scene_ok[slots] = True
        elif kind == "colour":
            n = min(len(d["frames"]), self.C)
            slots = (self._c + np.arange(n)) % self.C
            self._c = (self._c + n) % self.C
            self._put((self.colour_base + slots[:, None] * self.F + np.arange(self.F)).reshape(-1),
                      d["frames"][:n, :self.F])
            self.colour_label[slots] = d["label"][:n]
            self.colour_cls[slots] = np.asarray(d.get("cls", np.zeros(n)), np.int64)[:n]
            self.colour_ok[slots] = True
        elif kind == "red":
            n = min(len(d["frames"]), self.R)
            slots = (self._r + np.arange(n)) % self.R
            self._r = (self._r + n) % self.R
            self._put(self.red_base + slots, d["frames"][:n])
            self.red_cls[slots] = np.asarray(d.get("cls", np.zeros(n)), np.int64)[:n]
            self.red_ok[slots] = True
            self.red_n = int(self.red_ok.sum())
        else:
            return
        self.inserted[kind] += n
        self._refresh()

    def ready(self, min_scenes: int) -> bool:
        return (len(self.valid_scenes) >= min_scenes
                and all(self.sizes_for(t) for t in TASKS))

    def fill(self) -> str:
        return (f"scenes {len(self.valid_scenes)}/{self.S} colour {int(self.colour_ok.sum())}/"
                f"{self.C} red {self.red_n}/{self.R}")


# =============================================================================== composing
class Composer:
    """Index tensors of training videos over the bank (numpy, vectorised over the batch)."""

    def __init__(self, bank: Bank, answer_ids: dict):
        self.b = bank
        self.answer_ids = answer_ids

    def _background(self, rng, B, Tf, pool_ids, base, max_pool=4):
        F = self.b.F
        psize = rng.integers(1, max_pool + 1, size=B)
        pools = pool_ids[rng.integers(0, len(pool_ids), size=(B, max_pool))]
        nseg = Tf // F + 2
        pick = (rng.random((B, nseg)) * psize[:, None]).astype(np.int64)
        scenes = np.take_along_axis(pools, pick, 1)
        ar = np.arange(F)
        fr = np.where((rng.random((B, nseg)) < 0.5)[..., None], F - 1 - ar, ar)
        idx = (base + scenes[..., None] * F + fr).reshape(B, -1)
        off = rng.integers(0, F, size=B)
        return np.take_along_axis(idx, off[:, None] + np.arange(Tf)[None], 1)

    def _context(self, idx, p, s, r):
        """Frames around needle position p come from the needle's own scene clip, aligned so
        that the run's clip frame lands on p."""
        B, Tf = idx.shape
        F = self.b.F
        j = self.b.start[s, r]
        cols = (p - j)[:, None] + np.arange(F)
        vals = self.b.scene_base + s[:, None] * F + np.arange(F)
        ok = (cols >= 0) & (cols < Tf)
        rows = np.broadcast_to(np.arange(B)[:, None], cols.shape)
        idx[rows[ok], cols[ok]] = vals[ok]

    def _needle(self, idx, aux, aux_tok, p, s, r, ln):
        B, Tf = idx.shape
        K = self.b.K
        cols = p[:, None] + np.arange(2)
        vals = self.b.needle_base + ((s * K + r) * 2)[:, None] + np.arange(2)
        ok = (np.arange(2)[None] < ln[:, None]) & (cols < Tf)
        rows = np.broadcast_to(np.arange(B)[:, None], cols.shape)
        idx[rows[ok], cols[ok]] = vals[ok]
        lab = np.broadcast_to((1 + self.b.num[s, r] - 10)[:, None], cols.shape)
        aux[rows[ok], cols[ok] // 2] = lab[ok]
        nt = aux_tok.shape[-1]
        tl = np.broadcast_to(self.b.tok[s, r][:, None, :nt], (*cols.shape, nt))
        aux_tok[rows[ok], cols[ok] // 2] = tl[ok]

    def make(self, task: str, rng, B: int, Tp: int, cls: int = 0):
        """``(idx [B, 2 Tp] int64 bank rows, answer token ids [B], aux labels [B, Tp],
        per-token digit labels [B, Tp, tokens per pair])`` for videos of frame size
        ``SIZES[cls]`` (every frame of a video has the same size)."""
        b = self.b
        Tf = 2 * Tp
        aux = np.zeros((B, Tp), np.int64)
        aux_tok = np.zeros((B, Tp, size_tokens(cls)), np.int64)
        ids = self.answer_ids[task]
        if task == "colour":
            idx = np.empty((B, Tf), np.int64)
            present = b.colours_in[cls]
            cols = present[rng.integers(0, len(present), size=B)]
            for c in np.unique(cols):
                sel = np.flatnonzero(cols == c)
                idx[sel] = self._background(rng, len(sel), Tf, b.colour_by[cls][c],
                                            b.colour_base, max_pool=3)
            aux[:] = (91 + cols)[:, None]
            ans = np.array([ids[COLOURS[c]] for c in cols])
            return idx, ans, aux, aux_tok
        vs = b.scenes_by_cls[cls]
        idx = self._background(rng, B, Tf, vs, b.scene_base)
        if task == "needle":
            s = vs[rng.integers(0, len(vs), size=B)]
            r = rng.integers(0, b.K, size=B)
            ln = np.minimum(b.len[s, r], Tf)
            p = np.round(rng.random(B) * (Tf - ln)).astype(np.int64)
            self._context(idx, p, s, r)
            self._needle(idx, aux, aux_tok, p, s, r, ln)
            ans = np.array([ids[str(v)] for v in b.num[s, r]])
        elif task == "order":
            s1 = vs[rng.integers(0, len(vs), size=B)]
            r1 = rng.integers(0, b.K, size=B)
            same = rng.random(B) < 0.5
            s2 = np.where(same, s1, vs[rng.integers(0, len(vs), size=B)])
            r2 = np.where(same, (r1 + 1 + rng.integers(0, max(b.K - 1, 1), size=B)) % b.K,
                          rng.integers(0, b.K, size=B))
            for _ in range(50):     # the two numbers must differ
                bad = b.num[s1, r1] == b.num[s2, r2]
                if not bad.any():
                    break
                s2[bad] = vs[rng.integers(0, len(vs), size=int(bad.sum()))]
                r2[bad] = rng.integers(0, b.K, size=int(bad.sum()))
            l1, l2 = b.len[s1, r1].copy(), b.len[s2, r2].copy()
            for _ in range(3):      # synth.order's rule for short videos
                over = l1 + l2 + 1 > Tf
                l1n = np.where(over, np.maximum(1, l1 - 1), l1)
                l2 = np.where(over, np.maximum(1, l2 - (l1 == 1)), l2)
                l1 = l1n
            p1 = rng.integers(0, np.maximum(Tf - l1 - l2, 1))
            p2 = rng.integers(p1 + l1 + 1, np.maximum(Tf - l2 + 1, p1 + l1 + 2))
            self._context(idx, p1, s1, r1)
            self._context(idx, p2, s2, r2)
            self._needle(idx, aux, aux_tok, p1, s1, r1, l1)
            self._needle(idx, aux, aux_tok, p2, s2, r2, l2)
            ans = np.array([ids[str(v)] for v in b.num[s1, r1]])
        elif task == "count":
            # synth.count's rule, vectorised: k of the Tf - k + 1 slots, spread by rank
            most = min(9, (Tf + 1) // 2)
            k = rng.integers(1, most + 1, size=B)
            keys = rng.random((B, Tf))
            keys[np.arange(Tf)[None] >= (Tf - k + 1)[:, None]] = 2.0
            first = np.argsort(keys, axis=1)[:, :most]
            ok = np.arange(most)[None] < k[:, None]
            slots = np.sort(np.where(ok, first, 10 * Tf), axis=1)
            fl = slots + np.arange(most)[None]
            rows = np.broadcast_to(np.arange(B)[:, None], fl.shape)
            reds = b.red_by_cls[cls]
            idx[rows[ok], fl[ok]] = b.red_base + reds[rng.integers(0, len(reds),
                                                                   size=int(ok.sum()))]
            aux[rows[ok], fl[ok] // 2] = AUX_RED
            ans = np.array([ids[str(v)] for v in k])
        else:
            raise ValueError(task)
        return idx, ans, aux, aux_tok


# =============================================================================== model step
class Trainer:
    def __init__(self, model, tok, device, *, aux_weight: float, use_autocast: bool,
                 sharpen: float = 0.0, sharpener=None, sharpen_min_len: int = 1024):
        self.model, self.tok, self.device = model, tok, device
        self.cfg = model.config
        self.text = model.model.language_model
        self.embed = self.text.get_input_embeddings()
        self.lm_head = model.lm_head
        self.bv = E.BatchedVision(model)
        self.aux_weight = aux_weight
        self.autocast = use_autocast
        # the attention-sharpening term (lab.toy.sharpen): weight, collector, and the
        # shortest prompt it applies to (sparse prefill is for long prompts only)
        self.sharpen, self.sharpener, self.sharpen_min_len = sharpen, sharpener, sharpen_min_len
        self.last_tail = None       # the last forward's mean tail mass (None: not measured)
        hidden = self.cfg.text_config.hidden_size
        # per-pair auxiliary heads: the class (plain / number / colour / red) and, for
        # pairs showing a number, its two digits (ten times the examples per class)
        self.aux_head = torch.nn.Linear(hidden, AUX_CLASSES + 20).to(device)
        # per-token digit head: dense supervision that teaches the vision tower to read
        self.tok_head = torch.nn.Linear(hidden, TOK_CLASSES).to(device)
        self.end_id = tok.convert_tokens_to_ids("<|im_end|>")
        self._layouts = {}
        self.pix_dtype = torch.bfloat16 if use_autocast else torch.float32

    def layout(self, task: str, Tp: int, fps: float, grid_hw=(E.GRID, E.GRID)):
        key = (task, Tp, fps, tuple(grid_hw))
        if key not in self._layouts:
            head, tail, pos = E.layout(self.tok, self.cfg, synth.QUESTIONS[task], Tp, fps,
                                       grid_hw=tuple(grid_hw))
            dev = self.device
            self._layouts[key] = (torch.tensor(head, device=dev), torch.tensor(tail, device=dev),
                                  pos.to(dev))
            if len(self._layouts) > 512:
                self._layouts.pop(next(iter(self._layouts)))
        return self._layouts[key]

    def forward(self, frames, task: str, answers, aux=None, aux_tok=None, fps: float = 2.0,
                size=(E.FRAME_SIDE, E.FRAME_SIDE)):
        """frames uint8 ``[B, 2 Tp, >= h, >= w, 3]`` on the device (the top-left ``size`` =
        (h, w) of each slot is the frame); answers LongTensor [B].
        Returns (loss, predicted answer ids [B])."""
        import torch.nn.functional as F
        B, Tf = frames.shape[:2]
        Tp = Tf // 2
        h, w = size
        frames = frames[:, :, :h, :w]
        grid = (h // 14, w // 14)
        ntok = (h // TOK_CELL) * (w // TOK_CELL)
        head, tail, pos = self.layout(task, Tp, fps, grid)
        pix = E.pixels_from_frames(frames, dtype=self.pix_dtype)
        ctx = (torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast
               else torch.autocast("cpu", enabled=False))
        with ctx:
            vis = self.bv(pix, B * Tp, grid)
            del pix
            D = vis.shape[-1]
            vis = vis.view(B, Tp * ntok, D)
            tail_ids = torch.cat([tail.expand(B, -1), answers[:, None]], 1)
            e_head = self.embed(head)[None].expand(B, -1, -1)
            e_tail = self.embed(tail_ids)
            x = torch.cat([e_head, vis.to(e_head.dtype), e_tail], 1)
            L = x.shape[1]
            h, tail = self._text(x, pos.view(3, 1, L).expand(3, B, L), L)
            logits = self.lm_head(h[:, -2:]).float()
            loss = F.cross_entropy(logits[:, 0], answers) \
                + 0.5 * F.cross_entropy(logits[:, 1], torch.full_like(answers, self.end_id))
            self.last_tail = None
            if tail:
                tail = torch.stack([t.mean() for t in tail]).mean()
                self.last_tail = float(tail.detach())
                loss = loss + self.sharpen * tail
            if aux is not None and self.aux_weight > 0:
                pooled = vis.view(B, Tp, ntok, D).float().mean(2)
                out = self.aux_head(pooled).float().view(B * Tp, -1)
                al, tens, units = out[:, :AUX_CLASSES], out[:, AUX_CLASSES:AUX_CLASSES + 10], \
                    out[:, AUX_CLASSES + 10:]
                lab = aux.view(-1)
                special = lab > 0
                ns = special.sum()
                npl = (~special).sum()
                w = torch.where(special, torch.ones_like(lab, dtype=torch.float32),
                                ns.clamp(min=1).float() / npl.clamp(min=1).float())
                ce = F.cross_entropy(al, lab, reduction="none")
                aux_loss = (ce * w).sum() / w.sum()
                is_num = (lab >= 1) & (lab <= 90)
                num = (lab + 9).clamp(min=10, max=99)
                digit_ce = F.cross_entropy(tens, num // 10, reduction="none") \
                    + F.cross_entropy(units, num % 10, reduction="none")
                aux_loss = aux_loss + (digit_ce * is_num).sum() / is_num.sum().clamp(min=1)
                if aux_tok is not None:
                    tl = self.tok_head(vis.view(B * Tp, ntok, D)).float()
                    tce = F.cross_entropy(tl.reshape(-1, TOK_CLASSES), aux_tok.reshape(-1),
                                          reduction="none").view(B * Tp, ntok).mean(1)
                    aux_loss = aux_loss + (tce * is_num).sum() / is_num.sum().clamp(min=1)
                loss = loss + self.aux_weight * aux_loss
        return loss, logits[:, 0].argmax(-1)

    def _text(self, x, position_ids, L: int):
        """The language model over ``x``; with sharpening on and a long enough prompt, also
        each layer's tail mass (the attention function is swapped for this call only, so
        evaluation and the saved config keep SDPA)."""
        if not (self.sharpen > 0 and self.sharpener is not None and self.model.training
                and L >= self.sharpen_min_len):
            return self.text(inputs_embeds=x, position_ids=position_ids,
                             use_cache=False).last_hidden_state, []
        cfg = self.text.config
        before = cfg._attn_implementation
        cfg._attn_implementation = self.sharpener.register()
        try:
            with self.sharpener.collect(L, device=x.device) as tail:
                h = self.text(inputs_embeds=x, position_ids=position_ids,
                              use_cache=False).last_hidden_state
        finally:
            cfg._attn_implementation = before
        return h, tail

    def params(self):
        return (list(self.model.parameters()) + list(self.aux_head.parameters())
                + list(self.tok_head.parameters()))


# =============================================================================== evaluation
@torch.no_grad()
def evaluate(trainer: Trainer, bank: Bank, composer: Composer, eval_sets: dict, lengths,
             n_per_task: int, batch_tokens: int, seed: int) -> dict:
    model = trainer.model
    was = model.training
    model.eval()
    out = {}
    try:
        for task, (frames, answers) in eval_sets.items():
            correct = 0
            for s in range(0, len(frames), 32):
                _, pred = trainer.forward(frames[s:s + 32], task, answers[s:s + 32])
                correct += int((pred == answers[s:s + 32]).sum())
            out.setdefault("synth20", {})[task] = correct / max(len(frames), 1)
        rng = np.random.default_rng([0xE7A1, seed])
        # bank-composed videos at 112 x 112 and at 84 x 112 (what a 4:3 video becomes)
        for Tp in lengths:
            name0 = f"{Tp * PAIR_TOKENS // 1024}K" if Tp * PAIR_TOKENS >= 1024 else \
                str(Tp * PAIR_TOKENS)
            n_len = n_per_task if Tp * PAIR_TOKENS < 8192 else max(1, n_per_task // 2)
            for cls in (0, 1):
                name = name0 if cls == 0 else f"{name0}@{SIZES[cls][0]}x{SIZES[cls][1]}"
                for task in TASKS:
                    if cls not in bank.sizes_for(task):
                        continue
                    B = max(1, min(n_len, batch_tokens // (Tp * size_tokens(cls) + 40)))
                    correct = total = 0
                    while total < n_len:
                        nb = min(B, n_len - total)
                        idx, ans, _, _ = composer.make(task, rng, nb, Tp, cls)
                        frames = bank.view(cls)[torch.from_numpy(idx).to(bank.device).view(-1)]
                        frames = frames.view(nb, 2 * Tp, *SIZES[cls], 3)
                        a = torch.from_numpy(ans).to(bank.device)
                        _, pred = trainer.forward(frames, task, a, size=SIZES[cls])
                        correct += int((pred == a).sum())
                        total += nb
                        del frames
                    out.setdefault(name, {})[task] = correct / total
    finally:
        model.train(was)
    return out


def fmt_eval(ev: dict) -> str:
    parts = []
    for name, accs in ev.items():
        parts.append(f"{name}: " + " ".join(f"{t} {accs[t]:.2f}" for t in TASKS if t in accs))
    return " | ".join(parts)


# =============================================================================== workers
class Feeder:
    """Keeps worker jobs in flight and hands finished renderings to the bank."""

    def __init__(self, workers: int, run_seed: int, args):
        self.args = args
        self.run_seed = run_seed
        self.job = 0
        self.pending = deque()
        self.failed = 0
        self.pool = None
        self.kinds = deque()
        if workers > 0:
            import multiprocessing as mp
            try:
                self.pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init,
                                                          initargs=(args.led,))
            except (OSError, RuntimeError, ImportError) as e:   # e.g. no /dev/shm semaphores
                log(f"WARNING: no worker processes ({type(e).__name__}: {e}); rendering "
                    f"in this process (slower, the bank is refreshed rarely)")
                workers = 0
        self.workers = workers

    def _submit(self, fn, *a):
        if self.pool is None:
            self.pending.append(_Done(fn(*a)))
        else:
            self.pending.append(self.pool.apply_async(fn, a))

    def submit(self, kind: str, **kw):
        a = self.args
        self.job += 1
        if kind == "scenes":
            self._submit(job_scenes, self.job, self.run_seed, a.chunk, a.clip_frames,
                         a.needles_per_scene, a.aug, a.variety)
        elif kind == "colour":
            self._submit(job_colour, self.job, self.run_seed, a.chunk, a.clip_frames, a.aug,
                         a.variety)
        elif kind == "red":
            self._submit(job_red, self.job, self.run_seed, kw.get("n", 256), a.aug, a.variety)
        elif kind == "eval":
            self._submit(job_eval, kw["task"], kw["seeds"], kw["n_frames"])

    def poll(self, block: bool = False, timeout: float = 0.0) -> list:
        done, keep = [], deque()
        t_end = time.time() + timeout
        while True:
            for r in self.pending:
                if r.ready():
                    try:
                        done.append(r.get())
                    except Exception as e:   # a failed rendering job is logged, not fatal
                        self.failed += 1
                        if self.failed <= 3:
                            cause = getattr(e, "__cause__", None)
                            log(f"worker job failed: {type(e).__name__}: {e}"
                                + (f"\n{cause}" if cause else ""))
                else:
                    keep.append(r)
            self.pending = keep
            if done or not block or not self.pending or time.time() > t_end:
                return done
            keep = deque()
            time.sleep(0.05)

    def close(self):
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


class _Done:
    def __init__(self, value):
        self.value = value

    def ready(self):
        return True

    def get(self):
        return self.value


# =============================================================================== state
def save_state(path: Path, trainer: Trainer, opt, meta: dict):
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": trainer.model.state_dict(), "aux_head": trainer.aux_head.state_dict(),
                "tok_head": trainer.tok_head.state_dict(),
                "opt": opt.state_dict(), "meta": meta}, tmp)
    os.replace(tmp, path)


def lr_at(step: int, f: float, peak: float, warmup: int) -> float:
    w = min(1.0, (step + 1) / max(warmup, 1))
    return peak * w * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(f, 0.0), 1.0))))


def next_longest(M: int, m0: int, M_final: int, f: float, grow=(0.4, 0.85),
                 passed: bool = False) -> int:
    """The curriculum's longest video (pairs) after this step: it doubles when the tasks pass
    (``passed``), and at the latest on a schedule that grows geometrically from ``m0`` at the
    fraction ``grow[0]`` of the run to ``M_final`` at ``grow[1]``. The last step may be less
    than a doubling: once the schedule reaches ``M_final`` the run trains there (before, a
    longest video above ``M_final / 2`` waited for a doubling the cap forbade, and ft6 never
    saw more than 1143 of its 2048 pairs)."""
    if M >= M_final:
        return M_final
    k_final = math.log2(max(M_final / max(m0, 1), 1))
    g0, g1 = grow
    forced = m0 * 2 ** (k_final * min(max((f - g0) / max(g1 - g0, 1e-9), 0), 1))
    if passed or forced >= min(2 * M, M_final):
        return min(M_final, max(2 * M, int(forced)))
    return M


def sample_tp(rng, M: int, task: str) -> int:
    lo = 2 if task == "order" else 1
    M = max(M, lo)
    a = max(lo, M // 4) if rng.random() < 0.5 else lo
    return int(min(M, max(lo, round(math.exp(rng.uniform(math.log(a), math.log(M)))))))


# =============================================================================== main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0,
                   help="wall-clock budget of the whole run (bank, training, final save)")
    p.add_argument("--out", required=True, help="checkpoint directory (hub layout)")
    p.add_argument("--state", help="training state for --resume (default: <out>.state.pt)")
    p.add_argument("--resume", action="store_true", help="continue from --state if present")
    p.add_argument("--init", help="start from the weights of this checkpoint dir (e.g. an "
                   "earlier --out; fresh optimizer, curriculum from its embedded.json)")
    p.add_argument("--archive", help="also write the final checkpoint as one .tar.gz here")
    p.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    p.add_argument("--workers", type=int, default=None,
                   help="rendering processes (default: cores - 2, at most 14; 0: in-process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=32768,
                   help="visual tokens of the longest training video (curriculum end)")
    p.add_argument("--start-pairs", type=int, default=None,
                   help="curriculum start (pairs; default 4, or with --init the curriculum "
                   "the checkpoint ended at)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="visual tokens per micro-batch (default 65536 on GPU, 2048 on CPU)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="videos per micro-batch at most (default 1024 GPU, 16 CPU)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--aux-weight", type=float, default=0.5,
                   help="weight of the auxiliary vision losses (per pair, per token)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: time)")
    p.add_argument("--ckpt-every", type=float, default=60.0, help="seconds")
    p.add_argument("--eval-every", type=float, default=60.0, help="seconds")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds")
    p.add_argument("--eval-n", type=int, default=None,
                   help="videos per task per eval length (default 32 GPU, 2 CPU; half that "
                   "at 8K tokens and more)")
    p.add_argument("--scenes", type=int, default=None, help="bank scene clips (8192 GPU)")
    p.add_argument("--colour-clips", type=int, default=None, help="bank colour clips (4096 GPU)")
    p.add_argument("--red", type=int, default=1024, help="bank red flash frames")
    p.add_argument("--clip-frames", type=int, default=8)
    p.add_argument("--needles-per-scene", type=int, default=4)
    p.add_argument("--chunk", type=int, default=16, help="clips per rendering job")
    p.add_argument("--aug", type=float, default=0.5,
                   help="share of synth-look clips made codec-like")
    p.add_argument("--deepen", type=int, nargs=2, default=(0, 0), metavar=("VISION", "TEXT"),
                   help="insert this many vision blocks and decoder layers into the --init "
                   "model, identity at first (lab.toy.grow): more capacity from a "
                   "trained start")
    p.add_argument("--led", type=float, default=0.0,
                   help="share of variety's numbers redrawn as LED-matrix cells (variety.led). "
                   "An experiment, off by default: it is the look of render_eval's dot-matrix "
                   "digits, which then no longer measure an unseen look")
    p.add_argument("--variety", type=float, default=0.8,
                   help="share of clips drawn with lab.toy.variety's randomised looks, "
                   "sizes and cameras (the rest: synth's look at 224 x 224)")
    p.add_argument("--size-weight", type=float, nargs=len(V.SIZES), default=None,
                   metavar="W", help=f"how often a training video has each frame size "
                   f"{list(V.SIZES)} (default: as often as the bank holds it)")
    p.add_argument("--refresh", type=float, default=300.0,
                   help="scene clips re-rendered per second while training (GPU)")
    p.add_argument("--min-fill", type=float, default=0.15,
                   help="start training once this share of the bank's scenes is rendered")
    p.add_argument("--reserve", type=float, default=None,
                   help="seconds kept for the final eval + save (default 25 GPU, 5 CPU)")
    p.add_argument("--grow", type=float, nargs=2, default=(0.4, 0.85),
                   metavar=("FROM", "TO"),
                   help="fractions of the run between which the longest video grows, at the "
                   "latest, from the start to --max-tokens (default 0.4 0.85; a fine-tune at "
                   "long lengths: e.g. 0.05 0.3)")
    p.add_argument("--sharpen", type=float, default=0.0,
                   help="weight of the attention tail-mass term (lab.toy.sharpen; 0: off)")
    p.add_argument("--sharpen-rho", type=float, default=0.1,
                   help="the share of a row block's key blocks whose mass is free of the term")
    p.add_argument("--sharpen-blocks", type=int, nargs=2, default=(3, 64),
                   metavar=("RANDOM", "LAST"),
                   help="row blocks sampled per forward at random, and the last rows")
    p.add_argument("--sharpen-block", type=int, nargs=2, default=(64, 64),
                   metavar=("ROWS", "KEYS"), help="row block and key block of the term")
    p.add_argument("--sharpen-min-len", type=int, default=1024,
                   help="prompts shorter than this (tokens) are trained without the term")
    p.add_argument("--shape", help="JSON overrides of embedded.SHAPE (tests)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS,
                   help="train on these tasks only (experiments)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t_start = time.time()
    deadline = t_start + args.minutes * 60
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    gpu = lambda a, b: a if cuda else b   # noqa: E731
    args.batch_tokens = args.batch_tokens or gpu(65536, 2048)
    args.max_batch = args.max_batch or gpu(1024, 16)
    args.eval_n = args.eval_n or gpu(32, 2)
    args.scenes = args.scenes or gpu(8192, 48)
    args.colour_clips = args.colour_clips or gpu(4096, 32)
    args.red = min(args.red, gpu(args.red, 64))
    reserve = args.reserve if args.reserve is not None else gpu(25.0, 5.0)
    if args.workers is None:
        args.workers = max(0, min(14, (os.cpu_count() or 2) - 2)) if cuda else 0
    out = Path(args.out)
    state_path = Path(args.state) if args.state else out.with_name(out.name + ".state.pt")
    E.use_bundled_fonts()
    V.use_led(args.led)         # this process too: it renders when there are no workers
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log(f"device {dev}{' ' + torch.cuda.get_device_name(dev) if cuda else ''}; torch "
        f"{torch.__version__}; budget {args.minutes:g} min; workers {args.workers}")

    shape = json.loads(args.shape) if args.shape else None
    if shape is None and args.init:     # a deepened checkpoint trains at its own shape
        from transformers import AutoConfig
        shape = grow.shape_of(AutoConfig.from_pretrained(args.init))
    model, tok = E.new_model(shape, seed=args.seed)
    if args.init:
        _load_weights(model, Path(args.init))
        log(f"weights initialised from {args.init}")
        if any(args.deepen):
            model = grow.deepen(model, *args.deepen, seed=args.seed)
            s = grow.shape_of(model.config)
            log(f"deepened by {args.deepen[0]} vision blocks and {args.deepen[1]} decoder "
                f"layers (identity at first): vision {s['vision_depth']}, text {s['layers']}")
    elif any(args.deepen):
        raise SystemExit("--deepen grows an --init model; give --init")
    model.to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    sharpener = None
    if args.sharpen > 0:
        from lab.toy.sharpen import Sharpener
        sharpener = Sharpener(rho=args.sharpen_rho, n_random=args.sharpen_blocks[0],
                              n_last=args.sharpen_blocks[1], row_block=args.sharpen_block[0],
                              key_block=args.sharpen_block[1], seed=args.seed,
                              min_pos=args.sharpen_min_len // 4)   # rows that see few keys: no
        log(f"sharpening: weight {args.sharpen:g}, rho {args.sharpen_rho:g}, "
            f"{args.sharpen_blocks[0]} random row blocks + the last {args.sharpen_blocks[1]} "
            f"rows, blocks {args.sharpen_block[0]} x {args.sharpen_block[1]}, from "
            f"{args.sharpen_min_len} tokens")
    trainer = Trainer(model, tok, dev, aux_weight=args.aux_weight, use_autocast=cuda,
                      sharpen=args.sharpen, sharpener=sharpener,
                      sharpen_min_len=args.sharpen_min_len)
    bv = trainer.bv
    err = bv.check()        # fp32, TF32 off: a real mismatch is O(1), rounding ~1e-6
    if err > 2e-3:
        bv.use_reference = True
        log(f"WARNING: batched vision differs from transformers' ({err:.1e}); using "
            f"get_video_features (slow for long videos)")
        err = bv.check()
    log(f"model {n_params / 1e6:.2f}M params; batched vision vs transformers: rel diff "
        f"{err:.1e}")
    decay = [p for p in trainer.params() if p.dim() >= 2]
    no_decay = [p for p in trainer.params() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)

    meta = {"step": 0, "train_seconds": 0.0, "M": args.start_pairs or 4, "history": [],
            "samples": 0, "tokens": 0}
    if args.resume and state_path.is_file():
        st = torch.load(state_path, map_location=dev, weights_only=False)
        model.load_state_dict(st["model"])
        trainer.aux_head.load_state_dict(st["aux_head"])
        trainer.tok_head.load_state_dict(st["tok_head"])
        opt.load_state_dict(st["opt"])
        meta.update(st["meta"])
        log(f"resumed from {state_path}: step {meta['step']}, "
            f"{meta['train_seconds']:.0f}s trained, curriculum {meta['M']} pairs")
    elif args.resume:
        log(f"--resume: no state at {state_path}; starting fresh")
    elif args.init and args.start_pairs is None:
        try:
            prev = json.loads((Path(args.init) / "embedded.json").read_text())
            meta["M"] = int(prev.get("curriculum_pairs", meta["M"]))
        except (OSError, ValueError):
            pass
    m_start = meta["M"]

    answer_ids = E.answer_ids(tok)
    M_final = max(args.max_tokens // PAIR_TOKENS, 1)
    meta["M"] = max(1, min(meta["M"], M_final))
    eval_lengths = [t for t in EVAL_LENGTHS if t <= M_final] or [M_final]

    bank = Bank(dev, args.scenes, args.needles_per_scene, args.clip_frames, args.colour_clips,
                args.red)
    composer = Composer(bank, answer_ids)
    feeder = Feeder(args.workers, args.seed * 7919 + meta["step"], args)
    rng = np.random.default_rng([0x7EA1, args.seed, meta["step"]])
    result = {"out": str(out)}
    eval_sets: dict = {}
    try:
        # ---------------------------------------------------------------- the bank
        for task in TASKS:
            seeds = list(range(E.TRAIN_EVAL_SEED_MIN, E.TRAIN_EVAL_SEED_MIN + args.eval_n))
            feeder.submit("eval", task=task, seeds=seeds, n_frames=20)
        feeder.submit("red", n=min(args.red, 256))
        need = min(args.scenes, max(8, int(args.min_fill * args.scenes)))
        inflight = max(2, 2 * args.workers)
        sub = {"scenes": 0, "colour": 0}
        n_submitted = 0

        def top_up(limit_rate: bool):
            nonlocal n_submitted
            if feeder.pool is None and limit_rate:
                # in-process: one fresh job every 25 steps on a GPU, none on a CPU
                if cuda and meta["step"] % 25 == 24:
                    kind = "colour" if sub["colour"] / args.colour_clips <= \
                        sub["scenes"] / args.scenes else "scenes"
                    feeder.submit(kind)
                    sub[kind] += args.chunk
                return
            while len(feeder.pending) < inflight:
                if limit_rate and feeder.pool is not None:
                    allowed = need + (time.time() - t_train0) * args.refresh
                    if n_submitted * args.chunk > allowed:
                        return
                # keep both kinds of clip equally fresh relative to their share of the bank
                kind = "colour" if sub["colour"] / args.colour_clips <= \
                    sub["scenes"] / args.scenes else "scenes"
                feeder.submit(kind)
                sub[kind] += args.chunk
                if bank.red_n < bank.R and n_submitted % 64 == 63:
                    feeder.submit("red", n=256)
                n_submitted += 1
                if feeder.pool is None and bank.ready(need) and len(feeder.pending) == 0:
                    return

        def absorb(results):
            for d in results:
                if d["kind"] == "eval":
                    frames = torch.from_numpy(d["frames"]).to(dev)
                    ans = torch.tensor([answer_ids[d["task"]][a] for a in d["answers"]],
                                       device=dev)
                    eval_sets[d["task"]] = (frames, ans)
                else:
                    bank.add(d)

        t_fill = t_fill_log = time.time()
        t_train0 = time.time()
        while not (bank.ready(need) and (len(eval_sets) == len(TASKS)
                                         or time.time() > t_fill + 60)):
            if feeder.pool is None:
                # in-process: just enough for a smoke run
                while not bank.ready(need) or len(bank.colours_present) < min(
                        2, args.colour_clips):
                    if n_submitted > 1000:
                        raise RuntimeError(f"the frame bank does not fill ({bank.fill()})")
                    kind = "colour" if sub["colour"] / args.colour_clips <= \
                        sub["scenes"] / args.scenes else "scenes"
                    feeder.submit(kind)
                    sub[kind] += args.chunk
                    n_submitted += 1
                    absorb(feeder.poll())
                absorb(feeder.poll())
                break
            top_up(False)
            absorb(feeder.poll(block=True, timeout=1.0))
            if time.time() > t_fill_log + 10:
                log(f"rendering the bank: {bank.fill()}")
                t_fill_log = time.time()
            if time.time() > deadline - reserve - 5:
                raise RuntimeError(f"the frame bank did not fill in time ({bank.fill()})")
            if feeder.failed >= 20 and len(bank.valid_scenes) == 0:
                raise RuntimeError(f"{feeder.failed} rendering jobs failed and none worked: "
                                   f"see the first errors above")
        log(f"bank ready in {time.time() - t_fill:.1f}s: {bank.fill()}")

        # ---------------------------------------------------------------- training
        t_train0 = time.time()
        train_end = deadline - reserve
        prev_seconds = meta["train_seconds"]
        planned = prev_seconds + max(train_end - t_train0, 1.0)
        ema = {t: 0.0 for t in args.tasks}
        stage_steps = 0
        last_log = last_eval = last_ckpt = time.time()
        win = {"loss": 0.0, "n": 0, "samples": 0, "tokens": 0, "tail": [],
               "correct": {t: 0 for t in TASKS}, "count": {t: 0 for t in TASKS}}
        errors = 0
        budget_scale = 1.0
        step = step0 = meta["step"]
        stop_reason = "time box"
        while True:
            now = time.time()
            if now >= train_end:
                break
            if args.steps and step - step0 >= args.steps:
                stop_reason = "--steps"
                break
            f = (prev_seconds + now - t_train0) / planned
            absorb(feeder.poll())
            top_up(True)
            M = meta["M"]
            M_next = next_longest(M, min(m_start, M_final), M_final, f, args.grow,
                                  stage_steps >= 30 and min(ema.values()) >= 0.85)
            if M_next != M:
                meta["M"] = M = M_next
                ema = {t: 0.0 for t in args.tasks}
                stage_steps = 0
                log(f"curriculum: longest video now {M} pairs ({M * PAIR_TOKENS} tokens)")
            lr = lr_at(step, f, args.lr, args.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            fps = 2.0 if rng.random() < 0.8 else float(rng.choice([0.5, 1.0, 4.0]))
            try:
                opt.zero_grad(set_to_none=True)
                for task in args.tasks:
                    Tp = sample_tp(rng, M, task)
                    cls = bank.pick_size(task, rng, args.size_weight)
                    size = SIZES[cls]
                    toks = Tp * size_tokens(cls)
                    B = int(max(1, min(args.max_batch * TASK_WEIGHT[task],
                                       budget_scale * args.batch_tokens * TASK_WEIGHT[task]
                                       // (toks + 40))))
                    idx, ans, aux, aux_tok = composer.make(task, rng, B, Tp, cls)
                    idx_t = torch.from_numpy(idx).to(dev, non_blocking=True)
                    frames = bank.view(cls)[idx_t.view(-1)].view(B, 2 * Tp, *size, 3)
                    ans_t = torch.from_numpy(ans).to(dev)
                    aux_t = torch.from_numpy(aux).to(dev)
                    tok_t = torch.from_numpy(aux_tok).to(dev) if task in ("needle", "order") \
                        else None
                    loss, pred = trainer.forward(frames, task, ans_t, aux_t, tok_t, fps=fps,
                                                 size=size)
                    del frames
                    (loss * TASK_WEIGHT[task]).backward()
                    correct = int((pred == ans_t).sum())
                    win["loss"] += float(loss.detach()) * B
                    win["n"] += B
                    win["samples"] += B
                    win["tokens"] += B * toks
                    win["correct"][task] += correct
                    if trainer.last_tail is not None:
                        win["tail"].append(trainer.last_tail)
                    win["count"][task] += B
                    if Tp >= max(1, M // 4):
                        ema[task] = 0.9 * ema[task] + 0.1 * correct / B
                gn = torch.nn.utils.clip_grad_norm_(trainer.params(), 1.0)
                if not torch.isfinite(gn):
                    log(f"step {step}: non-finite gradient norm, step skipped")
                    opt.zero_grad(set_to_none=True)
                else:
                    opt.step()
                step += 1
                stage_steps += 1
                meta["step"] = step
            except torch.cuda.OutOfMemoryError as e:
                errors += 1
                budget_scale *= 0.5
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                log(f"out of memory at {M} pairs ({str(e).splitlines()[0][:120]}); micro-batch "
                    f"budget now x{budget_scale:g}")
            except Exception as e:   # log and go on; give up after many
                errors += 1
                opt.zero_grad(set_to_none=True)
                log(f"step {step} failed: {type(e).__name__}: {e}")
                if errors <= 3:
                    traceback.print_exc()
                if cuda:
                    torch.cuda.empty_cache()
                if errors >= 20:
                    stop_reason = "too many errors"
                    break
            now = time.time()
            meta["train_seconds"] = prev_seconds + now - t_train0
            if now - last_log >= args.log_every:
                dt = now - last_log
                accs = " ".join(f"{t[:3]} {win['correct'][t] / max(win['count'][t], 1):.2f}"
                                for t in TASKS)
                log(f"step {step} f {f:.2f} M {M} lr {lr:.2e} loss "
                    f"{win['loss'] / max(win['n'], 1):.3f} acc[{accs}] "
                    + (f"tail {np.mean(win['tail']):.3f} " if win["tail"] else "")
                    + f"{win['samples'] / dt:.0f} videos/s {win['tokens'] / dt / 1e3:.0f}K tok/s "
                    f"bank +{bank.inserted['scenes']} scenes"
                    + (f" mem {torch.cuda.max_memory_allocated(dev) / 2 ** 30:.1f}G"
                       if cuda else ""))
                meta["samples"] += win["samples"]
                meta["tokens"] += win["tokens"]
                meta["history"].append({"t": round(meta["train_seconds"], 1), "step": step,
                                        "M": M, "loss": win["loss"] / max(win["n"], 1),
                                        **({"tail": float(np.mean(win["tail"]))}
                                           if win["tail"] else {})})
                win = {"loss": 0.0, "n": 0, "samples": 0, "tokens": 0, "tail": [],
                       "correct": {t: 0 for t in TASKS}, "count": {t: 0 for t in TASKS}}
                last_log = now
            if now - last_eval >= args.eval_every and now + 10 < train_end:
                try:
                    # lighter than the final one: the lengths trained so far, 8 videos each
                    ev = evaluate(trainer, bank, composer, eval_sets,
                                  [t for t in eval_lengths if t <= max(M, 64)],
                                  min(8, args.eval_n), args.batch_tokens, step)
                    meta["history"].append({"t": round(meta["train_seconds"], 1),
                                            "step": step, "eval": ev})
                    log(f"eval step {step}: {fmt_eval(ev)}")
                except Exception as e:
                    log(f"eval failed: {type(e).__name__}: {e}")
                last_eval = time.time()
            if now - last_ckpt >= args.ckpt_every:
                _checkpoint(out, state_path, trainer, opt, tok, meta, args, n_params, dev,
                            final=False)
                last_ckpt = time.time()
        log(f"training stopped ({stop_reason}) at step {step}, "
            f"{meta['train_seconds']:.0f}s of training")
        result["stop_reason"] = stop_reason
    except KeyboardInterrupt:
        log("interrupted: saving what there is")
        result["stop_reason"] = "interrupted"
    finally:
        feeder.close()
        # ---------------------------------------------------------------- final
        try:
            if eval_sets and bank.ready(1):
                ev = evaluate(trainer, bank, composer, eval_sets, eval_lengths, args.eval_n,
                              args.batch_tokens, 10 ** 6)
                meta["final_eval"] = ev
                log(f"final eval: {fmt_eval(ev)}")
        except Exception as e:
            log(f"final eval failed: {type(e).__name__}: {e}")
        _checkpoint(out, state_path, trainer, opt, tok, meta, args, n_params, dev, final=True)
        if args.archive:
            import tarfile
            Path(args.archive).parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(args.archive, "w:gz") as tar:
                for f in sorted(out.iterdir()):
                    if f.is_file():
                        tar.add(f, arcname=f"{out.name}/{f.name}")
            log(f"wrote {args.archive}")
        log(f"done in {time.time() - t_start:.0f}s: {out}")
    result.update(step=meta["step"], final_eval=meta.get("final_eval"), history=meta["history"])
    return result


def _load_weights(model, path: Path):
    """Copy the weights of a saved checkpoint (any storage dtype) into ``model``."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    src = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    own = model.state_dict()
    state = src.state_dict()
    missing = [k for k in own if k not in state or state[k].shape != own[k].shape]
    if missing:
        raise KeyError(f"{path} does not fit this model: {missing[:3]}")
    model.load_state_dict({k: state[k] for k in own}, strict=True)


def _checkpoint(out, state_path, trainer, opt, tok, meta, args, n_params, dev, final: bool):
    import transformers
    info = {
        "made_by": "lab/train/train_embedded.py", "command": " ".join(sys.argv),
        "final": final, "steps": meta["step"], "train_seconds": round(meta["train_seconds"], 1),
        "videos_seen": meta["samples"], "visual_tokens_seen": meta["tokens"],
        "curriculum_pairs": meta["M"], "max_tokens": args.max_tokens,
        "params": n_params, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
        else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
        "frame_side": E.FRAME_SIDE, "tokens_per_pair": PAIR_TOKENS,
        "seed_split": {"train": f"synth.colour seeds >= {E.TRAIN_SEED_MIN} and private RNG "
                                "streams default_rng([0x5EED, run_seed, kind, job])",
                       "train_eval": f"[{E.TRAIN_EVAL_SEED_MIN}, +1000)",
                       "heldout_benchmark": f"[{E.HELDOUT_SEED_MIN}, {E.HELDOUT_SEED_MAX})",
                       "samples": "1000-1002"},
        "eval": meta.get("final_eval") or next((h["eval"] for h in reversed(meta["history"])
                                                if "eval" in h), None),
    }
    try:
        E.save_checkpoint(trainer.model, tok, out, info=info)
        save_state(state_path, trainer, opt, meta)
        log(f"{'final ' if final else ''}checkpoint saved: {out} (step {meta['step']})")
    except Exception as e:
        log(f"checkpoint failed: {type(e).__name__}: {e}")
        traceback.print_exc()
        if final:
            raise


if __name__ == "__main__":
    main()
