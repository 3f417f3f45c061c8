"""Which frames of a video a model sees (numpy only: the decoder and the adapters both use it).

Two samplers:
  * ``qwen``: qwen-vl-utils 0.0.14 (``smart_nframes`` + ``torch.linspace(s, e, n).round()``),
    what Qwen2.5-VL was trained with.
  * ``uniform``: LongVILA / VILA (``round(linspace(0, total - 1, n))``, as VILA's inference
    code: :func:`vila_indices`).

A variable-frame-rate video is sampled by presentation time instead of frame number. Bad
arguments raise ``VideoError`` with a message that says which one and why.
"""
from __future__ import annotations

import math

import numpy as np

from mminfer.errors import VideoError

FRAME_FACTOR = 2  # Qwen2.5-VL merges frames in temporal pairs
SAMPLINGS = ("qwen", "uniform")


def vila_indices(first: int, last: int, n: int) -> np.ndarray:
    """``n`` source frames in [first, last] as VILA's inference code picks them
    (``llava/utils/media.py::_load_video``): ``round(linspace(first, last, n))``, numpy's
    round (halves to even). Training code truncates instead; served checkpoints see these.
    ``n`` beyond the frames there repeats frames, as VILA's loader does."""
    return np.round(np.linspace(first, last, n)).astype(np.int64)


def _floor2(x: float) -> int:
    return math.floor(x / FRAME_FACTOR) * FRAME_FACTOR


def _ceil2(x: float) -> int:
    return math.ceil(x / FRAME_FACTOR) * FRAME_FACTOR


def _round2(x: float) -> int:
    return round(x / FRAME_FACTOR) * FRAME_FACTOR  # Python round: half to even, like qwen


def _torch_linspace_round(start: int, end: int, n: int) -> np.ndarray:
    """``torch.linspace(start, end, n).round()`` bit for bit, without importing torch.

    torch computes in float32, the first half as start + step*i and the second half as
    end - step*(n-1-i), with a fused multiply-add on CPU; float64 numpy.linspace rounds
    differently at .5 ties for long videos, which would shift frames by one.
    """
    a, b = np.float32(start), np.float32(end)
    if n == 1:
        return np.array([round(float(a))], dtype=np.int64)
    step = np.float32((b - a) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    lo = (np.float64(a) + np.float64(step) * i).astype(np.float32)  # fma: one rounding
    hi = (np.float64(b) - np.float64(step) * (n - 1 - i)).astype(np.float32)
    vals = np.where(np.arange(n) < n // 2, lo, hi)
    return np.round(vals).astype(np.int64)


def frame_range(total: int, video_fps: float, start: float | None = None,
                end: float | None = None) -> tuple[int, int]:
    """Inclusive [first, last] source frames of the window [start, end) in seconds, as
    qwen-vl-utils' ``calculate_video_frame_range`` computes them."""
    if start is None and end is None:
        return 0, total - 1
    duration = total / video_fps
    first = math.ceil(max(0.0, min(start, duration)) * video_fps) if start is not None else 0
    last = total - 1
    if end is not None:
        last = min(math.floor(max(0.0, min(end, duration)) * video_fps), total - 1)
    if first >= last:
        raise VideoError(
            f"the time window start={start} end={end} selects fewer than 2 frames of a "
            f"{duration:.2f} s video", start=start, end=end, duration=duration)
    return first, last


def qwen_nframes(total: int, video_fps: float, *, fps: float = 2.0, min_frames: int = 4,
                 max_frames: int = 768, num_frames: int | None = None) -> int:
    """qwen-vl-utils ``smart_nframes`` for ``total`` frames at ``video_fps``.

    Where qwen-vl-utils would raise (fewer than 2 frames available, or ``num_frames`` over
    the total) this clamps to what the video holds, with a floor of 2 (one temporal pair:
    a 1-frame video gives its frame twice, as the HF processor's padding would)."""
    if num_frames is not None:
        n = _round2(num_frames)
        n = min(n, _floor2(total))
    else:
        lo = _ceil2(min_frames)
        hi = _floor2(min(max_frames, total))
        n = total / video_fps * fps
        n = _floor2(min(min(max(n, lo), hi), total))
    return max(n, FRAME_FACTOR)


def sample_indices(total: int, video_fps: float, *, sampling: str = "qwen", fps: float = 2.0,
                   max_frames: int = 768, min_frames: int = 4, num_frames: int | None = None,
                   start: float | None = None, end: float | None = None,
                   timestamps=None) -> np.ndarray:
    """Source frame indices to decode for a video of ``total`` frames at ``video_fps``.

    ``timestamps`` (every frame's presentation time, seconds from the first): when they do
    not follow ``video_fps`` (a variable-frame-rate video), samples are picked by time
    instead of by frame number (:func:`is_variable_rate`)."""
    return sample_frames(total, video_fps, timestamps, sampling=sampling, fps=fps,
                         max_frames=max_frames, min_frames=min_frames, num_frames=num_frames,
                         start=start, end=end)[0]


def is_variable_rate(pts, video_fps: float) -> bool:
    """Do the frames' timestamps ``pts`` (seconds from the first) stray from frame i at
    ``i / video_fps`` by more than two frames and 2 % of the duration? Then the container's
    rate says little about time (a screen recording, a phone's variable rate, a Matroska
    file whose rate is a guess) and sampling goes by the timestamps."""
    if pts is None or len(pts) < 2:
        return False
    pts = np.asarray(pts, dtype=np.float64)
    if not (video_fps > 0 and math.isfinite(video_fps)):
        return True
    dev = np.abs(pts - np.arange(len(pts)) / video_fps).max()
    return bool(dev > max(2.0 / video_fps, 0.02 * len(pts) / video_fps))


def timing(facts) -> tuple[float, float, bool]:
    """(frame rate, duration s, variable?) of a video's facts: the container's rate and
    frames / rate, or, at a variable rate, the span of the timestamps and its mean rate."""
    total, vfps, pts = facts["total"], facts["fps"], facts.get("pts")
    if not is_variable_rate(pts, vfps):
        return vfps, total / vfps, False
    # the last frame is shown for one frame interval: the shortest one seen (the
    # container's mean rate says nothing about it here)
    steps = np.diff(pts)
    steps = steps[steps > 0]
    last = float(steps.min()) if len(steps) else 0.0
    if vfps > 0 and math.isfinite(vfps):
        last = min(last, 1.0 / vfps)
    duration = float(pts[-1] - pts[0]) + last
    return total / duration if duration > 0 else vfps, duration, True


def nearest(sorted_times, t) -> np.ndarray:
    """Index of the nearest of ``sorted_times`` to each of ``t``."""
    times = np.maximum.accumulate(np.asarray(sorted_times, dtype=np.float64))
    j = np.clip(np.searchsorted(times, t), 1, max(len(times) - 1, 1))
    if len(times) == 1:
        return np.zeros(len(t), dtype=np.int64)
    left = np.abs(t - times[j - 1]) <= np.abs(times[j] - t)
    return np.where(left, j - 1, j).astype(np.int64)


def sample_frames(total, video_fps, pts, *, sampling, fps, max_frames, min_frames,
                  num_frames, start, end) -> tuple[np.ndarray, float]:
    """(source frame indices, sampled fps) of a video: by frame number at a constant rate
    (the models' own rules, bit for bit), by presentation time at a variable one."""
    check_args(sampling, fps, max_frames, min_frames, num_frames, start, end)
    if total < 1:
        raise VideoError("the video contains no frames")
    if is_variable_rate(pts, video_fps):
        return _time_sampling(np.asarray(pts, dtype=np.float64)[:total], video_fps,
                              sampling=sampling, fps=fps, max_frames=max_frames,
                              min_frames=min_frames, num_frames=num_frames, start=start,
                              end=end)
    first, last = frame_range(total, video_fps, start, end)
    window = last - first + 1
    if sampling == "qwen":
        n = qwen_nframes(window, video_fps, fps=fps, min_frames=min_frames,
                         max_frames=max_frames, num_frames=num_frames)
        idx = _torch_linspace_round(first, last, n)
    else:
        # uniform (LongVILA): an explicit num_frames is honoured even beyond the window
        # (frames repeat), as VILA's loader does; otherwise fps·duration within the limits.
        if num_frames is None:
            num_frames = min(max(math.floor(window / video_fps * fps), min_frames),
                             max_frames, window)
        idx = vila_indices(first, last, max(num_frames, 1))
    return idx, len(idx) / window * video_fps


def _time_sampling(pts, video_fps, *, sampling, fps, max_frames, min_frames, num_frames,
                   start, end) -> tuple[np.ndarray, float]:
    """A variable-frame-rate video: as many samples as the same rule takes of a video of
    this duration and frame count, at evenly spaced times, each the frame shown then."""
    fps_, duration, _ = timing({"total": len(pts), "fps": video_fps, "pts": pts})
    t0 = 0.0 if start is None else min(float(start), duration)
    t1 = duration if end is None else min(float(end), duration)
    inside = np.flatnonzero((pts >= t0 - 1e-9) & (pts < t1 + 1e-9))
    if (start is not None or end is not None) and len(inside) < 2:
        raise VideoError(
            f"the time window start={start} end={end} selects fewer than 2 frames of a "
            f"{duration:.2f} s video", start=start, end=end, duration=duration)
    if len(inside) == 0:
        inside = np.arange(len(pts))
    window, span = len(inside), max(t1 - t0, 1e-9)
    if sampling == "qwen":
        n = qwen_nframes(window, window / span, fps=fps, min_frames=min_frames,
                         max_frames=max_frames, num_frames=num_frames)
    else:
        n = num_frames if num_frames is not None else \
            min(max(math.floor(span * fps), min_frames), max_frames, window)
        n = max(n, 1)
    times = np.linspace(pts[inside[0]], pts[inside[-1]], n)
    idx = inside[nearest(pts[inside], times)]
    return idx.astype(np.int64), n / span


def check_args(sampling, fps, max_frames, min_frames, num_frames, start, end) -> None:
    def bad(msg, **kw):
        raise VideoError(msg, **kw)

    if sampling not in SAMPLINGS:
        bad(f"unknown sampling {sampling!r}; use one of {', '.join(SAMPLINGS)}")
    if not _is_real(fps) or not math.isfinite(fps) or fps <= 0:
        bad(f"fps must be a positive finite number, got {fps!r}", fps=repr(fps))
    for name, v in (("max_frames", max_frames), ("min_frames", min_frames)):
        if not _is_int(v) or v < 1:
            bad(f"{name} must be an integer >= 1, got {v!r}", **{name: repr(v)})
    if num_frames is not None and (not _is_int(num_frames) or num_frames < 1):
        bad(f"num_frames must be an integer >= 1, got {num_frames!r}")
    for name, v in (("start", start), ("end", end)):
        if v is not None and (not _is_real(v) or not math.isfinite(v) or v < 0):
            bad(f"{name} must be a finite number of seconds >= 0, got {v!r}")
    if start is not None and end is not None and start >= end:
        bad(f"start ({start} s) must be before end ({end} s)", start=start, end=end)


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

