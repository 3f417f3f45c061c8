"""Frames of a live source as they arrive: an HTTP(S) or HLS URL, an RTSP camera, an MPEG-TS or
MP4 file (growing or whole), whatever PyAV opens, sampled at a stream's rate and handed over in
pieces (mminfer.engine.streams appends each one).

Media time is the source's own: frame timestamps from the first frame's. Sample ``k`` is media
time ``k / fps``; the first frame at or after it is kept (a source slower than ``fps`` gives
each of its frames once). A piece is handed over once it covers ``piece_seconds`` of media, or
once ``piece_seconds`` of wall time passed since its first frame (a source that slows down
still shows up), and at the end of the source.

Decoded in this process (not the decode sandbox: a live source has no file to hand it), with
PyAV's open and read timeouts, so a source that stalls ends with an error instead of a thread
waiting forever. A frame whose timestamp goes back is skipped and counted.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from mminfer.errors import VideoError


@dataclass
class Piece:
    frames: np.ndarray      # [n, H, W, 3] uint8: the kept samples, in order
    next_sample: int        # the next sample's index (media time next_sample / fps)
    media_end: float        # the media time the source has covered (seconds)


class LiveSource:
    """A source PyAV opens, read as pieces of samples at ``fps`` (see the module doc).
    ``timeout_s``: opening it, and each read, at most. ``realtime``: a file is read at the
    pace of its timestamps, as a camera would deliver it (``mminfer watch`` on a file)."""

    def __init__(self, url: str, fps: float, *, piece_seconds: float = 2.0,
                 timeout_s: float = 10.0, realtime: bool = False):
        self.url, self.fps = url, float(fps)
        self.piece_seconds = float(piece_seconds)
        self.timeout_s = float(timeout_s)
        self.realtime = realtime
        self.frames_read = 0          # decoded frames
        self.backwards = 0            # frames skipped: their timestamp went back
        self.container = None

    def _open(self):
        import av                     # a dependency of the video layer (PyAV)
        try:
            return av.open(self.url, timeout=(self.timeout_s, self.timeout_s))
        except av.FFmpegError as e:
            raise VideoError(f"the source could not be opened: {_why(e)}",
                             reason="source") from None

    def pieces(self, stop: threading.Event | None = None):
        """Pieces until the source ends (or ``stop`` is set); VideoError when it cannot be
        opened or read (a stall past the timeout, a cut connection, corrupt data)."""
        import av
        stop = stop or threading.Event()
        self.container = c = self._open()
        try:
            if not c.streams.video:
                raise VideoError("the source has no video stream", reason="source")
            vs = c.streams.video[0]
            vs.thread_type = "AUTO"
            t0 = None
            last_t = -math.inf
            k = 0
            kept: list[np.ndarray] = []
            piece_wall = None
            started = time.monotonic()
            try:
                for frame in c.decode(vs):
                    if stop.is_set():
                        return
                    self.frames_read += 1
                    t = frame.time if frame.time is not None else self.frames_read / 25.0
                    if t0 is None:
                        t0 = t
                    t -= t0
                    if t < last_t:
                        self.backwards += 1
                        continue
                    last_t = t
                    if self.realtime:
                        ahead = t - (time.monotonic() - started)
                        if ahead > 0 and stop.wait(ahead):
                            return
                    if t + 1e-3 >= k / self.fps:
                        kept.append(frame.to_ndarray(format="rgb24"))
                        k = math.floor(t * self.fps + 1e-3) + 1
                        if piece_wall is None:
                            piece_wall = time.monotonic()
                    covered = k / self.fps
                    if kept and (len(kept) / self.fps >= self.piece_seconds - 1e-9 or
                                 time.monotonic() - piece_wall >= self.piece_seconds):
                        yield Piece(np.stack(kept), k, covered)
                        kept, piece_wall = [], None
            except av.FFmpegError as e:
                if kept:                # what arrived before the error is the stream's
                    yield Piece(np.stack(kept), k, k / self.fps)
                raise VideoError(f"reading the source failed: {_why(e)}",
                                 reason="source") from None
            if kept and not stop.is_set():
                yield Piece(np.stack(kept), k, k / self.fps)
        finally:
            self.container = None
            c.close()


def _why(e) -> str:
    text = str(getattr(e, "strerror", None) or e)
    return text.splitlines()[0][:200] if text else type(e).__name__
