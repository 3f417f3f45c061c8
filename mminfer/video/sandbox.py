"""Video decoding in a worker process, so that no file can take the caller down.

The container parsers and decoders under decord and PyAV are C/C++ (FFmpeg's and decord's
own): a crafted header can make them abort (``std::bad_alloc`` on an MP4 whose ``stts``
sample count is forged to 2^31), allocate without bound, or loop. Every probe and decode of
``mminfer.video`` therefore runs its :class:`~mminfer.video.session.Session` in a
long-lived worker process (:mod:`mminfer.video.worker`: a fresh interpreter started with
``subprocess``, never a fork of a parent that holds CUDA), under

* a memory limit (``RLIMIT_AS``, set per command): the worker's own footprint, plus the
  frames of the batch in flight at the source size, plus ``memory_mb`` of margin;
* a time limit: opening a file, and each batch of frames, must finish within ``timeout_s``
  of the worker starting on it (a consumer that is slow to take frames does not count).

A worker that dies (a signal, an abort), runs out of its memory or time, is killed and
replaced in the background, and the caller gets :class:`~mminfer.errors.UndecodableVideo`
(a ``VideoError``: HTTP 400, code ``bad_video``) naming the file. Frames come back through
shared memory: each batch is written by the worker into a ``memfd`` the parent maps, and the
parent hands the mapped array on without copying; the buffer is reused once the consumer has
dropped the array. Nothing is named in ``/dev/shm`` or on disk, so nothing is left behind
when either side dies.

Here: the settings (``configure``), one worker process seen from the parent (:class:`Worker`)
and the pool of started ones (:func:`decoder_pool`); :mod:`mminfer.video.remote` runs a session on
them. ``configure(sandbox=False)`` (or ``MMINFER_DECODE_SANDBOX=0``) decodes in this process
instead (benchmarks/decode.py measures the difference).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import mminfer
from mminfer.errors import VideoError
from mminfer.video import wire

log = logging.getLogger("mminfer.decode")


@dataclass(frozen=True)
class Config:
    sandbox: bool = field(
        default_factory=lambda: os.environ.get("MMINFER_DECODE_SANDBOX", "1") != "0")
    memory_mb: float = 1024.0   # margin over the worker's footprint and the frames in flight
    # and this much more per core: decord and FFmpeg start a thread per core, each with its
    # stack, codec context and frame-threading buffers (on a 16-core H200 machine 1 GiB of
    # margin alone let a legitimate 4096-frame file die of std::bad_alloc)
    per_core_mb: float = 256.0
    timeout_s: float = 30.0     # to open a file, and for each batch of frames
    workers: int = 2            # kept started (a stream holds one while it decodes)
    # niceness added to the parent's: below the server's own threads, so that on a saturated
    # machine a flood of crafted files (each a worker restart: an interpreter importing numpy,
    # decord and PyAV) cannot starve the event loop; on an idle machine it changes nothing
    nice: int = 5
    start_timeout_s: float = 120.0   # a new worker to import its libraries (a busy machine)
    # frames are assumed no larger than this when sizing the memory limit (a header may lie)
    max_frame_pixels: int = 7680 * 4320


_config = Config()
_lock = threading.Lock()
# what the worker process runs (``python -m``): named, never imported by the package, since
# ``-m`` on a module that ``import mminfer.video`` has loaded already would run it twice
WORKER_MODULE = "mminfer.video.worker"


def configure(**changes) -> Config:
    """Change the sandbox's settings (``Config`` fields) for every later probe and decode;
    returns the new settings. Workers already started keep running and take the new limits
    with their next command."""
    global _config
    with _lock:
        _config = replace(_config, **changes)
        return _config


def config() -> Config:
    return _config


class WorkerFailed(Exception):
    """The worker is gone or unusable (its reason for the message)."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason, self.why = reason, why


class Worker:
    """One worker process and the parent's end of its socket."""

    def __init__(self):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = os.path.dirname(os.path.dirname(os.path.abspath(mminfer.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]]
                                                      if env.get("PYTHONPATH") else []))
        env["MALLOC_ARENA_MAX"] = "2"      # threads' malloc arenas would reserve 64 MiB each
        env.pop("CUDA_VISIBLE_DEVICES", None)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(child.fileno()),
                 str(int(_config.nice))],
                pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL,
                close_fds=True)
        finally:
            child.close()
        self.sock = parent
        self.pid = self.proc.pid
        self.ready = False
        self.base_vm = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def bloated(self) -> bool:
        """Has it kept (freed but still mapped) memory beyond half its margin? Its next
        command would start with less room than the limit means: retire it."""
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return False
        return bool(self.base_vm) and vm > self.base_vm + margin() // 2

    def wait_ready(self):
        if not self.ready:
            msg, _ = self._recv(time.monotonic() + _config.start_timeout_s, "start")
            if msg[0] != "ready":
                raise WorkerFailed("crashed", f"the decode worker said {msg!r} on starting")
            self.ready, self.base_vm = True, msg[2]

    def send(self, msg, fds=()):
        try:
            wire.send(self.sock, msg, fds)
        except OSError:
            raise self._death() from None

    def _recv(self, deadline, what="decode"):
        try:
            return wire.recv(self.sock, deadline)
        except socket.timeout:
            self.kill()
            raise WorkerFailed("timeout",
                               f"the decoder took longer than {_config.timeout_s:g} s"
                               if what == "decode" else "the decode worker did not start") \
                from None
        except (EOFError, OSError):
            raise self._death() from None

    def recv(self, timeout_s: float | None = None, with_fds: bool = False):
        """The next message (and, ``with_fds``, the descriptors that came with it: the
        caller's to close); a VideoError the worker sent is raised, a failure of the worker
        is WorkerFailed."""
        t = _config.timeout_s if timeout_s is None else timeout_s
        msg, fds = self._recv(time.monotonic() + t)
        if fds and not with_fds:
            for fd in fds:
                os.close(fd)
            fds = []
        kind = msg[0]
        if kind == "video_error":
            raise VideoError(msg[1], **msg[2])
        if kind == "memory":
            raise WorkerFailed("memory", f"the decoder needed more memory than its limit "
                               f"({_config.memory_mb:g} MiB over the frames in flight)")
        if kind == "error":
            # an exception the decoding library raised without meaning to (its type and
            # text are Python internals): the server's log has them, the client a sentence
            log.warning("the decode worker failed on a file: %s", msg[1])
            raise WorkerFailed("error", "the decoding library failed on it")
        return (msg, fds) if with_fds else msg

    def _death(self) -> WorkerFailed:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        self.kill()
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return WorkerFailed("crashed", f"the decoder crashed on it ({name})")
        return WorkerFailed("crashed", f"the decoder exited on it (status {code})")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


class Pool:
    """Started workers, handed out one per probe or stream; a broken one is replaced in the
    background, so the next request finds one ready. At most ``workers + 2`` are busy at
    once: a burst of uploads waits its turn for a worker (a probe takes milliseconds) rather
    than starting an interpreter each; past ``timeout_s`` of waiting one is started anyway,
    so that a caller holding several streams open cannot deadlock."""

    def __init__(self):
        self._idle: list[Worker] = []
        self._lock = threading.Condition()
        self._busy = 0
        self._spawner = None
        self.started = 0          # workers started so far (tests watch restarts)
        self.retired = 0          # killed after a crash, an overrun or an error

    def acquire(self) -> Worker:
        deadline = time.monotonic() + _config.timeout_s
        with self._lock:
            while not self._idle and self._busy >= _config.workers + 2 \
                    and time.monotonic() < deadline:
                self._lock.wait(max(deadline - time.monotonic(), 0.01))
            self._busy += 1
            while self._idle:
                w = self._idle.pop()
                if w.alive():
                    return w
                w.kill()
        try:
            return self._start()
        except BaseException:
            self._done()
            raise

    def take(self) -> Worker:
        """A started worker for the caller to keep (a live source's reader, which runs until
        the source ends and is killed then, never given back); not counted busy, so uploads
        do not wait behind it. Another is started in the background in its place."""
        w = None
        with self._lock:
            while self._idle and w is None:
                w = self._idle.pop()
                if not w.alive():
                    w.kill()
                    w = None
        if w is None:
            w = self._start()
        self.warm()
        return w

    def _done(self):
        with self._lock:
            self._busy -= 1
            self._lock.notify()

    def _start(self) -> Worker:
        # Started from one long-lived thread: a worker's parent-death signal (PR_SET_PDEATHSIG)
        # fires when the *thread* that started it ends, and callers' threads come and go
        # (asyncio.to_thread, the warm-up thread): workers started there were killed with them
        with self._lock:
            if self._spawner is None:
                self._spawner = ThreadPoolExecutor(1, thread_name_prefix="mminfer-decode-start")
            spawner = self._spawner
        w = spawner.submit(Worker).result()
        with self._lock:
            self.started += 1
        return w

    def release(self, w: Worker, healthy: bool, busy: bool = True) -> None:
        if busy:
            self._done()
        if healthy and w.bloated():
            w.kill()
            self.warm(1)
            return
        if healthy and w.alive():
            with self._lock:
                if len(self._idle) < _config.workers:
                    self._idle.append(w)
                    self._lock.notify()
                    return
        w.kill()
        if not healthy:
            with self._lock:
                self.retired += 1
            self.warm(1)

    def warm(self, n: int | None = None) -> None:
        """Start workers in the background until ``n`` (default: ``workers``) are idle."""
        def run():
            try:
                with self._lock:
                    need = (n or _config.workers) - len(self._idle)
                for _ in range(max(need, 0)):
                    w = self._start()
                    w.wait_ready()
                    self.release(w, True, busy=False)
            except Exception:  # noqa: BLE001 (the next acquire starts one itself)
                pass
        threading.Thread(target=run, name="mminfer-decode-warm", daemon=True).start()

    def idle_pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._idle]

    def shutdown(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_pool = Pool()


def decoder_pool() -> Pool:
    return _pool


def margin() -> int:
    """Bytes a worker may map beyond its footprint and the frames in flight."""
    return int((_config.memory_mb + _config.per_core_mb * (os.cpu_count() or 1)) * 2**20)

