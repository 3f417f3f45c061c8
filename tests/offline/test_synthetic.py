import time

import numpy as np
import pytest

from mminfer.offline import synthetic as synth
from mminfer.video import decode, probe

SEEDS = range(12)


@pytest.mark.parametrize("task", list(synth.TASKS))
def test_deterministic_by_seed(task):
    a = synth.make_example(task, 7, n_frames=12, height=64, width=80)
    b = synth.make_example(task, 7, n_frames=12, height=64, width=80)
    c = synth.make_example(task, 8, n_frames=12, height=64, width=80)
    assert a.frames.shape == (12, 64, 80, 3) and a.frames.dtype == np.uint8
    assert np.array_equal(a.frames, b.frames)
    assert (a.question, a.answer, a.meta) == (b.question, b.answer, b.meta)
    assert not np.array_equal(a.frames, c.frames)


@pytest.mark.parametrize("task", list(synth.TASKS))
def test_answers_and_questions_in_vocab(task):
    answers = set()
    for seed in range(40):
        ex = synth.make_example(task, seed, n_frames=20, height=32, width=32)
        assert ex.task == task and ex.question == synth.QUESTIONS[task]
        assert ex.answer in synth.ANSWERS[task] and ex.answer in synth.ANSWER_VOCAB
        answers.add(ex.answer)
    assert len(answers) > 3  # answers vary with the seed
    for w in synth.QUESTIONS[task].lower().replace("?", " ?").split():
        assert w in synth.ANSWER_VOCAB
    assert len(set(synth.ANSWER_VOCAB)) == len(synth.ANSWER_VOCAB)


def _box_diff(a, b, box):
    x0, y0, x1, y1 = box
    return float(np.abs(a[y0:y1, x0:x1].astype(int) - b[y0:y1, x0:x1]).mean())


@pytest.mark.parametrize("size", [56, 224])
def test_needle_frames_show_the_text(size):
    for seed in SEEDS:
        ex = synth.needle(seed, n_frames=16, height=size, width=size)
        idx = ex.meta["needle_frames"]
        assert ex.answer == str(ex.meta["number"]) and 10 <= ex.meta["number"] <= 99
        assert 1 <= len(idx) <= 2 and idx == list(range(idx[0], idx[0] + len(idx)))
        others = [i for i in range(16) if i not in idx]
        ref = min(others, key=lambda i: abs(i - idx[0]))  # nearest frame without the number
        diffs = [_box_diff(ex.frames[i], ex.frames[ref], ex.meta["box"]) for i in idx]
        assert min(diffs) > 15, (seed, diffs)  # over 300 seeds the least was 26
        # large enough to read at low resolution
        assert ex.meta["text_height"] >= 0.28 * size


def test_needle_options_are_honoured():
    first = synth.needle(3, n_frames=10, number=42, depth=0.0, needle_frames=1)
    last = synth.needle(3, n_frames=10, number=42, depth=1.0, needle_frames=2)
    assert first.answer == "42" and first.meta["needle_frames"] == [0]
    assert last.meta["needle_frames"] == [8, 9]
    with pytest.raises(ValueError):
        synth.needle(0, number=7)


def test_order_two_needles_first_is_the_answer():
    for seed in SEEDS:
        ex = synth.order(seed, n_frames=12, height=48, width=48)
        (a, b), (s1, s2) = ex.meta["numbers"], ex.meta["needle_frames"]
        assert a != b and ex.answer == str(a)
        assert s1[-1] + 1 < s2[0]  # a frame without a number between them
        for span, box in zip((s1, s2), ex.meta["boxes"]):
            gap = [i for i in range(12) if i not in s1 + s2][0]
            assert _box_diff(ex.frames[span[0]], ex.frames[gap], box) > 10


def test_count_has_exactly_n_red_frames():
    seen = set()
    for seed in range(30):
        ex = synth.count(seed, n_frames=20, height=40, width=40)
        flashes = ex.meta["flash_frames"]
        assert synth.red_frames(ex.frames) == flashes
        assert ex.answer == str(len(flashes)) and 1 <= len(flashes) <= 9
        assert all(b - a >= 2 for a, b in zip(flashes, flashes[1:]))  # never two in a row
        seen.add(len(flashes))
    assert len(seen) >= 5
    ex = synth.count(0, n_frames=17, height=32, width=32, count=9)  # the densest it allows
    assert synth.red_frames(ex.frames) == list(range(0, 17, 2))
    with pytest.raises(ValueError):
        synth.count(0, n_frames=10, count=9)


@pytest.mark.parametrize("task", ["needle", "colour", "order"])
def test_no_red_flashes_outside_count(task):
    for seed in range(25):
        ex = synth.make_example(task, seed, n_frames=10, height=32, width=32)
        assert synth.red_frames(ex.frames) == []


def test_colour_ball_visible_in_every_frame():
    names = set()
    for seed in range(24):
        ex = synth.colour(seed, n_frames=10, height=56, width=56)
        names.add(ex.answer)
        rgb = np.array(ex.meta["rgb"])
        near = (np.abs(ex.frames.astype(int) - rgb).max(axis=-1) < 20).sum(axis=(1, 2))
        area = np.pi * ex.meta["radius"] ** 2
        assert near.min() > 0.5 * area, (seed, ex.answer, near.min(), area)
        assert ex.meta["radius"] >= 0.09 * 56
    assert names == set(synth.COLOURS)


def test_generation_is_fast():
    for task in synth.TASKS:
        t = time.perf_counter()
        synth.make_example(task, 1, n_frames=20, height=224, width=224)
        assert time.perf_counter() - t < 1.0


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task"):
        synth.make_example("dance", 0)


def test_mp4_round_trip(tmp_path):
    ex = synth.count(5, n_frames=20, height=64, width=64)
    path = tmp_path / "count.mp4"
    synth.write_mp4(ex.frames, path, fps=2.0)
    info = probe(path)
    assert (info.frames, info.fps, info.width, info.height) == (20, 2.0, 64, 64)
    assert info.codec == "h264"
    v = decode(path)  # Qwen sampling at 2 fps keeps every frame of a 2 fps video
    assert len(v.frames) == 20 and v.indices.tolist() == list(range(20))
    assert np.abs(v.frames.astype(int) - ex.frames).mean() < 8
    assert synth.red_frames(v.frames) == ex.meta["flash_frames"]
    odd = tmp_path / "odd.mp4"
    synth.write_mp4(ex.frames[:3, :63, :61], odd, fps=4)
    assert (probe(odd).frames, probe(odd).width, probe(odd).height) == (3, 62, 64)
