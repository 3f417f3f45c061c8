"""The two decoding backends and the container facts they start from.

decord is the first backend (fast random access with ``get_batch``); PyAV is the fallback
when decord is missing or cannot read the file. Only the sampled frames are converted to
RGB, and neither backend decodes the whole file when the samples are sparse (decord seeks
per batch; the PyAV reader seeks when the next sample is far ahead). Both hand frames as
displayed (the display matrix's rotation applied).
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from mminfer.errors import VideoError
from mminfer.video.sampling import nearest

BACKENDS = ("decord", "pyav")


def _av_open(av, path):
    """``av.open`` that skips undecodable metadata: PyAV up to 18 takes
    ``metadata_errors="ignore"``; PyAV 19 dropped the argument (a TypeError) and ignores
    such metadata itself."""
    try:
        return av.open(path, metadata_errors="ignore")
    except TypeError:
        return av.open(path)


def probe_av(path: str, kind: str | None) -> dict | None:
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
        # lazy: PyAV is optional here, as in probe_av: without it this backend is "missing"
        # (Session.open) and decord decodes alone
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
        return int(nearest(self.pts, np.array([frame.time - self.start]))[0])

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


def open_reader(name: str, path: str, facts: dict | None, size=None):
    if name == "decord":
        return _DecordReader(path, size, (facts or {}).get("rotation", 0))
    if facts is None:
        raise ImportError("PyAV (the av package) is not installed")
    return _PyAVReader(path, facts, size)


