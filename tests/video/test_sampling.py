"""The frame-sampling rules, on exact index lists: Qwen2.5-VL's against qwen-vl-utils 0.0.14
transcribed, and VILA's inference rule (round(linspace), not the training code's
truncation) for LongVILA."""
import math

import numpy as np
import pytest

from mminfer.video import sample_indices, vila_indices


# --------------------------------------------------------- reference: qwen-vl-utils 0.0.14

def qwen_reference(total, video_fps, fps=2.0, start=None, end=None, nframes=None):
    """calculate_video_frame_range + smart_nframes + torch.linspace(...).round(), transcribed
    from qwen-vl-utils 0.0.14 (vision_process.py, decord reader) with the default ele."""
    import torch

    if start is None and end is None:
        s, e, total = 0, total - 1, total
    else:
        max_duration = total / video_fps
        s = math.ceil(max(0.0, min(start, max_duration)) * video_fps) if start is not None else 0
        if end is not None:
            e = min(math.floor(max(0.0, min(end, max_duration)) * video_fps), total - 1)
        else:
            e = total - 1
        assert s < e
        total = e - s + 1
    if nframes is not None:
        n = round(nframes / 2) * 2
    else:
        min_frames = math.ceil(4 / 2) * 2
        max_frames = math.floor(min(768, total) / 2) * 2
        n = total / video_fps * fps
        n = min(min(max(n, min_frames), max_frames), total)
        n = math.floor(n / 2) * 2
    assert 2 <= n <= total
    return torch.linspace(s, e, n).round().long().numpy()


@pytest.mark.parametrize("video_fps", [10, 24, 30000 / 1001, 30, 60])
def test_qwen_rule_matches_reference(video_fps):
    for total in [2, 3, 5, 9, 30, 61, 299, 1801, 7201, 54000, 216000]:
        for fps in [0.5, 1.0, 2.0, 4.0]:
            ours = sample_indices(total, video_fps, fps=fps)
            ref = qwen_reference(total, video_fps, fps=fps)
            assert np.array_equal(ours, ref), (total, video_fps, fps)
            assert len(ours) % 2 == 0 and len(ours) <= 768


def test_qwen_rule_windows_and_num_frames():
    for total, vfps, start, end in [(300, 30, 1.0, 4.0), (300, 30, None, 2.5),
                                    (300, 30, 7.3, None), (54000, 29.97, 600.0, 1500.5),
                                    (61, 24, 0.0, 100.0)]:
        assert np.array_equal(sample_indices(total, vfps, start=start, end=end),
                              qwen_reference(total, vfps, start=start, end=end))
    for n in [3, 5, 7, 16, 33]:
        assert np.array_equal(sample_indices(1000, 30, num_frames=n),
                              qwen_reference(1000, 30, nframes=n))
    # the long-video cap and the short-video floor
    assert len(sample_indices(3600 * 30, 30)) == 768
    assert len(sample_indices(20, 30)) == 4


def test_qwen_rule_small_videos_keep_a_temporal_pair():
    # qwen-vl-utils raises below 2 frames; we return one temporal pair instead.
    assert sample_indices(1, 25).tolist() == [0, 0]
    assert sample_indices(3, 25).tolist() == [0, 2]
    assert len(sample_indices(10, 25, num_frames=64)) == 10  # capped at what exists


def test_uniform_rule_is_longvila():
    # VILA's inference rule: round(linspace), halves to even (7.25 -> 7, 14.5 -> 14, 21.75 -> 22)
    assert sample_indices(30, 10, sampling="uniform", num_frames=5).tolist() == [0, 7, 14, 22, 29]
    assert sample_indices(1000, 30, sampling="uniform", num_frames=8).tolist() == [
        0, 143, 285, 428, 571, 714, 856, 999]
    # an explicit count is honoured even on a shorter video (frames repeat), as VILA does
    assert sample_indices(3, 10, sampling="uniform", num_frames=6).tolist() == [0, 0, 1, 1, 2, 2]
    # without num_frames: fps * duration within [min_frames, max_frames]
    assert len(sample_indices(600, 30, sampling="uniform", fps=1.0)) == 20
    assert len(sample_indices(600, 30, sampling="uniform", fps=1.0, max_frames=8)) == 8


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


@pytest.mark.parametrize("total,n", [(97, 13), (4096, 256), (50, 50)])
def test_decoder_and_adapter_share_the_rule(total, n):
    assert np.array_equal(sample_indices(total, 25, sampling="uniform", num_frames=n),
                          vila_indices(0, total - 1, n))
