"""The evaluation-only renderer: same tasks and answers as synth, other pictures, and never
imported by the training code."""

import ast
from pathlib import Path

import numpy as np
import pytest

from lab.toy import render_eval as R
from mminfer.offline import synthetic as synth

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("task", list(R.TASKS))
def test_tasks_are_synths_tasks_and_reproducible(task):
    a = R.make_example(task, 7, n_frames=12, height=96, width=160)
    b = R.make_example(task, 7, n_frames=12, height=96, width=160)
    assert a.question == synth.QUESTIONS[task] and a.answer in synth.ANSWERS[task]
    assert a.frames.shape == (12, 96, 160, 3) and a.frames.dtype == np.uint8
    assert np.array_equal(a.frames, b.frames)
    assert not np.array_equal(a.frames, R.make_example(task, 8, n_frames=12, height=96,
                                                       width=160).frames)


def test_count_flashes_are_the_only_red_frames():
    for seed in range(6):
        ex = R.count(seed, n_frames=20, height=64, width=96)
        assert synth.red_frames(ex.frames) == ex.meta["flash_frames"]
        assert len(ex.meta["flash_frames"]) == int(ex.answer)


def test_needle_shows_only_on_its_frames():
    ex = R.needle(3, n_frames=10, height=96, width=128)
    on = ex.meta["needle_frames"]
    x, y, w, h = ex.meta["box"]
    others = [i for i in range(10) if i not in on]
    assert on and others
    # the stamp is drawn in full contrast ink: its box differs strongly from a frame without it
    diff = [np.abs(ex.frames[i, y:y + h, x:x + w].astype(int)
                   - ex.frames[others[0], y:y + h, x:x + w].astype(int)).mean() for i in on]
    assert min(diff) > 10


def test_colour_ball_is_the_only_saturated_object():
    ex = R.colour(5, n_frames=6, height=96, width=128)
    f = ex.frames.astype(float)
    sat = f.max(-1) - f.min(-1)
    ball = synth.COLOURS[ex.answer]
    if max(ball) - min(ball) > 100:         # white has no saturation to find
        assert ((sat > 80).mean(axis=(1, 2)) > 0.01).all()


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_training_code_never_sees_it():
    for p in (ROOT / "lab" / "train" / "train_embedded.py", ROOT / "lab" / "toy" / "embedded.py",
              ROOT / "mminfer" / "offline" / "synthetic.py", ROOT / "lab" / "toy" / "variety.py"):
        assert not any("render_eval" in n for n in _imports(p)), p


def _sphere_whole_frame(frame, cx, cy, r, rgb, light):
    """The ball and its shadow computed over every pixel (the renderer computes a box)."""
    h, w, _ = frame.shape
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    sd = np.hypot((xx - cx - 0.25 * r) / 1.2, yy - cy - 0.9 * r) / r
    out = frame.astype(np.float32) * (1 - (np.clip(1 - sd, 0, 1) * 0.45)[..., None])
    dx, dy = (xx - cx) / r, (yy - cy) / r
    inside = dx * dx + dy * dy <= 1
    nz = np.sqrt(np.clip(1 - dx * dx - dy * dy, 0, 1))
    lam = np.clip(dx * light[0] + dy * light[1] + nz * light[2], 0, 1)
    ball = np.array(rgb, np.float32) * (0.55 + 0.45 * lam)[..., None] + \
        (np.clip(lam, 0, 1) ** 40 * 90)[..., None]
    out[inside] = ball[inside]
    return np.clip(out, 0, 255).astype(np.uint8)


def test_the_ball_drawn_in_its_box_is_the_whole_frame_ball():
    """The colour videos measured in lab/NOTES.md were drawn over whole frames; drawing only
    the box the ball and shadow touch must give the same pixels, edges and corners included."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w = int(rng.integers(32, 260)), int(rng.integers(32, 340))
        frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        r = rng.uniform(0.1, 0.17) * min(h, w)
        cx, cy = np.float64(rng.uniform(-r, w + r)), np.float64(rng.uniform(-r, h + r))
        light = np.array([rng.uniform(-0.6, 0.6), rng.uniform(-0.8, -0.2), 0.7])
        light /= np.linalg.norm(light)
        rgb = rng.uniform(0, 255, 3)
        want = _sphere_whole_frame(frame, cx, cy, r, rgb, light)
        assert np.array_equal(R._sphere(frame, cx, cy, r, rgb, light), want)   # noqa: SLF001
