"""A video's sampled frames: what its header says (:func:`probe`), all of them at once
(:func:`decode`), or streamed while the consumer works on earlier ones (:func:`open_stream`,
:class:`VideoStream`). Probing and decoding run in a decode worker process unless the sandbox
is off (mminfer.video.sandbox)."""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mminfer.errors import VideoError
from mminfer.video.filekind import check_file
from mminfer.video import remote
from mminfer.video.sampling import check_args, sample_frames, timing
from mminfer.video.session import backend_order, explain


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
        # M-RoPE positions collapse.
        return {"fps": self.sampled_fps, "total_num_frames": self.num_frames,
                "frames_indices": list(range(self.num_frames))}


def probe(path, *, backend: str | None = None) -> VideoInfo:
    """Frame count, frame rate and size of a video, as the decoding backend sees them
    (a variable-frame-rate video: its mean rate and the duration its timestamps span)."""
    path = os.fspath(path)
    order = backend_order(backend)
    kind = check_file(path)
    facts = remote.session().probe(path, order, kind)
    if facts["total"] < 1:
        raise VideoError(f"{path} contains no video frames", path=path)
    fps, duration, _ = timing(facts)
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

    The decoding itself runs in a decode worker process (``mminfer.video.worker``),
    which writes the frames into shared memory; the thread here hands them on.
    ``decode_ms`` is the thread's own decoding time (it runs alongside the consumer);
    ``wait_ms`` is how long the consumer sat waiting for frames. A backend that fails while
    reading hands the remaining samples to the next backend (same frame numbers).
    """

    def __init__(self, path, session, facts, indices, *, sampled_fps, open_ms):
        self.path, self._session, self._facts = path, session, facts
        self.indices = np.asarray(indices, dtype=np.int64)
        self.fps, self.duration, self.vfr = timing(facts)
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
                raise explain(self.path, [(self.backend, "read", RuntimeError(
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
    check_args(sampling, fps, max_frames, min_frames, num_frames, start, end)
    path = os.fspath(path)
    order = backend_order(backend)
    kind = check_file(path)
    session = remote.session()
    try:
        facts = session.open(path, order, kind)
        if facts["total"] < 1:
            raise VideoError(f"{path} contains no video frames", path=path)
        idx, sampled_fps = sample_frames(facts["total"], facts["fps"], facts["pts"],
                                         sampling=sampling, fps=fps, max_frames=max_frames,
                                         min_frames=min_frames, num_frames=num_frames,
                                         start=start, end=end)
    except BaseException:
        session.close()
        raise
    return VideoStream(path, session, facts, idx, sampled_fps=sampled_fps,
                       open_ms=(time.perf_counter() - t0) * 1e3)
