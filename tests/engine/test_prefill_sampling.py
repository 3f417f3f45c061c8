"""LongVILA's frames: VILA's inference rule (round(linspace), not the training code's
truncation) on exact index lists, and sampled once on the way through the pipeline."""

import numpy as np
import pytest

from mminfer.engine.video import sample_indices
from mminfer.models.sampling import vila_indices


def test_vila_rule_on_exact_lists():
    assert vila_indices(0, 11, 8).tolist() == [0, 2, 3, 5, 6, 8, 9, 11]
    assert vila_indices(0, 10, 4).tolist() == [0, 3, 7, 10]        # truncation: [0, 3, 6, 10]
    assert vila_indices(0, 5, 3).tolist() == [0, 2, 5]             # 2.5: half to even
    assert vila_indices(0, 2, 6).tolist() == [0, 0, 1, 1, 2, 2]    # fewer frames: repeats
    assert vila_indices(10, 20, 3).tolist() == [10, 15, 20]        # a window's own range
    assert vila_indices(0, 7, 1).tolist() == [0]


def test_vila_rule_where_truncation_differs():
    """1000 frames -> 256 samples: the rule VILA serves with, which truncation misses in 126
    places (the first at sample 1: 3.918 -> 4, truncated 3)."""
    got = sample_indices(1000, 30, sampling="uniform", num_frames=256)
    exact = np.linspace(0, 999, 256)
    assert got.tolist() == [int(round(x)) for x in exact]   # no half-way cases in this list
    assert got[:6].tolist() == [0, 4, 8, 12, 16, 20]
    assert int((got != exact.astype(int)).sum()) == 126


def test_longvila_frames_are_sampled_once(tmp_path, make_video):
    """The pipeline decodes exactly the model's frame count by VILA's rule; the adapter gets
    those frames and samples nothing again (before: 2 fps first, then 12 -> 8 on top)."""
    from mminfer.engine.pipeline import Pipeline
    from lab.toy.tiny_longvila import save_tiny_longvila
    ckpt = save_tiny_longvila(tmp_path / "tiny-longvila", num_video_frames=8)
    pipe = Pipeline(str(ckpt), attention="dense", device="cpu")
    video = make_video(n_frames=60, fps=10.0)                 # 6 s: fps 2 would give 12 frames
    seen = []
    real_prepare = pipe.adapter.prepare

    def prepare(decoded, question, options=None):
        # the pipeline streams frames (decoded while the tower works): the stream's source
        # indices are what it will decode (stream == decode() is pinned in test_video.py)
        seen.append([int(i) for i in decoded.indices])
        return real_prepare(decoded, question, options)

    pipe.adapter.prepare = prepare
    res = pipe.answer(video, "what?", fps=2.0, max_new_tokens=1)
    assert seen == [vila_indices(0, 59, 8).tolist()]          # [0, 8, 17, 25, 34, 42, 51, 59]
    assert res.video["frames"] == res.video["model_frames"] == 8
    # a short clip under the model's count: the user's fps decides, still one sampling
    seen.clear()
    res = pipe.answer(make_video("short.mp4", n_frames=30, fps=10.0), "what?", fps=2.0,
                      max_new_tokens=1)
    assert seen == [vila_indices(0, 29, 6).tolist()] and res.video["model_frames"] == 6


@pytest.mark.parametrize("total,n", [(97, 13), (4096, 256), (50, 50)])
def test_decoder_and_adapter_share_the_rule(total, n):
    assert np.array_equal(sample_indices(total, 25, sampling="uniform", num_frames=n),
                          vila_indices(0, total - 1, n))
