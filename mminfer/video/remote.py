"""The parent's side of a video decoded in a worker process (:class:`RemoteSession`), and the
choice between it and decoding in this process (:func:`session`)."""
from __future__ import annotations

import collections
import mmap
import os
import time
import weakref

import numpy as np

from mminfer.errors import UndecodableVideo, VideoError
from mminfer.video.sandbox import Pool, Worker, WorkerFailed, config, decoder_pool, margin
from mminfer.video.session import Session


def session():
    """A Session for one probe or stream: in a worker process unless the sandbox is off."""
    if not config().sandbox:
        return Session()
    return RemoteSession(decoder_pool())


class _FrameBuffer:
    """Shared memory (a ``memfd``, mapped here) the worker writes one batch of frames into."""

    __slots__ = ("id", "nbytes", "mm", "fd")

    def __init__(self, ident: int, nbytes: int):
        self.id, self.nbytes = ident, nbytes
        self.fd = os.memfd_create(f"mminfer-frames-{ident}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.mm = mmap.mmap(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise


class RemoteSession:
    """A :class:`~mminfer.video.session.Session` whose work runs in a pool worker: the same
    methods, with the worker's crash, overrun or memory exhaustion raised as
    ``UndecodableVideo``. ``next()`` returns arrays mapped from shared memory."""

    AHEAD = 2     # batches asked for before the one being handed over is taken

    def __init__(self, pool: Pool):
        self.pool = pool
        self.worker: Worker | None = None
        self.path = None
        self.backend = None
        self._pending: collections.deque = collections.deque()
        self._buffers_free: collections.deque = collections.deque()   # appended by finalizers
        self._next_buffer = 0
        self._ended = False

    # ------------------------------------------------------------------ commands
    def probe(self, path, order, kind) -> dict:
        facts = self._command("probe", path, order, kind)
        self._release(True)
        return facts

    def open(self, path, order, kind) -> dict:
        facts = self._command("open", path, order, kind)
        self.facts, self.backend = facts, facts["backend"]
        return facts

    def _command(self, op, path, order, kind):
        self.path = path
        self.worker = self.pool.acquire()
        try:
            self.worker.wait_ready()
            self.worker.send((op, path, tuple(order), kind, margin()))
            msg = self.worker.recv()
            return msg[1]
        except VideoError:
            self._release(True)
            raise
        except WorkerFailed as e:
            raise self._undecodable(e) from None
        except BaseException:
            self._release(False)
            raise

    def start(self, targets, size, batch: int) -> None:
        h, w = size or (self.facts["height"], self.facts["width"])
        self._frame = (int(h), int(w), 3)
        self._nbytes = int(batch) * h * w * 3
        # the decoder's working set: the batch at the source size, decoded (YUV and its
        # reference frames) and converted (RGB, then rotated or scaled), and the buffer mapped
        sh, sw = self.facts["height"], self.facts["width"]
        src = min(max(sh * sw, 1), config().max_frame_pixels) * 3
        extra = margin() + 4 * int(batch) * src + self._nbytes
        try:
            self.worker.send(("start", list(map(int, targets)), size, int(batch), extra))
            for _ in range(self.AHEAD):
                self._ask()
        except WorkerFailed as e:
            raise self._undecodable(e) from None

    def _ask(self):
        try:
            buf = self._buffers_free.popleft()
        except IndexError:
            buf = None
        fds = ()
        if buf is None or buf.nbytes != self._nbytes:
            buf = _FrameBuffer(self._next_buffer, self._nbytes)
            self._next_buffer += 1
            fds = (buf.fd,)
        try:
            self.worker.send(("next", buf.id, buf.nbytes), fds)
        finally:
            if fds:
                os.close(buf.fd)        # the worker has its own descriptor now
                buf.fd = -1
        self._pending.append(buf)

    def next(self):
        if not self._pending:
            return None
        buf = self._pending.popleft()
        try:
            msg = self.worker.recv()
        except VideoError:
            self._ended = True      # the worker answers "end" to what is still asked for
            raise
        except WorkerFailed as e:
            raise self._undecodable(e) from None
        if msg[0] == "end":
            self._ended = True
            return None
        _, _, shape, self.backend = msg
        flat = np.frombuffer(buf.mm, np.uint8, int(np.prod(shape)))
        # the buffer is written again only once the consumer has let go of these frames: every
        # view of them (reshape, slices) has ``flat`` as its base, so it outlives them all
        weakref.finalize(flat, self._buffers_free.append, buf)
        frames = flat.reshape(shape)
        if not self._ended:
            try:
                self._ask()
            except WorkerFailed as e:
                raise self._undecodable(e) from None
        return frames

    CLOSE_WAIT_S = 2.0   # answers still owed at close are awaited this long, then it is killed

    def close(self):
        if self.worker is None:
            return
        healthy = True
        deadline = time.monotonic() + self.CLOSE_WAIT_S
        try:
            while self._pending:        # answers still owed (a stream stopped early)
                self._pending.popleft()
                try:
                    self.worker.recv(max(deadline - time.monotonic(), 0.01))
                except VideoError:
                    pass
            self.worker.send(("close",))
        except Exception:  # noqa: BLE001 (a worker in doubt is not reused)
            healthy = False
        self._release(healthy)
        self._buffers_free.clear()

    def abort(self):
        """Kill the worker now (from another thread: a consumer that stops waiting for a
        batch); the thread waiting on it sees the worker gone."""
        w = self.worker
        if w is not None and w.proc.poll() is None:
            w.proc.kill()

    # ------------------------------------------------------------------ helpers
    def _release(self, healthy: bool):
        w, self.worker = self.worker, None
        self._pending.clear()
        if w is not None:
            self.pool.release(w, healthy)

    def _undecodable(self, e: WorkerFailed) -> UndecodableVideo:
        w, self.worker = self.worker, None
        self._pending.clear()
        if w is not None:
            w.kill()
            self.pool.release(w, False)
        return UndecodableVideo(f"{self.path} cannot be decoded: {e.why}; the file is "
                                f"corrupt, crafted or unsupported", path=self.path,
                                reason=e.reason)

