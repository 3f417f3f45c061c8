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
waiting forever. A frame whose timestamp goes back is skipped and counted; one without a
timestamp is taken to come one frame (the source's rate) after the last.
"""

from __future__ import annotations

import errno
import math
import threading
import time
from dataclasses import dataclass

import av
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
        try:
            return av.open(self.url, timeout=(self.timeout_s, self.timeout_s))
        except av.FFmpegError as e:
            raise VideoError(f"the source could not be opened: {_why(e)}",
                             reason="source") from None

    def pieces(self, stop: threading.Event | None = None):
        """Pieces until the source ends (or ``stop`` is set); VideoError when it cannot be
        opened or read (a stall past the timeout, corrupt data). A connection the source
        closes is its end (a live HTTP source has no length to tell a cut from an end)."""
        stop = stop or threading.Event()
        self.container = c = self._open()
        try:
            if not c.streams.video:
                raise VideoError("the source has no video stream", reason="source")
            vs = c.streams.video[0]
            vs.thread_type = "AUTO"
            rate = vs.average_rate or vs.guessed_rate
            self._step = 1.0 / float(rate) if rate else 1.0 / 25.0
            self._t0, self._last_t, self._k = None, -math.inf, 0
            self._kept, self._piece_wall = [], None
            self._started = time.monotonic()
            try:
                for packet in c.demux(vs):
                    for frame in packet.decode():      # the last, empty packet flushes
                        if stop.is_set():
                            return
                        piece = self._take(frame, stop)
                        if piece is not None:
                            yield piece
            except av.ExitError:
                if stop.is_set():
                    return
                raise VideoError(f"the source stalled: nothing arrived for "
                                 f"{self.timeout_s:g} s", reason="source") from None
            except av.FFmpegError as e:
                if getattr(e, "errno", None) != errno.EIO or not self.frames_read:
                    raise VideoError(f"reading the source failed: {_why(e)}",
                                     reason="source") from None
                for frame in vs.codec_context.decode(None):   # the closed source's last
                    piece = self._take(frame, stop)
                    if piece is not None:
                        yield piece
            finally:
                rest = self._flush()
            if rest is not None and not stop.is_set():
                yield rest
        finally:
            self.container = None
            c.close()

    def _take(self, frame, stop) -> Piece | None:
        """One decoded frame: kept if it is the next sample; a piece when one is complete."""
        self.frames_read += 1
        t = frame.time
        if t is None or not math.isfinite(t):
            # the decoder's last frames may come without a timestamp: the next one's due
            t = (self._t0 or 0.0) + max(self._last_t, -self._step) + self._step
        if self._t0 is None:
            self._t0 = t
        t -= self._t0
        if t < self._last_t:
            self.backwards += 1
            return None
        self._last_t = t
        if self.realtime:
            ahead = t - (time.monotonic() - self._started)
            if ahead > 0:
                stop.wait(ahead)
        if t + 1e-3 >= self._k / self.fps:
            self._kept.append(frame.to_ndarray(format="rgb24"))
            self._k = math.floor(t * self.fps + 1e-3) + 1
            if self._piece_wall is None:
                self._piece_wall = time.monotonic()
        if self._kept and (len(self._kept) / self.fps >= self.piece_seconds - 1e-9 or
                           time.monotonic() - self._piece_wall >= self.piece_seconds):
            return self._flush()
        return None

    def _flush(self) -> Piece | None:
        if not self._kept:
            return None
        piece = Piece(np.stack(self._kept), self._k, self._k / self.fps)
        self._kept, self._piece_wall = [], None
        return piece


def _why(e) -> str:
    text = str(getattr(e, "strerror", None) or e)
    return text.splitlines()[0][:200] if text else type(e).__name__
