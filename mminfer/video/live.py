"""Frames of a live source as they arrive: an HTTP(S) or HLS URL, an RTSP camera, an MPEG-TS or
MP4 file (growing or whole), whatever PyAV opens, sampled at a stream's rate and handed over in
pieces (mminfer.engine.streams appends each one).

Media time is the source's own: frame timestamps from the first frame's. Sample ``k`` is media
time ``k / fps``; the first frame at or after it is kept (a source slower than ``fps`` gives
each of its frames once). A piece is handed over once it covers ``piece_seconds`` of media, or
once ``piece_seconds`` of wall time passed since its first frame (a source that slows down
still shows up), and at the end of the source.

PyAV's open and read timeouts end a source that stalls with an error instead of a thread
waiting forever. A frame whose timestamp goes back is skipped and counted; one without a
timestamp is taken to come one frame (the source's rate) after the last.

The server reads a source in a process of its own (:class:`SandboxedSource`, from
:func:`open_source`): a decode worker (mminfer.video.sandbox: a fresh interpreter under a
memory limit, taken from the pool of started ones) runs :class:`LiveSource` and sends each
piece back, its frames in a ``memfd`` whose descriptor rides along with the message, and a
word of progress whenever data arrived (at most twice a second). It reads on once the piece
is taken, as a reader in this process does: a model slower than the source holds the source
back (its lag grows) instead of pieces piling up in memory. A crafted source that crashes
the demuxer or decoder, exhausts the memory limit or hangs in them (no word from the process
for ``2 * timeout_s + piece_seconds``: it is killed) ends the read with a VideoError that says
so; the server and its other streams go on. ``mminfer watch`` reads in its own process
(:class:`LiveSource`), as does a server whose sandbox is off (``MMINFER_DECODE_SANDBOX=0``).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass

import av
import numpy as np

from mminfer.errors import VideoError
from mminfer.video import sandbox, wire

# the child's word of progress while data arrives: at most this often (seconds)
PROGRESS_S = 0.5
# media a source's opening reads to learn its streams (microseconds)
ANALYZE_US = 1_000_000


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
            # the streams' facts from one second of media (FFmpeg's default, five, holds a
            # live source's first piece back by as much)
            return av.open(self.url, timeout=(self.timeout_s, self.timeout_s),
                           options={"analyzeduration": str(ANALYZE_US)})
        except av.FFmpegError as e:
            raise VideoError(f"the source could not be opened: {_why(e)}",
                             reason="source") from None

    def close(self) -> None:
        """Another thread's request to stop reading: ``stop`` (given to :meth:`pieces`) is
        checked between frames, and a read waits at most ``timeout_s``."""

    def pieces(self, stop: threading.Event | None = None, on_packet=None):
        """Pieces until the source ends (or ``stop`` is set); VideoError when it cannot be
        opened or read (a stall past the timeout, corrupt data). A connection the source
        closes is its end (a live HTTP source has no length to tell a cut from an end).
        ``on_packet()``: called as each packet of the video arrives, before its decoding."""
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
                    if on_packet is not None:
                        on_packet()
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


# ------------------------------------------------------------------ in a process of its own

def open_source(url: str, fps: float, *, piece_seconds: float = 2.0, timeout_s: float = 10.0):
    """The reader of a live source the server pulls: in a decode worker process
    (:class:`SandboxedSource`), or in this one where the sandbox is off."""
    cls = SandboxedSource if sandbox.config().sandbox else LiveSource
    return cls(url, fps, piece_seconds=piece_seconds, timeout_s=timeout_s)


class SandboxedSource:
    """:class:`LiveSource` run in a decode worker process (see the module doc): the same
    ``pieces(stop)``, ``frames_read`` and ``backwards``; ``close()`` from another thread
    kills the process, which ends a read in progress at once."""

    def __init__(self, url: str, fps: float, *, piece_seconds: float = 2.0,
                 timeout_s: float = 10.0):
        self.url, self.fps = url, float(fps)
        self.piece_seconds = float(piece_seconds)
        self.timeout_s = float(timeout_s)
        self.frames_read = 0
        self.backwards = 0
        self.pid: int | None = None       # the reading process, while it runs
        self._worker = None
        self._closed = False

    @property
    def silence_s(self) -> float:
        """How long the process may send nothing before it is taken to hang: it reports
        progress whenever data arrives, and its own reads give up after ``timeout_s``."""
        return 2 * self.timeout_s + self.piece_seconds

    def _memory(self) -> int:
        """The process's memory limit past its footprint: the sandbox's margin, and the
        frames a piece keeps (and their copy for the parent) at the largest frame size."""
        cfg = sandbox.config()
        frames = math.ceil(self.fps * self.piece_seconds) + 2
        return sandbox.margin() + 2 * frames * cfg.max_frame_pixels * 3

    def close(self) -> None:
        self._closed = True
        w = self._worker
        if w is not None and w.alive():
            w.proc.kill()           # the reading thread sees the end and cleans up

    def pieces(self, stop: threading.Event | None = None):
        """As :meth:`LiveSource.pieces`; the process (one the decode pool kept started, so
        the source is opened at once) is killed when the pieces end, whatever the reason."""
        stop = stop or threading.Event()
        w = sandbox.decoder_pool().take()
        self._worker, self.pid = w, w.pid
        try:
            if self._closed:
                return
            try:
                w.wait_ready()
                w.send(("live", self.url, self.fps, self.piece_seconds, self.timeout_s,
                        self._memory()))
            except sandbox.WorkerFailed as e:
                if stop.is_set() or self._closed:
                    return
                raise VideoError(f"the source's reader could not start: {e}",
                                 reason="source") from None
            while True:
                try:
                    msg, fds = w.recv(self.silence_s, with_fds=True)
                except sandbox.WorkerFailed as e:
                    if stop.is_set() or self._closed:
                        return
                    if e.reason == "timeout":
                        raise VideoError(f"reading the source failed: its reader hung "
                                         f"(nothing from it for {self.silence_s:g} s)",
                                         reason="source") from None
                    raise VideoError(f"reading the source failed: {e.why}",
                                     reason="source") from None
                kind = msg[0]
                if kind in ("progress", "piece", "end"):
                    self.frames_read, self.backwards = int(msg[1]), int(msg[2])
                if kind == "piece":
                    piece = _received(msg, fds)
                    if stop.is_set():
                        return
                    yield piece
                    try:             # taken: the process reads on (it waited meanwhile)
                        w.send(("next",))
                    except sandbox.WorkerFailed as e:
                        if stop.is_set() or self._closed:
                            return
                        raise VideoError(f"reading the source failed: {e.why}",
                                         reason="source") from None
                elif kind == "end":
                    return
                else:
                    for fd in fds:
                        os.close(fd)
                    if kind != "progress":
                        raise VideoError("reading the source failed: its reader said "
                                         f"{kind!r}", reason="source")
        finally:
            self._worker = None
            w.kill()
            self.pid = None


def _received(msg, fds) -> Piece:
    """A piece from the reading process: ``("piece", frames_read, backwards, shape,
    next_sample, media_end)``, its frames in the memfd ``fds[0]`` (copied out; the
    descriptor closed). Anything that does not add up is an error, never a read past it."""
    try:
        _, _, _, shape, next_sample, media_end = msg
        shape = tuple(int(x) for x in shape)
        if len(shape) != 4 or shape[-1] != 3 or min(shape) < 0:
            raise ValueError(f"frames of shape {shape}")
        nbytes = math.prod(shape)
        frames = np.zeros(shape, np.uint8)
        if nbytes:
            if len(fds) != 1 or os.fstat(fds[0]).st_size < nbytes:
                raise ValueError("frames without their memory")
            with mmap.mmap(fds[0], nbytes, prot=mmap.PROT_READ) as m:
                frames[...] = np.frombuffer(m, np.uint8, nbytes).reshape(shape)
        return Piece(frames, int(next_sample), float(media_end))
    except (ValueError, TypeError, OSError) as e:
        raise VideoError(f"reading the source failed: its reader sent a malformed piece "
                         f"({e})", reason="source") from None
    finally:
        for fd in fds:
            os.close(fd)


def serve_source(sock, url: str, fps: float, piece_seconds: float, timeout_s: float) -> None:
    """The reading process's side (mminfer.video.worker, command ``live``): the source's
    pieces, progress and end sent to the parent over ``sock``, each piece once the parent
    took the one before (``("next",)``); a VideoError propagates (the worker's loop sends
    it)."""
    src = LiveSource(url, fps, piece_seconds=piece_seconds, timeout_s=timeout_s)
    last = [time.monotonic()]

    def progress():
        now = time.monotonic()
        if now - last[0] >= PROGRESS_S:
            last[0] = now
            wire.send(sock, ("progress", src.frames_read, src.backwards))

    for piece in src.pieces(on_packet=progress):
        frames = np.ascontiguousarray(piece.frames)
        fds = []
        if frames.nbytes:
            fd = os.memfd_create("mminfer-live-piece", os.MFD_CLOEXEC)
            fds.append(fd)
            os.ftruncate(fd, frames.nbytes)
            with mmap.mmap(fd, frames.nbytes) as m:
                np.frombuffer(m, np.uint8, frames.nbytes)[...] = frames.reshape(-1)
        try:
            wire.send(sock, ("piece", src.frames_read, src.backwards, frames.shape,
                             piece.next_sample, piece.media_end), fds)
        finally:
            for fd in fds:
                os.close(fd)
        msg, fds = wire.recv(sock)
        for fd in fds:
            os.close(fd)
        if msg[0] != "next":
            return
        last[0] = time.monotonic()
    wire.send(sock, ("end", src.frames_read, src.backwards))
