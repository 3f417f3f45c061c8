"""Video decoding in a worker process, so that no file can take the caller down.

The container parsers and decoders under decord and PyAV are C/C++ (FFmpeg's and decord's
own): a crafted header can make them abort (``std::bad_alloc`` on an MP4 whose ``stts``
sample count is forged to 2^31), allocate without bound, or loop. Every probe and decode of
``mminfer.engine.video`` therefore runs its :class:`~mminfer.engine.video.Session` in a
long-lived worker process (a fresh interpreter started with ``subprocess``: never a fork of
a parent that holds CUDA), under

* a memory limit (``RLIMIT_AS``, set per command): the worker's own footprint, plus the
  frames of the batch in flight at the source size, plus ``memory_mb`` of margin;
* a time limit: opening a file, and each batch of frames, must finish within ``timeout_s``
  of the worker starting on it (a consumer that is slow to take frames does not count).

A worker that dies (a signal, an abort), runs out of its memory or time, is killed and
replaced in the background, and the caller gets :class:`~mminfer.errors.UndecodableVideo`
(a ``VideoError``: HTTP 400, code ``bad_video``) naming the file. Frames come back through
shared memory: each batch is written by the worker into a ``memfd`` the parent maps, and the
parent hands the mapped array on without copying; the slot is reused once the consumer has
dropped the array. Nothing is named in ``/dev/shm`` or on disk, so nothing is left behind
when either side dies.

``configure(sandbox=False)`` (or ``MMINFER_DECODE_SANDBOX=0``) decodes in this process, as
before (benchmarks/decode.py measures the difference).
"""

from __future__ import annotations

import array
import collections
import ctypes
import errno
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

import mminfer
from mminfer.engine.video import Session
from mminfer.errors import UndecodableVideo, VideoError


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


def session():
    """A Session for one probe or stream: in a worker process unless the sandbox is off."""
    if not _config.sandbox:
        return Session()
    return RemoteSession(_pool)


# =========================================================================== the wire
# A message: 12 bytes (payload length, number of file descriptors, the descriptors riding
# along as SCM_RIGHTS), then the pickled payload. Only small control messages and facts
# travel here; frames go through shared memory.

_HEAD = struct.Struct("<QI")


def _send(sock, obj, fds=()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    head = _HEAD.pack(len(data), len(fds))
    if fds:
        n = sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   array.array("i", fds))])
        if n < len(head):
            sock.sendall(head[n:])
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv_exact(sock, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        _timeout(sock, deadline)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _timeout(sock, deadline):
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout
    sock.settimeout(left)


def _recv(sock, deadline: float | None = None):
    head, fds = b"", []
    while len(head) < _HEAD.size:
        _timeout(sock, deadline)
        msg, anc, _, _ = sock.recvmsg(_HEAD.size - len(head), socket.CMSG_SPACE(16))
        if not msg:
            raise EOFError
        head += msg
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[:len(data) - len(data) % 4]))
    n, _ = _HEAD.unpack(head)
    return pickle.loads(_recv_exact(sock, n, deadline)), fds


# =========================================================================== the worker

def _vm_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _limit_memory(vm: int, extra: int) -> None:
    """Let this process map at most ``vm + extra`` bytes in all (``vm``: its footprint once
    started, so earlier commands' leftovers count against the limit, not on top of it)."""
    try:
        import resource  # lazy: POSIX only
    except ImportError:         # not a POSIX system: no limit to set
        return
    if not vm:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = vm + int(extra)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG: a hung decode ends too
    except Exception:  # noqa: BLE001 (not Linux: the closed socket still ends the loop)
        pass


def main(fd: int, nice: int = 0) -> None:
    """The worker's loop: one command at a time from the parent over the socket ``fd``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the parent's to handle
    _die_with_parent()
    if nice:
        try:
            os.nice(nice)                            # Config.nice
        except OSError:
            pass
    sock = socket.socket(fileno=fd)
    for lib in ("decord", "av"):                     # imported now, not in the first request
        try:
            __import__(lib)
        except ImportError:
            pass
    session = Session()
    slots: dict[int, mmap.mmap] = {}                 # slot id -> its shared memory, mapped
    base = _vm_bytes()
    extra = 0
    _send(sock, ("ready", os.getpid(), base))
    while True:
        try:
            msg, fds = _recv(sock)
        except (EOFError, ConnectionError):
            return
        op = msg[0]
        try:
            if op in ("probe", "open"):
                _, path, order, kind, extra = msg
                _limit_memory(base, extra)
                facts = (session.probe if op == "probe" else session.open)(path, order, kind)
                _send(sock, ("ok", facts))
            elif op == "start":
                _, targets, size, batch, extra = msg
                _limit_memory(base, extra)
                session.start(targets, size, batch)
            elif op == "next":
                _, slot, nbytes = msg
                if fds:
                    try:
                        slots[slot] = mmap.mmap(fds[0], nbytes)
                    finally:
                        os.close(fds[0])
                    # the slots mapped here count against the limit, on top of the rest
                    _limit_memory(base, extra + sum(len(m) for m in slots.values()))
                out = np.frombuffer(slots[slot], np.uint8, nbytes)
                frames = session.next(out)
                if frames is None:
                    del out
                    _send(sock, ("end",))
                    continue
                if frames.nbytes > nbytes:
                    raise RuntimeError(f"a batch of {frames.nbytes} bytes for a slot of "
                                       f"{nbytes}")
                if frames.__array_interface__["data"][0] != out.ctypes.data:
                    out[:frames.nbytes].reshape(frames.shape)[...] = frames  # not in place
                shape = frames.shape
                del frames, out
                _send(sock, ("batch", slot, shape, session.backend))
            elif op == "close":
                session.close()
                for m in slots.values():
                    try:
                        m.close()
                    except BufferError:      # a view still alive: the collector unmaps it
                        pass
                slots.clear()
            else:
                raise RuntimeError(f"unknown command {op!r}")
        except VideoError as e:
            reply = ("video_error", e.message, e.details)
        except MemoryError:
            reply = ("memory", None)
        except OSError as e:
            reply = ("memory", None) if e.errno == errno.ENOMEM else \
                ("error", f"{type(e).__name__}: {e}")
        except BaseException as e:  # noqa: BLE001 (told to the parent, which retires us)
            reply = ("error", f"{type(e).__name__}: {e}")
        else:
            continue
        try:
            _send(sock, reply)
        except OSError:              # the parent has gone (or given up on us)
            return


# =========================================================================== the parent

class _Failed(Exception):
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
                [sys.executable, "-m", "mminfer.engine.decode_worker", str(child.fileno()),
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
        return bool(self.base_vm) and vm > self.base_vm + _margin() // 2

    def wait_ready(self):
        if not self.ready:
            msg, _ = self._recv(time.monotonic() + _config.start_timeout_s, "start")
            if msg[0] != "ready":
                raise _Failed("crashed", f"the decode worker said {msg!r} on starting")
            self.ready, self.base_vm = True, msg[2]

    def send(self, msg, fds=()):
        try:
            _send(self.sock, msg, fds)
        except OSError:
            raise self._death() from None

    def _recv(self, deadline, what="decode"):
        try:
            return _recv(self.sock, deadline)
        except socket.timeout:
            self.kill()
            raise _Failed("timeout", f"the decoder took longer than {_config.timeout_s:g} s"
                          if what == "decode" else "the decode worker did not start") \
                from None
        except (EOFError, OSError):
            raise self._death() from None

    def recv(self, timeout_s: float | None = None):
        t = _config.timeout_s if timeout_s is None else timeout_s
        msg, fds = self._recv(time.monotonic() + t)
        kind = msg[0]
        if kind == "video_error":
            raise VideoError(msg[1], **msg[2])
        if kind == "memory":
            raise _Failed("memory", f"the decoder needed more memory than its limit "
                          f"({_config.memory_mb:g} MiB over the frames in flight)")
        if kind == "error":
            raise _Failed("error", f"the decoder failed: {msg[1]}")
        return msg

    def _death(self) -> _Failed:
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
            return _Failed("crashed", f"the decoder crashed on it ({name})")
        return _Failed("crashed", f"the decoder exited on it (status {code})")

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


def pool() -> Pool:
    return _pool


class _Slot:
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
    """A :class:`~mminfer.engine.video.Session` whose work runs in a pool worker: the same
    methods, with the worker's crash, overrun or memory exhaustion raised as
    ``UndecodableVideo``. ``next()`` returns arrays mapped from shared memory."""

    AHEAD = 2     # batches asked for before the one being handed over is taken

    def __init__(self, pool: Pool):
        self.pool = pool
        self.worker: Worker | None = None
        self.path = None
        self.backend = None
        self._pending: collections.deque = collections.deque()
        self._slots_free: collections.deque = collections.deque()   # appended by finalizers
        self._next_slot = 0
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
            self.worker.send((op, path, tuple(order), kind, _margin()))
            msg = self.worker.recv()
            return msg[1]
        except VideoError:
            self._release(True)
            raise
        except _Failed as e:
            raise self._undecodable(e) from None
        except BaseException:
            self._release(False)
            raise

    def start(self, targets, size, batch: int) -> None:
        h, w = size or (self.facts["height"], self.facts["width"])
        self._frame = (int(h), int(w), 3)
        self._nbytes = int(batch) * h * w * 3
        # the decoder's working set: the batch at the source size, decoded (YUV and its
        # reference frames) and converted (RGB, then rotated or scaled), and the slot mapped
        sh, sw = self.facts["height"], self.facts["width"]
        src = min(max(sh * sw, 1), _config.max_frame_pixels) * 3
        extra = _margin() + 4 * int(batch) * src + self._nbytes
        try:
            self.worker.send(("start", list(map(int, targets)), size, int(batch), extra))
            for _ in range(self.AHEAD):
                self._ask()
        except _Failed as e:
            raise self._undecodable(e) from None

    def _ask(self):
        try:
            slot = self._slots_free.popleft()
        except IndexError:
            slot = None
        fds = ()
        if slot is None or slot.nbytes != self._nbytes:
            slot = _Slot(self._next_slot, self._nbytes)
            self._next_slot += 1
            fds = (slot.fd,)
        try:
            self.worker.send(("next", slot.id, slot.nbytes), fds)
        finally:
            if fds:
                os.close(slot.fd)       # the worker has its own descriptor now
                slot.fd = -1
        self._pending.append(slot)

    def next(self):
        if not self._pending:
            return None
        slot = self._pending.popleft()
        try:
            msg = self.worker.recv()
        except VideoError:
            self._ended = True      # the worker answers "end" to what is still asked for
            raise
        except _Failed as e:
            raise self._undecodable(e) from None
        if msg[0] == "end":
            self._ended = True
            return None
        _, _, shape, self.backend = msg
        flat = np.frombuffer(slot.mm, np.uint8, int(np.prod(shape)))
        # the slot is written again only once the consumer has let go of these frames: every
        # view of them (reshape, slices) has ``flat`` as its base, so it outlives them all
        weakref.finalize(flat, self._slots_free.append, slot)
        frames = flat.reshape(shape)
        if not self._ended:
            try:
                self._ask()
            except _Failed as e:
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
        self._slots_free.clear()

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

    def _undecodable(self, e: _Failed) -> UndecodableVideo:
        w, self.worker = self.worker, None
        self._pending.clear()
        if w is not None:
            w.kill()
            self.pool.release(w, False)
        return UndecodableVideo(f"{self.path} cannot be decoded: {e.why}; the file is "
                                f"corrupt, crafted or unsupported", path=self.path,
                                reason=e.reason)


def _margin() -> int:
    return int((_config.memory_mb + _config.per_core_mb * (os.cpu_count() or 1)) * 2**20)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
