"""Video decoding and frame sampling.

decord is the first backend (fast random access with ``get_batch``); PyAV is the fallback
when decord is missing or cannot read the file. Only the sampled frames are converted to
RGB, and neither backend decodes the whole file when the samples are sparse (decord seeks
per batch; the PyAV reader seeks when the next sample is far ahead).

Two samplers:
  * ``qwen``: qwen-vl-utils 0.0.14 (``smart_nframes`` + ``torch.linspace(s, e, n).round()``),
    what Qwen2.5-VL was trained with.
  * ``uniform``: LongVILA / VILA (``round(linspace(0, total - 1, n))``, as VILA's inference
    code: mminfer.models.sampling.vila_indices).

Every failure a user can cause comes out as ``VideoError`` with a message that says what is
wrong with the file or the arguments; backend exceptions never reach the caller.
"""
from __future__ import annotations

import ctypes
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mminfer.errors import VideoError
from mminfer.models.sampling import vila_indices

FRAME_FACTOR = 2  # Qwen2.5-VL merges frames in temporal pairs
BACKENDS = ("decord", "pyav")
SAMPLINGS = ("qwen", "uniform")


@dataclass(frozen=True)
class VideoInfo:
    path: str
    frames: int
    fps: float
    duration: float  # seconds, frames / fps (variable frame rate: from the timestamps)
    width: int       # as displayed (after the display matrix's rotation)
    height: int
    codec: str
    backend: str
    # every frame's presentation time, seconds from the first (None: not known)
    timestamps: np.ndarray | None = field(default=None, repr=False, compare=False)


@dataclass
class DecodedVideo:
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    timestamps: np.ndarray  # [T] float64, presentation time of each sampled frame, seconds
    indices: np.ndarray  # [T] int64, source frame index of each sampled frame
    fps: float  # source frame rate
    sampled_fps: float  # T / (frames in the window) * fps, as qwen-vl-utils reports it
    duration: float  # source duration, seconds
    width: int
    height: int
    backend: str

    @classmethod
    def from_frames(cls, frames, fps: float = 2.0, backend: str = "synth") -> "DecodedVideo":
        """Rendered frames ``[T, H, W, 3]`` as a video sampled at ``fps`` (every frame kept):
        the synthetic and rendered videos of calibration and the benchmarks, no decoder."""
        frames = np.asarray(frames)
        T = len(frames)
        return cls(frames=frames, timestamps=np.arange(T) / fps, indices=np.arange(T), fps=fps,
                   sampled_fps=fps, duration=T / fps, width=frames.shape[2],
                   height=frames.shape[1], backend=backend)

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    def processor_metadata(self) -> dict:
        # Without this the HF Qwen2-VL video processor assumes 24 fps and the temporal
        # M-RoPE positions collapse (research/models.md §2.1).
        return {"fps": self.sampled_fps, "total_num_frames": self.num_frames,
                "frames_indices": list(range(self.num_frames))}


# ---------------------------------------------------------------------------- sampling

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
    return _sampling(total, video_fps, timestamps, sampling=sampling, fps=fps,
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


def _timing(facts) -> tuple[float, float, bool]:
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


def _nearest(sorted_times, t) -> np.ndarray:
    """Index of the nearest of ``sorted_times`` to each of ``t``."""
    times = np.maximum.accumulate(np.asarray(sorted_times, dtype=np.float64))
    j = np.clip(np.searchsorted(times, t), 1, max(len(times) - 1, 1))
    if len(times) == 1:
        return np.zeros(len(t), dtype=np.int64)
    left = np.abs(t - times[j - 1]) <= np.abs(times[j] - t)
    return np.where(left, j - 1, j).astype(np.int64)


def _sampling(total, video_fps, pts, *, sampling, fps, max_frames, min_frames, num_frames,
              start, end) -> tuple[np.ndarray, float]:
    """(source frame indices, sampled fps) of a video: by frame number at a constant rate
    (the models' own rules, bit for bit), by presentation time at a variable one."""
    _check_args(sampling, fps, max_frames, min_frames, num_frames, start, end)
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
    fps_, duration, _ = _timing({"total": len(pts), "fps": video_fps, "pts": pts})
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
    idx = inside[_nearest(pts[inside], times)]
    return idx.astype(np.int64), n / span


def _check_args(sampling, fps, max_frames, min_frames, num_frames, start, end) -> None:
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


# ----------------------------------------------------------------------- file checks

@dataclass(frozen=True)
class FileKind:
    """What a file's first bytes say it is."""
    name: str       # "mp4", "matroska", "PNG", "PDF", "text", ...
    what: str       # for messages: "a PNG image", "MP3 audio", ...
    video: bool     # a video container; False: clearly not a video
    image: bool = False


def _kind(name, what, image=False):
    return FileKind(name, what, False, image)


# The one table of magic numbers (the service and the decoder both sniff with it). Still
# images are listed because ffmpeg would happily open them as a one-frame "video".
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", _kind("PNG", "a PNG image", True)),
    (b"\xff\xd8\xff", _kind("JPEG", "a JPEG image", True)),
    (b"II*\x00", _kind("TIFF", "a TIFF image", True)),
    (b"MM\x00*", _kind("TIFF", "a TIFF image", True)),
    (b"%PDF", _kind("PDF", "a PDF document")),
    (b"PK\x03\x04", _kind("ZIP", "a ZIP archive")),
    (b"\x1f\x8b", _kind("gzip", "a gzip archive")),
    (b"ID3", _kind("MP3", "MP3 audio")),
    (b"fLaC", _kind("FLAC", "FLAC audio")),
    (b"\x7fELF", _kind("ELF", "an executable")),
    (b"\x1a\x45\xdf\xa3", FileKind("matroska", "a Matroska/WebM file", True)),
)
_TEXT = _kind("text", "a text file")


def sniff(head: bytes) -> FileKind | None:
    """What the first bytes (64 are enough) of a file say it is, or None when they do not
    say: an unknown container is left to the demuxer."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _kind("WEBP", "a WEBP image", True)
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return _kind("WAV", "WAV audio")
    if head[:2] == b"BM" and len(head) >= 14 and head[6:10] == b"\x00\x00\x00\x00":
        return _kind("BMP", "a BMP image", True)   # the reserved bytes: "BM" alone is too weak
    if head[4:8] == b"ftyp":
        return FileKind("mp4", "an MP4 file", True)
    if head.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        return _TEXT
    for cut in range(4):        # the 64-byte window may split a multi-byte character
        try:
            text = head[:len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text and all(c.isprintable() or c in "\r\n\t" for c in text):
            return _TEXT
        break
    return None


def _check_file(path: str) -> str | None:
    """Raise for what can be told without a demuxer; return the sniffed kind's name."""
    if not os.path.exists(path):
        raise VideoError(f"video file not found: {path}", path=path)
    if not os.path.isfile(path):
        raise VideoError(f"not a regular file: {path}", path=path)
    if os.path.getsize(path) == 0:
        raise VideoError(f"video file is empty (0 bytes): {path}", path=path)
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise VideoError(f"cannot read {path}: {e.strerror or e}", path=path) from None
    kind = sniff(head)
    if kind is not None and kind.image:
        raise VideoError(f"{path} is {kind.what}, not a video; send it as an image",
                         path=path, detected=kind.name)
    if kind is not None and kind.name == "text":
        raise VideoError(f"{path} is a text file, not a video", path=path, detected="text")
    return kind.name if kind is not None else None


def _av_open(av, path):
    """``av.open`` that skips undecodable metadata: PyAV up to 18 takes
    ``metadata_errors="ignore"``; PyAV 19 dropped the argument (a TypeError) and ignores
    such metadata itself."""
    try:
        return av.open(path, metadata_errors="ignore")
    except TypeError:
        return av.open(path)


def _probe_av(path: str, kind: str | None) -> dict | None:
    """Container facts from the headers (and the first frame's side data); None when PyAV
    is missing.

    Raises VideoError for files that are not usable videos at all, whatever the backend."""
    try:
        import av  # lazy: PyAV is optional here (decord may decode alone): None without it
    except ImportError:
        return None
    try:
        container = _av_open(av, path)
    except Exception as e:  # av.error.* (InvalidDataError, ...) and OSError
        reason = getattr(e, "strerror", None) or type(e).__name__
        if kind in ("mp4", "matroska"):
            raise VideoError(f"{path} looks like {'an MP4' if kind == 'mp4' else 'a Matroska'}"
                             f" file but cannot be opened: it is truncated or corrupt ({reason})",
                             path=path) from None
        raise VideoError(f"{path} is not a readable video file ({reason})", path=path) from None
    with container:
        fmt = container.format.name
        if fmt.endswith("_pipe") or fmt == "image2":  # ffmpeg's still-image demuxers
            raise VideoError(f"{path} is a still image ({fmt}), not a video", path=path)
        if not container.streams.video:
            what = "audio only" if container.streams.audio else "no streams"
            raise VideoError(f"{path} has no video stream ({what})", path=path)
        s = container.streams.video[0]
        cc = s.codec_context
        if cc is None:                  # a stream the demuxer found but no decoder takes
            raise VideoError(f"{path} has a video stream with no decodable codec (its "
                             f"headers are corrupt or the codec is unsupported)", path=path)
        rate = s.average_rate or s.guessed_rate or s.base_rate
        fps = float(rate) if rate else 0.0
        start = float(s.start_time * s.time_base) if s.start_time is not None else 0.0
        if s.duration is not None:
            seconds = float(s.duration * s.time_base)
        elif container.duration is not None:
            seconds = container.duration / 1e6
        else:
            seconds = 0.0
        frames = s.frames or (round(seconds * fps) if fps and math.isfinite(seconds) else 0)
        width, height, codec = cc.width, cc.height, cc.name
        rotation = _rotation(container, s)
        return {"frames": int(frames), "fps": fps, "start": start, "width": width,
                "height": height, "codec": codec, "format": fmt, "rotation": rotation}


def _rotation(container, stream) -> int:
    """Degrees (0, 90, 180, 270) counter-clockwise the picture is turned by for display, from
    its display matrix (an MP4/MOV ``tkhd`` matrix: a phone's portrait video is stored
    landscape), as FFmpeg's ``av_display_rotation_get`` reads it and its players apply it.
    FFmpeg hands the matrix to every decoded frame as side data, so the first frame tells,
    whatever the container; 0 when there is none, it is no right angle, or nothing decodes
    (the readers say so later)."""
    try:
        for frame in container.decode(stream):
            r = round(float(getattr(frame, "rotation", 0) or 0)) % 360
            return r if r in (90, 180, 270) else 0
    except Exception:  # noqa: BLE001 (av errors: the file's data is for the readers to judge)
        pass
    return 0


def _rotate(frames: np.ndarray, rotation: int) -> np.ndarray:
    """``[T, H, W, 3]`` frames turned counter-clockwise by ``rotation`` degrees (a view)."""
    if not rotation:
        return frames
    return np.rot90(frames, rotation // 90, axes=(1, 2))


def _stored(size, rotation):
    """The (h, w) a decoder scales the stored picture to, for display size ``size``."""
    if size is None or rotation not in (90, 270):
        return size
    return size[1], size[0]


# --------------------------------------------------------------------------- readers

class _DecordReader:
    """decord applies the display matrix's rotation itself (and scales after it): its frames
    and sizes are as displayed already."""
    name = "decord"

    def __init__(self, path: str, size: tuple[int, int] | None = None, rotation: int = 0):
        # lazy: decord is installed on x86_64 only (pyproject.toml), and decoders load only
        # in the process that decodes (the decode worker)
        import decord

        decord.logging.set_level(decord.logging.QUIET)
        self.path, self.size, self.rotation = path, size, rotation
        h, w = size or (-1, -1)   # decord scales in its own filter graph
        self.vr = decord.VideoReader(path, ctx=decord.cpu(0), width=w, height=h, num_threads=0)
        self.total = len(self.vr)
        self.fps = float(self.vr.get_avg_fps())
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise RuntimeError("decord reports no frame rate")
        # every frame's presentation time (decord's index: no decoding), from the first
        ts = np.asarray(self.vr.get_frame_timestamp(np.arange(self.total))[:, 0], np.float64) \
            if self.total else np.zeros(0)
        self.pts = ts - ts[0] if len(ts) else ts

    def resized(self, size):
        """This reader with frames at ``size`` (h, w), or full size for None."""
        if size == self.size:
            return self
        self.close()
        return _DecordReader(self.path, size, self.rotation)

    out_buffer = None     # uint8 memory to decode the next batch into (Session.next)

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = [int(i) for i in indices]
        nd = self.vr.get_batch(idx)
        frames = _decord_into(nd, self.out_buffer)
        return frames, self.pts[np.asarray(idx, dtype=np.int64)]

    def batches(self, targets: np.ndarray, batch: int):
        """``(frames, timestamps)`` of sorted distinct ``targets``, ``batch`` at a time; the
        reader keeps its position between batches, so dense samples decode straight on."""
        for s in range(0, len(targets), batch):
            yield self.read(targets[s:s + batch])

    def close(self):
        self.vr = None


def _decord_into(nd, out) -> np.ndarray:
    """A decord NDArray as numpy: copied straight into ``out`` (shared memory: one copy,
    as ``asnumpy`` makes) when it fits, else a new array."""
    shape = tuple(nd.shape)
    n = int(np.prod(shape))
    if out is not None and out.nbytes >= n and str(nd.dtype) == "uint8":
        try:
            from decord._ffi.base import _LIB, check_call  # lazy: decord is x86_64 only
            dst = out[:n].reshape(shape)
            check_call(_LIB.DECORDArrayCopyToBytes(nd.handle, dst.ctypes.data_as(
                ctypes.c_void_p), ctypes.c_size_t(n)))
            return dst
        except (ImportError, AttributeError):
            pass
    return nd.asnumpy()


def _stack_into(frames: list, out) -> np.ndarray:
    shape = (len(frames), *frames[0].shape)
    n = int(np.prod(shape))
    if out is not None and out.nbytes >= n:
        return np.stack(frames, out=out[:n].reshape(shape))
    return np.stack(frames)


class _PyAVReader:
    name = "pyav"
    out_buffer = None     # uint8 memory to decode the next batch into (Session.next)

    def __init__(self, path: str, facts: dict, size: tuple[int, int] | None = None):
        # lazy: decoders load only in the process that decodes (the decode worker), not in
        # every process that imports this module (the server's, `mminfer serve --help`)
        import av

        self.av = av
        self.path, self.facts, self.size = path, facts, size
        self.rotation = facts.get("rotation", 0)
        self.fps, self.start = facts["fps"], facts["start"]
        if not self.fps > 0:
            raise VideoError(f"{path}: the video stream has no frame rate", path=path)
        self.pts = self._packet_times()
        self.total = len(self.pts)
        self.container = _av_open(av, path)
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"

    def resized(self, size):
        self.size = size   # swscale converts and scales in one pass from the decoded planes
        return self

    def _packet_times(self) -> np.ndarray:
        # Every frame's presentation time from the packet headers (demuxing, far cheaper
        # than decoding): the frame count where the container has none (Matroska), and the
        # timestamps of a variable-frame-rate video.
        ts = []
        with _av_open(self.av, self.path) as c:
            s = c.streams.video[0]
            try:
                for p in c.demux(s):
                    t = p.pts if p.pts is not None else p.dts
                    if p.size and t is not None:
                        ts.append(t)
            except self.av.error.FFmpegError:
                pass
            base = float(s.time_base) if s.time_base else 1.0 / self.fps
        ts = np.sort(np.asarray(ts, dtype=np.float64)) * base
        return ts - self.start if len(ts) else ts

    def _index(self, frame) -> int:
        return int(_nearest(self.pts, np.array([frame.time - self.start]))[0])

    def _rgb(self, frame) -> np.ndarray:
        if self.size is None:
            rgb = frame.to_ndarray(format="rgb24")
        else:
            h, w = _stored(self.size, self.rotation)
            rgb = frame.to_ndarray(format="rgb24", width=w, height=h, interpolation="BICUBIC")
        return _rotate(rgb[None], self.rotation)[0]

    def _frames_from(self, target: int | None):
        """Decoded frames from the keyframe at or before ``target`` (from the start when
        None), skipping packets the decoder rejects instead of giving up on the file."""
        seconds = self.start + float(self.pts[target]) if target else 0.0
        offset = int(seconds / self.stream.time_base) if target else 0
        self.container.seek(offset, stream=self.stream, backward=True, any_frame=False)
        demux = self.container.demux(self.stream)
        while True:
            try:
                packet = next(demux)
            except StopIteration:
                return
            except self.av.error.FFmpegError:
                return  # unreadable data from here on: truncated
            try:
                frames = packet.decode()
            except self.av.error.FFmpegError:
                continue
            yield from frames

    def frames(self, targets):
        """``(target, rgb, seconds)`` for each of the sorted distinct ``targets``, in order,
        decoding forward and seeking only when the next target is far ahead."""
        targets = [int(t) for t in targets]
        last_index, last = -1, None
        seek_gap = max(32, int(2 * self.fps))  # beyond this, seeking beats decoding through
        pos, sequential = 0, False
        while pos < len(targets):
            # Seek to the next target; containers without an index (MPEG-TS) can land
            # after it or mid-GOP with nothing decodable, so then fall back to one
            # sequential pass from the start.
            progressed, first = False, True
            for frame in self._frames_from(None if sequential else targets[pos]):
                if frame.time is None:
                    continue
                i = self._index(frame)
                if first and not sequential and i > targets[pos]:
                    break  # overshot
                first = False
                if i < targets[pos]:
                    continue
                progressed = True
                last_index, last = i, (self._rgb(frame), frame.time - self.start)
                while pos < len(targets) and targets[pos] <= i:
                    yield (targets[pos], *last)
                    pos += 1
                if pos == len(targets) or (not sequential and targets[pos] - i > seek_gap):
                    break
            if sequential:
                break
            if not progressed:
                sequential = True
        if last is None:
            raise VideoError(f"{self.path} contains no decodable video frames "
                             f"(the video data is truncated or corrupt)", path=self.path)
        if pos < len(targets):
            # A frame count taken from the container duration can overshoot by a frame or
            # two; further than that, the data ends early: the file is truncated.
            if targets[-1] - last_index > max(2, self.total // 100):
                raise VideoError(
                    f"{self.path} is truncated or corrupt: decoding stopped at frame "
                    f"{last_index} of {self.total}", path=self.path)
            for t in targets[pos:]:
                yield (t, *last)

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        got = {t: (rgb, ts) for t, rgb, ts in self.frames(sorted(set(int(i) for i in indices)))}
        frames = np.stack([got[int(i)][0] for i in indices])
        ts = np.array([got[int(i)][1] for i in indices], dtype=np.float64)
        return frames, ts

    def batches(self, targets: np.ndarray, batch: int):
        rgb, ts = [], []
        for _, frame, t in self.frames(targets):
            rgb.append(frame)
            ts.append(t)
            if len(rgb) == batch:
                yield _stack_into(rgb, self.out_buffer), np.array(ts, dtype=np.float64)
                rgb, ts = [], []
        if rgb:
            yield _stack_into(rgb, self.out_buffer), np.array(ts, dtype=np.float64)

    def close(self):
        self.container.close()


def _open_reader(name: str, path: str, facts: dict | None, size=None):
    if name == "decord":
        return _DecordReader(path, size, (facts or {}).get("rotation", 0))
    if facts is None:
        raise ImportError("PyAV (the av package) is not installed")
    return _PyAVReader(path, facts, size)


def _backend_order(backend: str | None) -> tuple[str, ...]:
    if backend is None:
        return BACKENDS
    if backend not in BACKENDS:
        raise VideoError(f"unknown video backend {backend!r}; use one of {', '.join(BACKENDS)}")
    return (backend,)


def _explain(path: str, failures) -> VideoError:
    for _, _, e in failures:
        if isinstance(e, VideoError):
            return e
    if all(stage == "missing" for _, stage, _ in failures):
        names = " or ".join(n for n, _, _ in failures)
        return VideoError(f"no video backend available: install {names}")
    if any(stage == "read" for _, stage, _ in failures):
        return VideoError(f"{path} is truncated or corrupt: its frames cannot be decoded",
                          path=path)
    return VideoError(f"{path} cannot be opened as a video (corrupt or unsupported format)",
                      path=path)


# FFmpeg's answers when an address-space limit stops it: ENOMEM, and EAGAIN from a
# decoder thread whose stack cannot be mapped (PyAV raises them as OSErrors)
_OUT_OF_MEMORY = (12, 11)


class Session:
    """The decoding side of one video: opens it with the first backend that can, then reads
    sorted distinct frame numbers in batches, handing the rest to the next backend when one
    fails mid-read. Everything here runs C/C++ parsers on the file, so by default it runs in
    a decode worker process (``mminfer.engine.decode_worker``) that a crafted file may crash,
    starve of memory or hang without harm to the caller; ``decode_worker.configure(
    sandbox=False)`` runs it in this process instead."""

    def __init__(self):
        self.reader = None
        self.backend = None
        self._gen = None
        self._cur = None          # the reader decoding now
        self._out = None

    def probe(self, path: str, order, kind) -> dict:
        try:
            return self.open(path, order, kind)
        finally:
            self.close()

    def open(self, path: str, order, kind) -> dict:
        """Facts of the video (as the backend that opened it sees them): ``backend``,
        ``total`` frames, ``fps`` (the container's average), ``pts`` (every frame's
        presentation time in seconds from the first), display ``width``/``height`` (after
        rotation), ``codec``, ``rotation``."""
        self.close()
        facts = _probe_av(path, kind)
        if (facts or {}).get("rotation") and "pyav" in order:
            # decord turns frames itself, but breaks on some sizes (a buffer size check fails
            # for 96x48 at 90 degrees, and with scaling at 180): PyAV first for these
            order = ("pyav", *(o for o in order if o != "pyav"))
        failures: list[tuple[str, str, BaseException]] = []
        reader = None
        for i, name in enumerate(order):
            try:
                reader = _open_reader(name, path, facts)
            except ImportError as e:
                failures.append((name, "missing", e))
                continue
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001 (decord raises DECORDError/RuntimeError)
                failures.append((name, "open", e))
                continue
            order = order[i + 1:]
            break
        if reader is None:
            raise _explain(path, failures)
        self.path, self.facts, self.reader, self.rest = path, facts, reader, list(order)
        self.failures, self.backend = failures, reader.name
        rotation = (facts or {}).get("rotation", 0)
        if reader.total < 1:
            h = w = 0
            codec = (facts or {}).get("codec", "unknown")
        elif facts is not None:
            h, w, codec = facts["height"], facts["width"], facts["codec"]
            if rotation in (90, 270):
                h, w = w, h
        else:   # no PyAV to read the headers: one decoded frame tells
            h, w = reader.read(np.array([0]))[0].shape[1:3]
            codec = "unknown"
        return {"backend": reader.name, "total": int(reader.total), "fps": float(reader.fps),
                "pts": np.asarray(reader.pts, dtype=np.float64), "width": int(w),
                "height": int(h), "codec": codec, "rotation": rotation}

    def start(self, targets, size, batch: int) -> None:
        """Decode the sorted distinct frame numbers ``targets``, ``batch`` at a time, at
        display size ``size`` (h, w) or the source's (None): see :meth:`next`."""
        self._gen = self._produce(np.asarray(targets, dtype=np.int64),
                                  None if size is None else tuple(int(v) for v in size),
                                  int(batch))

    def next(self, out: np.ndarray | None = None) -> np.ndarray | None:
        """The next batch of frames (uint8 ``[k, h, w, 3]``, C order), None at the end;
        decoded into ``out`` (flat uint8) where the backend can (then a view of it)."""
        self._out = out
        if self._cur is not None:
            self._cur.out_buffer = out
        return next(self._gen, None)

    def close(self):
        if self._gen is not None:
            self._gen.close()
            self._gen = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def _produce(self, targets, size, batch):
        pos = 0
        reader, self.reader = self.reader, None
        if size is None:
            want_hw = None
        rest = self.rest
        try:
            while True:
                name = reader.name
                try:
                    reader = reader.resized(size)
                    self.backend = reader.name
                    self._cur = reader
                    reader.out_buffer = self._out
                    for frames, _ in reader.batches(targets[pos:], batch):
                        k = len(frames)
                        want_hw = size or want_hw or frames.shape[1:3]
                        want = (k, *want_hw, 3)
                        if frames.shape != want or frames.dtype != np.uint8:
                            raise RuntimeError(f"backend returned frames of shape "
                                               f"{frames.shape}, expected {want}")
                        pos += k
                        yield np.ascontiguousarray(frames)
                    return
                except VideoError:
                    raise
                except MemoryError:
                    raise
                except OSError as e:
                    if e.errno in _OUT_OF_MEMORY:
                        raise MemoryError(f"decoding {self.path}: {e}") from None
                    self.failures.append((name, "read", e))
                except Exception as e:  # noqa: BLE001 (the next backend gets the rest)
                    self.failures.append((name, "read", e))
                finally:
                    reader.close()
                    self._cur = None
                reader = None
                while rest and reader is None:
                    nxt = rest.pop(0)
                    try:
                        reader = _open_reader(nxt, self.path, self.facts)
                    except ImportError as e:
                        self.failures.append((nxt, "missing", e))
                    except Exception as e:  # noqa: BLE001
                        self.failures.append((nxt, "open", e))
                if reader is None:
                    raise _explain(self.path, self.failures)
        finally:
            if reader is not None:
                reader.close()


def _session() -> Session:
    from mminfer.engine import decode_worker  # lazy: import cycle (it imports Session)
    return decode_worker.session()


# ------------------------------------------------------------------------------ API

def probe(path, *, backend: str | None = None) -> VideoInfo:
    """Frame count, frame rate and size of a video, as the decoding backend sees them
    (a variable-frame-rate video: its mean rate and the duration its timestamps span)."""
    path = os.fspath(path)
    order = _backend_order(backend)
    kind = _check_file(path)
    facts = _session().probe(path, order, kind)
    if facts["total"] < 1:
        raise VideoError(f"{path} contains no video frames", path=path)
    fps, duration, _ = _timing(facts)
    return VideoInfo(path, facts["total"], fps, duration, facts["width"], facts["height"],
                     facts["codec"], facts["backend"], facts["pts"])


def decode(path, *, sampling: str = "qwen", fps: float = 2.0, max_frames: int = 768,
           min_frames: int = 4, num_frames: int | None = None, start: float | None = None,
           end: float | None = None, backend: str | None = None,
           size: tuple[int, int] | None = None) -> DecodedVideo:
    """Decode the sampled frames of a video (RGB uint8) with their timestamps.

    ``start``/``end`` (seconds) restrict sampling to a window; ``num_frames`` overrides the
    fps rule; ``backend`` forces "decord" or "pyav" (default: decord, then PyAV); ``size``
    (h, w) has the decoder scale every frame to that size (its own bicubic scaler), else
    frames come at the source size. All frames are held at once: a long video or a large
    frame wants :func:`open_stream`."""
    with open_stream(path, sampling=sampling, fps=fps, max_frames=max_frames,
                     min_frames=min_frames, num_frames=num_frames, start=start, end=end,
                     backend=backend) as s:
        if size is not None:
            s.decode_size = (int(size[0]), int(size[1]))
        chunks = list(s.chunks(max(len(s), 1)))
        frames = np.ascontiguousarray(chunks[0] if len(chunks) == 1 else np.concatenate(chunks))
    return DecodedVideo(
        frames=frames, timestamps=s.timestamps, indices=s.indices, fps=s.fps,
        sampled_fps=s.sampled_fps, duration=s.duration, width=s.width, height=s.height,
        backend=s.backend)


# --------------------------------------------------------------------------- streaming

# The decoder scales frames itself only when the source has more than this many times the
# model's pixels (4K and 8K uploads for a 1008x560 model frame): there, full-size RGB frames
# would cost host memory and conversion time for nothing. Below it, frames come at full size
# and the adapter's own resize (qwen-vl-utils' antialiased bicubic) runs on them, keeping its
# numerics exactly.
DECODER_SCALE_MIN_AREA = 4.0
STREAM_BUFFER_BYTES = 256 << 20   # decoded frames waiting for the consumer, at most
DECODE_BATCH = 8                  # frames per decoder call


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class VideoStream:
    """The sampled frames of a video, decoded in a background thread while the consumer
    works on earlier ones (``open_stream``).

    Before the first frame is asked for, a consumer may narrow the samples
    (``keep_samples``) and ask for its frame size (``request_size``). ``chunks(n)`` then
    yields uint8 RGB arrays ``[n, h, w, 3]`` (the last one shorter) in sample order while
    the thread decodes ahead, holding at most ``STREAM_BUFFER_BYTES`` of decoded frames. The
    stream behaves as the frames of a :class:`DecodedVideo` where the adapters look:
    ``len()``, ``shape`` (of the source frames, as displayed) and ``sampled_fps``.

    The decoding itself runs in a decode worker process (``mminfer.engine.decode_worker``),
    which writes the frames into shared memory; the thread here hands them on.
    ``decode_ms`` is the thread's own decoding time (it runs alongside the consumer);
    ``wait_ms`` is how long the consumer sat waiting for frames. A backend that fails while
    reading hands the remaining samples to the next backend (same frame numbers).
    """

    def __init__(self, path, session, facts, indices, *, sampled_fps, open_ms):
        self.path, self._session, self._facts = path, session, facts
        self.indices = np.asarray(indices, dtype=np.int64)
        self.fps, self.duration, self.vfr = _timing(facts)
        self.sampled_fps = sampled_fps
        self.width, self.height = int(facts["width"]), int(facts["height"])
        self.rotation = facts.get("rotation", 0)
        self.backend = facts["backend"]
        self.decode_size: tuple[int, int] | None = None   # what the decoder scales to
        self.decode_ms, self.wait_ms = open_ms, 0.0
        self._thread = None
        self._queue = None
        self._stop = None
        self._consumed = False

    # -------------------------------------------------------------- before starting
    def __len__(self) -> int:
        return len(self.indices)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.indices), self.height, self.width, 3)

    @property
    def timestamps(self) -> np.ndarray:
        """Presentation time (seconds from the first frame) of each sample."""
        return self._facts["pts"][self.indices].astype(np.float64)

    @property
    def frame_size(self) -> tuple[int, int]:
        """(h, w) of the frames ``chunks`` yields."""
        return self.decode_size or (self.height, self.width)

    def keep_samples(self, positions) -> "VideoStream":
        """Keep only the samples at ``positions`` (in order) of the current ones."""
        self._not_started("keep_samples")
        idx = self.indices[np.asarray(positions, dtype=np.int64)]
        if np.any(np.diff(idx) < 0):
            raise ValueError("a stream decodes forward: selected samples must be in order")
        self.indices = idx
        return self

    def request_size(self, height: int, width: int) -> tuple[int, int]:
        """The consumer's frame size: the decoder scales to it when the source is larger
        than ``DECODER_SCALE_MIN_AREA`` times it, else frames stay at the source size (the
        consumer resizes them). Returns the size ``chunks`` will yield."""
        self._not_started("request_size")
        big = self.width * self.height > DECODER_SCALE_MIN_AREA * height * width
        self.decode_size = (int(height), int(width)) if big else None
        return self.frame_size

    def _not_started(self, what):
        if self._thread is not None or self._consumed:
            raise RuntimeError(f"{what}() after decoding started")

    # -------------------------------------------------------------- decoding
    def start(self) -> "VideoStream":
        if self._thread is None and not self._consumed:
            h, w = self.frame_size
            frame = max(h * w * 3, 1)
            self._batch = int(min(DECODE_BATCH, max(1, STREAM_BUFFER_BYTES // 4 // frame)))
            depth = max(2, STREAM_BUFFER_BYTES // (self._batch * frame))
            self._queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, name="mminfer-decode",
                                            daemon=True)
            self._thread.start()
        return self

    def chunks(self, n: int):
        """uint8 ``[n, h, w, 3]`` arrays of consecutive samples (the last may be shorter)."""
        if self._consumed:
            raise RuntimeError("the stream's frames were already consumed")
        self.start()
        buf, have = [], 0
        while True:
            t0 = time.perf_counter()
            item = self._queue.get()
            self.wait_ms += (time.perf_counter() - t0) * 1e3
            if item is _END:
                break
            if isinstance(item, _Failure):
                self._consumed = True
                raise item.error
            buf.append(item)
            have += len(item)
            while have >= n:
                joined = np.concatenate(buf) if len(buf) > 1 else buf[0]
                yield joined[:n]
                rest = joined[n:]
                buf, have = ([rest], len(rest)) if len(rest) else ([], 0)
        self._consumed = True
        if have:
            yield np.concatenate(buf) if len(buf) > 1 else buf[0]

    def close(self):
        """Stop the decoder thread (if running) and release the file and the worker."""
        if self._thread is not None:
            self._stop.set()
            give_up = time.monotonic() + 1.0
            while self._thread.is_alive():
                try:                      # unblock a producer waiting on a full queue
                    self._queue.get_nowait()
                except Exception:  # noqa: BLE001 (queue.Empty)
                    self._thread.join(0.05)
                if time.monotonic() > give_up and hasattr(self._session, "abort"):
                    self._session.abort()  # a decode worker still busy on a batch: end it
                    give_up = float("inf")
            self._thread = None
        if self._session is not None:
            self._session.close()
            self._session = None
        self._consumed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        try:
            t0 = time.perf_counter()
            for frames in self._produce():
                self.decode_ms += (time.perf_counter() - t0) * 1e3
                if not self._put(frames):
                    return
                t0 = time.perf_counter()
            self.decode_ms += (time.perf_counter() - t0) * 1e3
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, raised there)
            self._put(_Failure(e))

    def _produce(self):
        targets, counts = np.unique(self.indices, return_counts=True)
        session = self._session
        session.start(targets, self.decode_size, self._batch)
        pos = 0
        want = self.frame_size
        while pos < len(targets):
            frames = session.next()
            if frames is None:
                raise _explain(self.path, [(self.backend, "read", RuntimeError(
                    f"the decoder ended after {pos} of {len(targets)} frames"))])
            self.backend = session.backend
            k = len(frames)
            if k == 0 or pos + k > len(targets) or frames.shape[1:] != (*want, 3):
                raise RuntimeError(f"the decoder returned frames of shape {frames.shape}, "
                                   f"expected ({min(self._batch, len(targets) - pos)}, "
                                   f"{want[0]}, {want[1]}, 3)")
            reps = counts[pos:pos + k]
            pos += k
            yield np.repeat(frames, reps, axis=0) if reps.max() > 1 else frames
            if self._stop.is_set():
                return


def open_stream(path, *, sampling: str = "qwen", fps: float = 2.0, max_frames: int = 768,
                min_frames: int = 4, num_frames: int | None = None, start: float | None = None,
                end: float | None = None, backend: str | None = None) -> VideoStream:
    """Open a video and pick its samples (as :func:`decode`) without decoding them yet: the
    returned :class:`VideoStream` decodes in a background thread once frames are asked for.
    Close it (or use it as a context manager) when done."""
    t0 = time.perf_counter()
    _check_args(sampling, fps, max_frames, min_frames, num_frames, start, end)
    path = os.fspath(path)
    order = _backend_order(backend)
    kind = _check_file(path)
    session = _session()
    try:
        facts = session.open(path, order, kind)
        if facts["total"] < 1:
            raise VideoError(f"{path} contains no video frames", path=path)
        idx, sampled_fps = _sampling(facts["total"], facts["fps"], facts["pts"],
                                     sampling=sampling, fps=fps, max_frames=max_frames,
                                     min_frames=min_frames, num_frames=num_frames,
                                     start=start, end=end)
    except BaseException:
        session.close()
        raise
    return VideoStream(path, session, facts, idx, sampled_fps=sampled_fps,
                       open_ms=(time.perf_counter() - t0) * 1e3)
