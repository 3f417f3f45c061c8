"""The randomised training renderer: reproducible, every family reachable, the answer drawn,
the task rules kept (nothing red but flashes, the ball the only saturated thing), and the
frame sizes the adapter's own resize rule gives."""

import numpy as np
import pytest

from mminfer.offline import synthetic as synth
from lab.toy import variety as V


def _rng(seed):
    return np.random.default_rng([77, seed])


def _reddish(frames):
    f = np.asarray(frames).astype(int)
    return (f[..., 0] > f[..., 1] + 60) & (f[..., 0] > f[..., 2] + 60) & (f[..., 0] > 90)


def test_pick_size_follows_the_adapters_rule_and_reaches_every_size():
    rng = _rng(0)
    seen = set()
    for _ in range(400):
        h, w, c = V.pick_size(rng)
        assert V.smart_size(h, w) == V.SIZES[c]
        assert max(V.SIZES[c]) <= V.SLOT
        seen.add(c)
    assert seen == set(range(len(V.SIZES)))
    for c in range(len(V.SIZES)):           # a size can be asked for
        assert V.pick_size(rng, c)[2] == c


def test_scene_is_reproducible_per_seed_and_differs_across_seeds():
    a, bg_a, da = V.scene(_rng(1), 4, 90, 120)
    b, bg_b, _ = V.scene(_rng(1), 4, 90, 120)
    c, _, _ = V.scene(_rng(2), 4, 90, 120)
    assert a.shape == (4, 90, 120, 3) and a.dtype == np.uint8
    assert bg_a.shape == (90, 120, 3) and bg_a.dtype == np.float32
    assert np.array_equal(a, b) and np.array_equal(bg_a, bg_b)
    assert not np.array_equal(a, c)
    cam1, cam2 = V.Camera(_rng(3), 90, 120), V.Camera(_rng(3), 90, 120)
    assert np.array_equal(cam1(a), cam2(a))


def test_every_family_is_reachable():
    rng = _rng(4)
    bgs = {V.background(rng, 24, 32, neutral=bool(i % 2))[1] for i in range(200)}
    assert bgs == set(V.BACKGROUNDS)
    paths = {V.path(rng, 6, 40, 50, 5.0)[2] for _ in range(200)}
    assert paths == set(V.PATHS)
    shapes = set()
    for _ in range(60):
        shapes |= {s["kind"] for s in V.Shapes(rng, 3, 40, 50, neutral=False,
                                               bg_value=0.5).items}
    assert shapes == set(V.SHAPES)
    fonts, fx, inks = set(), set(), set()
    bg = np.full((60, 80, 3), 90, np.float32)
    for _ in range(300):
        _, _, d = V.number_stamp(rng, "47", 60, 80, bg)
        fonts.add(d["font"])
        fx.update(d["fx"])
        inks.add(d["ink"])
    assert fonts == set(V.FONTS) and fx == set(V.GLYPH_FX) and inks == set(V.INKS)
    under = np.full((20, 30, 3), 120, np.float32)
    assert {V.red_flash(rng, 20, 30, under)[1] for _ in range(100)} == set(V.FLASHES)
    balls = set()
    for _ in range(60):
        balls.add(V.ball_clip(rng, np.zeros((1, 30, 30, 3), np.uint8), (30, 185, 45))["ball"])
    assert balls == set(V.BALLS)
    assert {V.Camera(rng, 8, 8).codec for _ in range(200)} == set(V.CODECS)
    assert len(V.atlas()) >= 70         # the bundled glyph atlas loads (Liberation + 59 faces)


def test_backgrounds_of_different_kinds_differ():
    imgs = {k: V.background(_rng(5), 32, 48, kind=k)[0] for k in V.BACKGROUNDS}
    ks = list(imgs)
    for i, a in enumerate(ks):
        for b in ks[i + 1:]:
            assert np.abs(imgs[a] - imgs[b]).mean() > 1.0, (a, b)


@pytest.mark.parametrize("seed", range(12))
def test_the_number_is_drawn_inside_its_box_only(seed):
    rng = _rng(100 + seed)
    h, w, _ = V.pick_size(rng)
    frames, bg, _ = V.scene(rng, 2, h, w)
    paint, (x0, y0, x1, y1), desc = V.number_stamp(rng, str(10 + seed * 7), h, w, bg)
    on = paint(frames[0], 0).astype(int)
    plain = frames[0].astype(int)
    diff = np.abs(on - plain).sum(-1)
    assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
    # the ink: a clear difference inside the box
    assert diff[y0:y1, x0:x1].mean() > 15, desc
    # and none outside it (a plate reaches a few pixels beyond; a run's drift 3 px a frame)
    pad = max(2, int(0.06 * (y1 - y0))) + 1
    outside = np.ones((h, w), bool)
    outside[max(0, y0 - pad):y1 + pad, max(0, x0 - pad):x1 + pad] = False
    assert diff[outside].max() == 0


def test_scenes_are_never_red_and_flashes_always_are():
    for seed in range(25):
        rng = _rng(200 + seed)
        h, w, _ = V.pick_size(rng)
        frames, _, _ = V.scene(rng, 3, h, w)
        frames = V.Camera(rng, h, w)(frames)
        assert synth.red_frames(frames) == []
        assert (_reddish(frames).mean(axis=(1, 2)) < 0.5).all()
        flash, kind = V.red_flash(rng, h, w, frames[0])
        assert synth.red_frames(flash[None].astype(np.uint8)) == [0], kind
        lit = V.Camera(rng, h, w, mild_colour=True)(flash[None].astype(np.uint8))
        assert _reddish(lit).mean() > 0.8, kind


def test_in_the_colour_scene_the_ball_is_the_only_saturated_object():
    for seed in range(10):
        rng = _rng(300 + seed)
        frames, _, _ = V.scene(rng, 3, 80, 100, neutral=True, allow_ellipse=False)
        f = frames.astype(int)
        assert (f.max(-1) - f.min(-1)).max() < 60
        V.ball_clip(rng, frames, synth.COLOURS["blue"])
        f = frames.astype(int)
        assert ((f.max(-1) - f.min(-1)) > 80).mean(axis=(1, 2)).min() > 0.01


def test_glyph_transforms_keep_the_ink():
    rng = _rng(6)
    for _ in range(40):
        m, font = V.glyphs(rng, "58", 40)
        assert m.dtype == np.float32 and m.ndim == 2 and 30 <= m.shape[0] <= 60
        assert m.max() > 0.5, font
        out, fx = V.glyph_fx(rng, m)
        assert out.ndim == 2 and out.max() > 0.3, fx


def test_resize_to_is_the_adapters_resize():
    import torch
    from mminfer.models.qwen2_5_vl import resize_frames
    rng = _rng(7)
    f = rng.integers(0, 256, (3, 150, 200, 3), dtype=np.uint8)
    got = V.resize_to(f, 84, 112)
    want = resize_frames(torch.from_numpy(f), 84, 112).permute(0, 2, 3, 1).to(torch.uint8)
    assert got.shape == (3, 84, 112, 3) and np.array_equal(got, want.numpy())
    slot = V.to_slot(got)
    assert slot.shape == (3, V.SLOT, V.SLOT, 3) and np.array_equal(slot[:, :84, :112], got)
    assert not slot[:, 84:].any() and not slot[:, :, 112:].any()


def test_glyph_fx_never_returns_an_unreadable_or_empty_glyph():
    """On the H200, a thin glyph thinned further lost its ink and the shear after it crashed
    a bank worker (zero-size crop; seed 278 here); now the chain stops, and a glyph that lost
    most of its ink comes back plain (117 of 3000 seeds came back nearly blank before)."""
    import numpy as np
    from lab.toy import variety as V
    mask = np.zeros((32, 64), np.float32)
    mask[2:30, 5:7] = 1.0
    mask[2:30, 32:34] = 1.0
    for seed in range(600):
        out, applied = V.glyph_fx(np.random.default_rng(seed), mask)
        assert (out > 0.05).sum() >= 0.2 * (mask > 0.05).sum(), (seed, applied)


def test_busy_backgrounds_have_sharp_edges_and_smooth_ones_do_not():
    """The point of the busy kinds: many strong pixel-to-pixel steps (clutter a number must be
    found on), where the gradients and smooth noise have almost none."""
    def steps(img):
        g = np.abs(np.diff(img.mean(-1), axis=1))
        return float((g > 12).mean())

    for seed in range(6):
        for k in ("cells", "bricks", "posterized", "scribbles", "mosaic"):
            assert steps(V.background(_rng(300 + seed), 112, 112, kind=k)[0]) > 0.01, (k, seed)
        for k in ("flat", "linear", "radial", "noise"):
            assert steps(V.background(_rng(300 + seed), 112, 112, kind=k)[0]) < 0.002, (k, seed)


def test_led_cells_are_off_by_default_and_separate_blobs_when_on():
    """``--led`` is an experiment: off, glyph_fx draws exactly what it drew before (no random
    draw is spent); on, a glyph comes back as separate cells on a coarse grid."""
    def blobs(a):                       # 4-connected components of the ink
        ink, seen, n = a > 0.5, np.zeros(a.shape, bool), 0
        for start in zip(*np.nonzero(ink)):
            if seen[start]:
                continue
            n, stack = n + 1, [start]
            seen[start] = True
            while stack:
                y, x = stack.pop()
                for v, u in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= v < a.shape[0] and 0 <= u < a.shape[1] and ink[v, u] \
                            and not seen[v, u]:
                        seen[v, u] = True
                        stack.append((v, u))
        return n
    class Calls:                        # a generator that records which draws are made
        def __init__(self, seed):
            self.g, self.names = _rng(seed), []

        def __getattr__(self, name):
            self.names.append(name)
            return getattr(self.g, name)

    m, _ = V.glyphs(_rng(11), "47", 48, font="synth")
    assert V.LED_SHARE == 0.0
    off = Calls(12)
    _, fx_a = V.glyph_fx(off, m)
    try:
        V.use_led(1.0)
        on = Calls(12)
        _, fx_b = V.glyph_fx(on, m)
    finally:
        V.use_led(0.0)
    # off, the first draw is the transform count, as before --led existed; on, the LED coin
    assert "led" not in fx_a and off.names[0] == "choice"
    assert fx_b[0] == "led" and on.names[:2] == ["random", "integers"]
    cells = V.led(_rng(13), m)
    assert blobs(cells) >= max(12, 4 * blobs(m)) and cells.max() == 1.0
    with pytest.raises(ValueError):
        V.use_led(1.5)
