"""Tensor parallel beyond one command: rank 0 leads, the other ranks follow.

Under ``torchrun --nproc-per-node N -m mminfer serve|batch ... --tensor-parallel N`` only
rank 0 has work to take (HTTP requests, a folder scan), but every model call is a collective
(each decoder layer all-reduces, the vision features are all-gathered): every rank must run
the same ``Pipeline.answer`` on the same inputs, and stop at the same point. So:

- **the job**: rank 0's :class:`Leader` (a Pipeline for the caller) broadcasts each answer's
  inputs — the video's path when every rank is on one host, else its bytes — with the
  question and parameters, then runs the answer; :func:`follow` on the other ranks receives
  and runs the same. Decoding is repeated on every rank (the file is small next to its
  frames); the vision tower's work is split (``parallel.FrameShards``).
- **waiting**: jobs travel over a gloo group of their own whose timeout is years, so a
  follower waits between requests for as long as the service is idle; the model's group
  keeps its own timeout for the collectives inside a request.
- **stopping a request**: every ``cancel()`` check of the answer (between stages, vision
  chunks, decoder layers, decode steps) is one all-reduce of a flag, so all ranks see the
  same verdict at the same check and raise ``Cancelled`` together. Nothing may stop rank 0
  anywhere else: its callbacks (a streamed token) are wrapped so that an error in one stops
  the request at the next check instead, and a hard interrupt (``engine.interrupt``) is not
  used (``Leader.interruptible`` is False).
- **errors**: an ``MMInferError`` comes from the inputs (a bad video, a prompt too long) and
  is raised by every rank at the same point. Anything else (out of memory, a device error)
  may hit one rank only, leaving the others inside a collective: the group is broken, and
  :class:`LockstepBroken` (a BaseException, so no ``except Exception`` carries on with a
  broken group) ends that process; torchrun then ends the others. After each job the ranks
  compare outcomes (a bounded wait): a rank that diverged breaks the group the same way.
- **shutdown**: ``Leader.close()`` sends stop and returns once every follower has read it (so
  no rank tears its groups down under a peer still reading); every follower returns from
  ``follow``. A follower whose rank 0 vanished gets a connection error from gloo and ends too.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mminfer.errors import Cancelled, MMInferError, RankFailed, ShuttingDown

log = logging.getLogger("mminfer.lockstep")

IDLE_TIMEOUT = timedelta(days=3650)     # a follower waiting for the next job
SYNC_TIMEOUT = timedelta(minutes=10)    # ranks agreeing inside and after a job
STOP = None


class LockstepBroken(BaseException):
    """The ranks no longer run the same collectives; the process must end."""


class Channel:
    """Rank 0 -> every rank: jobs (``send``/``recv``) over a gloo group that waits for years,
    and agreements (``any``, ``gather``) over one that waits a bounded time. Collective:
    every rank constructs it at the same point, after the process group exists."""

    def __init__(self, idle_timeout: timedelta = IDLE_TIMEOUT,
                 sync_timeout: timedelta = SYNC_TIMEOUT):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.jobs = dist.new_group(backend="gloo", timeout=idle_timeout)
        self.sync = dist.new_group(backend="gloo", timeout=sync_timeout)
        hosts = self.gather(socket.gethostname())
        self.one_host = len(set(hosts)) == 1

    def send(self, msg):
        dist.broadcast_object_list([msg], src=0, group=self.jobs)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.jobs)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.sync)
        return bool(t.item())

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.sync)
        return out

    def agreed(self, local=None):
        """A ``cancel`` callable whose answer is the same on every rank: True when ``local()``
        is True on any rank."""
        return lambda: self.any(bool(local is not None and local()))


def _outcome(result, error) -> tuple:
    """What every rank must have come to: the same answer, or the same kind of error."""
    if error is not None:
        return ("error", type(error).__name__)
    if hasattr(result, "answer"):
        return ("ok", result.answer, result.attention, result.tokens.get("generated"))
    return ("ok",)


def _agree_outcome(channel: Channel, seq: int, outcome: tuple):
    try:
        seen = channel.gather((seq, outcome))
    except Exception as e:     # noqa: BLE001 - a rank that never came: the group is broken
        raise LockstepBroken(f"tensor-parallel ranks did not finish job {seq} together: "
                             f"{e}") from e
    if any(s != seen[0] for s in seen):
        raise LockstepBroken(f"tensor-parallel ranks came to different outcomes of job "
                             f"{seq}: {seen}")


class Leader:
    """Rank 0's Pipeline under tensor parallelism: ``answer`` and ``warmup`` run on every
    rank (the followers run :func:`follow`); every other attribute is the Pipeline's.
    ``on_broken`` is called (once, from the thread that found out) when the group breaks;
    ``send_bytes``: ship the video's bytes instead of its path (default: only when the ranks
    are on several hosts)."""

    interruptible = False       # an interrupt between two collectives strands the others

    def __init__(self, pipe, channel: Channel | None = None, *, send_bytes: bool | None = None,
                 on_broken=None):
        self.pipe = pipe
        self.channel = channel or Channel()
        self.send_bytes = (not self.channel.one_host) if send_bytes is None else send_bytes
        self.on_broken = on_broken
        self.broken: BaseException | None = None
        self.closed = False
        self.seq = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        if name == "pipe":              # not set yet (unpickling, a failed __init__)
            raise AttributeError(name)
        return getattr(self.pipe, name)

    # ------------------------------------------------------------------ jobs
    def answer(self, video_path, question: str, *, cancel=None, **params):
        """``Pipeline.answer`` on every rank. Callable parameters (a per-token callback) stay
        on rank 0."""
        with self._lock:
            self._check_open()
            kept = {k: v for k, v in params.items() if not callable(v)}
            if self.send_bytes:
                try:
                    video = {"bytes": Path(video_path).read_bytes(),
                             "suffix": Path(video_path).suffix}
                except OSError:       # every rank then fails to open it, as rank 0 does
                    video = {"path": os.fspath(video_path)}
            else:
                video = {"path": os.path.abspath(video_path)}
            deferred: list[BaseException] = []
            local = {k: _deferring(v, deferred) for k, v in params.items() if callable(v)}
            stop = lambda: bool(deferred) or bool(cancel is not None and cancel())  # noqa: E731
            return self._run(("answer", video, question, kept),
                             lambda: self.pipe.answer(video_path, question,
                                                      cancel=self.channel.agreed(stop),
                                                      **kept, **local),
                             deferred)

    def warmup(self, **kw) -> dict:
        with self._lock:
            self._check_open()
            return self._run(("warmup", kw), lambda: self.pipe.warmup(**kw), [])

    def _run(self, job, call, deferred):
        self.seq += 1
        try:
            self.channel.send((self.seq, *job))
            failed = self.channel.gather(None)         # each follower: None, or why not
        except BaseException as e:                     # noqa: BLE001
            raise self._break(e)
        why = [f"rank {r}: {w}" for r, w in enumerate(failed) if w]
        if why:
            raise RankFailed("a tensor-parallel rank could not take this request: "
                             + "; ".join(why))
        result, error = None, None
        try:
            result = call()
        except MMInferError as e:
            error = e
        except BaseException as e:                     # noqa: BLE001
            raise self._break(e)
        try:
            _agree_outcome(self.channel, self.seq, _outcome(result, error))
        except LockstepBroken as e:
            raise self._break(e)
        if deferred:                  # a callback failed: the request stopped at a check
            raise deferred[0]
        if error is not None:
            raise error
        return result

    def _check_open(self):
        if self.broken is not None:
            raise LockstepBroken(f"the tensor-parallel group is broken: {self.broken}")
        if self.closed:
            raise ShuttingDown("the tensor-parallel ranks have been stopped")

    def _break(self, e: BaseException) -> LockstepBroken:
        first = self.broken is None
        self.broken = e
        log.error("tensor-parallel group broken (%s: %s): this process must end",
                  type(e).__name__, e)
        if first and self.on_broken is not None:
            self.on_broken()
        return e if isinstance(e, LockstepBroken) else LockstepBroken(
            f"{type(e).__name__} on rank 0 while the other ranks may be inside a collective: "
            f"{e}")

    def close(self, timeout: float = 5.0) -> bool:
        """Tell the followers to return; False when that could not be sent (a job still
        running, or the group broken): then only ending this process ends them."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            if self.closed:
                return True
            if self.broken is not None:
                return False
            self.channel.send(STOP)
            self.closed = True
            # every follower has read the stop before this rank may exit: a group torn down
            # while a peer still reads from it aborts that peer (gloo, seen under load)
            self.channel.gather("stopped")
            return True
        except Exception as e:      # noqa: BLE001 - a follower already gone
            log.warning("could not stop the tensor-parallel followers: %s", e)
            return False
        finally:
            self._lock.release()


def _deferring(fn, errors: list):
    """``fn`` whose exception is kept in ``errors`` instead of raised: rank 0 alone runs it, so
    raising would leave the other ranks inside the request."""
    def call(*args, **kwargs):
        if errors:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:      # noqa: BLE001
            errors.append(e)
            return None
    return call


def follow(pipe, channel: Channel | None = None) -> int:
    """Run rank 0's jobs on this rank until it sends stop; returns the number of jobs run.
    SIGINT and SIGTERM are noted, not obeyed (rank 0 decides when everyone stops: torchrun
    forwards a Ctrl-C to every rank at once)."""
    channel = channel or Channel()
    restore = _defer_signals()
    done = 0
    try:
        while True:
            msg = channel.recv()
            if msg is STOP:
                try:
                    channel.gather("stopped")       # rank 0's close() waits for this
                except Exception as e:              # noqa: BLE001 - rank 0 already gone
                    log.warning("rank %d: stop not acknowledged: %s", channel.rank, e)
                return done
            seq, kind, *job = msg
            if kind == "warmup":
                _follow_one(channel, seq, None, lambda: pipe.warmup(**job[0]))
            else:
                video, question, params = job
                _follow_answer(pipe, channel, seq, video, question, params)
            done += 1
    finally:
        restore()


def _follow_answer(pipe, channel, seq, video, question, params):
    tmp, why = None, None
    try:
        if "bytes" in video:
            fd, tmp = tempfile.mkstemp(prefix="mminfer-tp-", suffix=video.get("suffix", ""))
            with os.fdopen(fd, "wb") as f:
                f.write(video["bytes"])
            path = tmp
        else:
            path = video["path"]
    except Exception as e:          # noqa: BLE001 - told to rank 0, which refuses the job
        why = f"{type(e).__name__}: {e}"
    try:
        _follow_one(channel, seq, why, lambda: pipe.answer(
            path, question, cancel=channel.agreed(None), **params))
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _follow_one(channel, seq, why, call):
    failed = channel.gather(why)
    if any(failed):
        return
    result, error = None, None
    try:
        result = call()
    except MMInferError as e:       # rank 0 met the same and answers it
        error = e
    except BaseException as e:      # noqa: BLE001
        raise LockstepBroken(f"{type(e).__name__} on rank {channel.rank} while the other "
                             f"ranks may be inside a collective: {e}") from e
    if isinstance(error, Cancelled):
        log.info("rank %d: job %d stopped on every rank (%s)", channel.rank, seq, error)
    _agree_outcome(channel, seq, _outcome(result, error))


def _defer_signals():
    """Note SIGINT/SIGTERM instead of dying of them (main thread only); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def noted(signum, frame):
        log.info("signal %d: waiting for rank 0 to stop the job", signum)

    for s in old:
        signal.signal(s, noted)

    def restore():
        for s, h in old.items():
            signal.signal(s, h)
    return restore


def lead_or_follow(load, *, on_broken=None):
    """``load()`` -> a tensor-parallel Pipeline, on every rank. Rank 0 gets it back as a
    :class:`Leader`; any other rank follows rank 0's jobs until stopped and gets None."""
    pipe = load()
    if pipe.rank == 0:
        return Leader(pipe, on_broken=on_broken)
    follow(pipe)
    return None
