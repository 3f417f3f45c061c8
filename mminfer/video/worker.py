"""The decode worker process: ``python -m mminfer.video.worker FD [NICE]``, started by
:mod:`mminfer.video.sandbox`. One command at a time from the parent over the socket ``FD``,
each run on a :class:`~mminfer.video.session.Session` under the memory limit the parent
sets; frames are written into the shared memory the parent hands over."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import socket
import sys

import numpy as np

from mminfer.errors import VideoError
from mminfer.video import wire
from mminfer.video.live import serve_source
from mminfer.video.session import Session


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
            os.nice(nice)                            # sandbox.Config.nice
        except OSError:
            pass
    sock = socket.socket(fileno=fd)
    for lib in ("decord", "av"):                     # imported now, not in the first request
        try:
            __import__(lib)
        except ImportError:
            pass
    session = Session()
    buffers: dict[int, mmap.mmap] = {}               # frame buffer id -> its memory, mapped
    base = _vm_bytes()
    extra = 0
    wire.send(sock, ("ready", os.getpid(), base))
    while True:
        try:
            msg, fds = wire.recv(sock)
        except (EOFError, ConnectionError):
            return
        op = msg[0]
        try:
            if op in ("probe", "open"):
                _, path, order, kind, extra = msg
                _limit_memory(base, extra)
                facts = (session.probe if op == "probe" else session.open)(path, order, kind)
                wire.send(sock, ("ok", facts))
            elif op == "start":
                _, targets, size, batch, extra = msg
                _limit_memory(base, extra)
                session.start(targets, size, batch)
            elif op == "next":
                _, buf, nbytes = msg
                if fds:
                    try:
                        buffers[buf] = mmap.mmap(fds[0], nbytes)
                    finally:
                        os.close(fds[0])
                    # the buffers mapped here count against the limit, on top of the rest
                    _limit_memory(base, extra + sum(len(m) for m in buffers.values()))
                out = np.frombuffer(buffers[buf], np.uint8, nbytes)
                frames = session.next(out)
                if frames is None:
                    del out
                    wire.send(sock, ("end",))
                    continue
                if frames.nbytes > nbytes:
                    raise RuntimeError(f"a batch of {frames.nbytes} bytes for a buffer of "
                                       f"{nbytes}")
                if frames.__array_interface__["data"][0] != out.ctypes.data:
                    out[:frames.nbytes].reshape(frames.shape)[...] = frames  # not in place
                shape = frames.shape
                del frames, out
                wire.send(sock, ("batch", buf, shape, session.backend))
            elif op == "live":
                # a live source read to its end: the parent kills this process after it
                _, url, fps, piece_seconds, timeout_s, extra = msg
                _limit_memory(base, extra)
                serve_source(sock, url, fps, piece_seconds, timeout_s)
            elif op == "close":
                session.close()
                for m in buffers.values():
                    try:
                        m.close()
                    except BufferError:      # a view still alive: the collector unmaps it
                        pass
                buffers.clear()
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
            wire.send(sock, reply)
        except OSError:              # the parent has gone (or given up on us)
            return


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
