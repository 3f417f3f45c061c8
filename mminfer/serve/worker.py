"""The model's requests: a bounded queue in front, and up to ``max_active`` of them in progress,
taking turns on the model (mminfer.engine.scheduler).

Each admitted job runs ``Pipeline.answer`` in a thread of its own holding a scheduler Turn: a
cache hit's question or an answer's next token passes a long prefill between two of its layers
instead of waiting for the whole of it, and the prefill resumes where it stopped. One long prefill
computes at a time (the scheduler admits them in arrival order). The HTTP layer only waits:
jobs carry a ``concurrent.futures.Future`` that the event loop awaits
(``asyncio.wrap_future``). ``max_active=1`` runs them one after the other (tensor parallelism,
where every rank must make the same calls in the same order).

Queue places: a request reserves a place in the queue when it arrives (``reserve``), before
its body is read, so a full queue answers 503 at once instead of after a 500 MB upload; the
place becomes the job's (``submit``) or is given back. ``queue_size`` bounds waiting plus
reserved requests; jobs in progress are not counted.

Stopping a job: one not yet started leaves the queue at once (``Future.cancel`` and
``set_running_or_notify_cancel`` settle the race with the worker picking it up). A running
job is asked to stop through the engine's contract, ``Pipeline.answer(cancel=...)``, checked
between stages and before every decoder layer; if it is still running ``interrupt_after_s``
later (one long kernel launch: the Triton interpreter runs one as seconds of Python), it is
interrupted (mminfer.engine.interrupt). Its answer is the reason it was stopped (client
gone, deadline, shutdown).

Idle time: with a shadow monitor (serve/shadow.py), a sampled sparse request's inputs are
kept when it ends and re-run dense (on the dispatching thread) while nothing is queued,
reserved or in progress; a request that arrives drops or stops that re-run (``preempt``)
before it waits on it. Self-calibration (serve/selfcal.py) starts its steps in the same slot,
after any pending re-run. With the scheduler (``max_active`` > 1) a step runs on a thread of
its own as the scheduler's IDLE work: a request that arrives pauses it at its next check (the
step keeps its frame and goes on once every request has gone), and one that builds a prefix or
runs out of memory makes a paused step give its memory up (it runs again later). One at a
time (``max_active`` = 1) a request stops the step, which runs again from its start.

The heap the model leaves: once loaded and warmed up, everything alive is moved out of the
garbage collector's sight (``gc.freeze``). A full collection otherwise walks every object of
the model and its libraries (370,000 for the embedded model on the CPU: 0.2-0.3 s, more on a
busy machine) holding the interpreter lock, which stops the event loop with it: in one
``make loadtest`` base phase a 293 ms collection, in the model thread (the Triton
interpreter's prefill allocates enough to make one fall due), was its worst /health probe
(297 ms). ``stop`` gives the objects back to the collector.

The interpreter lock: the thread holding the model's turn is pure Python for long stretches (the Triton
interpreter runs the sparse kernels as Python on a CPU), and meanwhile every other thread
(the event loop, its executor's threads) waits for the lock at each system call it makes.
Asked to, the holder lets go within the switch interval, but CPython hands the lock to
whichever waiter runs first, so with two or more waiting one can lose round after round: at
the default 5 ms a thread beside the sparse prefill and one more waiter waited up to 136 ms
at a time (63 waits over 30 ms in two sparse answers on the 2-core machine), at 1 ms at most
54 ms (3 such waits), at 0.5 ms none over 30 ms. While a worker runs the interval is
``SWITCH_INTERVAL_S`` (0.5 ms); ``stop`` puts the previous one back. make loadtest's base
phase, worst /health probe of three runs each: 350-414 ms before, 192-520 ms with the freeze
alone, 122-247 ms (and 158-187 ms) with it at 1 ms, 33-112 ms at 0.5 ms.

The worker dies only of what leaves the model unusable (load failure, a CUDA error that
poisons the context, KeyboardInterrupt...). Then every queued job fails, the ones in progress
are stopped, new ones are refused, and ``state`` says "dead" with the reason, which
``/health`` reports as 503.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import gc
import logging
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from mminfer.engine.interrupt import Guard, Interrupted
from mminfer.engine.scheduler import Scheduler, device_drain
from mminfer.errors import (Cancelled, MMInferError, OutOfMemory, QueueFull, ShuttingDown,
                            WorkerDead)

log = logging.getLogger("mminfer.serve")

# The interpreter's switch interval while a worker runs (CPython's default: 5 ms); see the
# module doc.
SWITCH_INTERVAL_S = 0.0005


@dataclass
class Job:
    video_path: str
    question: str
    params: dict                          # keyword arguments of Pipeline.answer
    request_id: str | None = None
    cleanup: str | None = None            # a temp file to delete once nobody needs it
    release: object = None                # called (once) when nobody needs the video any more
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = 0.0                 # time.monotonic()
    started: float | None = None
    finished: float | None = None
    queue_ms: float = 0.0
    stop: MMInferError | None = None      # why it was asked to stop (its answer)
    stop_at: float | None = None
    worker: "ModelWorker | None" = None
    guard: Guard = field(default_factory=Guard)
    shadow_sampled: bool = False          # the shadow monitor asked it to keep its inputs
    on_token: object = None               # Pipeline.answer's on_token (a streamed answer)
    turn: object = None                   # its mminfer.engine.scheduler.Turn while in progress
    # other work than Pipeline.answer (a live stream's piece or question):
    # call(pipeline, turn, cancel) -> its result, run in the job's place
    call: object = None

    def cancel(self, reason: MMInferError | None = None) -> bool:
        """Stop the job: dropped at once if it has not started (True), else asked to stop
        (False; its answer becomes ``reason``)."""
        if self.future.cancel():
            if self.worker is not None:
                self.worker._remove(self)
            self.remove_file()
            return True
        if self.stop is None and not self.future.done():
            self.stop = reason or Cancelled("the request was cancelled")
            self.stop_at = time.monotonic()
            if self.worker is not None:
                self.worker._stop_running(self)
        return False

    def should_stop(self) -> bool:
        return self.stop is not None

    def remove_file(self):
        if self.cleanup:
            try:
                os.unlink(self.cleanup)
            except FileNotFoundError:
                pass
        release, self.release = self.release, None
        if release is not None:
            release()


class QueuePlace:
    """A reserved place in the queue; ``release`` it unless ``submit`` took it."""

    def __init__(self, worker: "ModelWorker"):
        self.worker = worker
        self.held = True

    def release(self):
        if self.held:
            self.held = False
            self.worker._unreserve()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the model (the CUDA context) cannot be trusted with another request."""
    if not isinstance(exc, Exception):
        return True                       # KeyboardInterrupt, SystemExit
    if type(exc).__name__ == "AcceleratorError":
        return True
    msg = str(exc)
    return any(s in msg for s in ("CUDA error", "device-side assert", "CUBLAS_STATUS",
                                  "cuDNN error", "illegal memory access"))


def _libc_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):      # not glibc (macOS, musl): nothing to trim
        return None


_malloc_trim = _libc_malloc_trim() if sys.platform.startswith("linux") else None


def release_freed_memory():
    """Hand the memory a finished request freed back to the system (glibc's ``malloc_trim``).
    On a CPU both cache tiers and every request's activations are this process's heap, and
    each request runs in a thread of its own, so glibc serves it from one of up to 8 arenas
    per core, each keeping what was freed in it (and the freed large blocks below its raised
    mmap threshold) for reuse: over long chats the resident set of ``mminfer serve`` on the CPU
    grew 90-112 MiB from its start without a trim, 44-52 MiB with it, 14 MiB of which the
    cache's entries (tests/serve/test_memory_budget.py); ``MALLOC_ARENA_MAX=2`` alone: 123 MiB.
    Idle, a trim costs 0.1 ms; after a request that freed a GiB in 8 threads, 30-40 ms."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def freeze_heap():
    """Collect once, then keep every object alive now out of later collections (see the
    module doc): a full collection then walks only what was made since, not the model."""
    gc.collect()
    gc.freeze()


def retry_after_s(recent_s, ahead: int, serving: int = 1, cap: int = 120) -> int:
    """Seconds until a queue place is likely free: the median of recent job times (a few old
    long jobs do not inflate it, as a mean would) times the jobs ahead, over the engines
    serving them, capped."""
    per_job = statistics.median(recent_s) if recent_s else 1.0
    return int(min(cap, max(1, math.ceil(per_job * max(ahead, 1) / max(1, serving)))))


def refusal(state: str, stopping: bool, error) -> MMInferError | None:
    """Why a worker in ``state`` takes no new request (WorkerDead, ShuttingDown), or None."""
    if state == "dead":
        return WorkerDead(f"the model worker is dead: {error}")
    if stopping or state == "stopped":
        return ShuttingDown("the server is shutting down")
    return None


def _memory_state() -> str:
    """The device's memory in a log line (what an out-of-memory report needs)."""
    try:
        if not torch.cuda.is_available():
            return "no CUDA device"
        free, total = torch.cuda.mem_get_info()
        return (f"device free {free / 2**30:.2f} of {total / 2**30:.2f} GiB, allocated "
                f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved "
                f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB, peak "
                f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, allocator "
                f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF') or 'default'}")
    except Exception as e:      # noqa: BLE001 - a report, best effort
        return f"memory state unknown ({e})"


# A garbage collection after an out-of-memory error that freed at least this much of the device
# is a reason to run the request again (less is noise: the allocator's own bookkeeping).
RECLAIMED_BYTES = 256 << 20


def _device_allocated() -> int:
    """Bytes PyTorch's allocator holds for live tensors on the current CUDA device (0
    without one)."""
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _is_oom(exc: BaseException) -> bool:
    """Out of memory: the request fails, the model serves on. cuBLAS reports the same as an
    allocation failure (a new request thread's first GEMM creates its handle and workspace)."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or \
        "CUBLAS_STATUS_ALLOC_FAILED" in str(exc)


class ModelWorker:
    """``load()`` returns the object with ``answer(video_path, question, **params)`` (a
    Pipeline); it runs on the dispatching thread. ``max_active``: requests in progress at once
    (each in its own thread, taking turns on the model through ``scheduler``); 1 runs them one
    after the other (and passes no ``turn`` to ``answer``). ``decode_share``: see
    mminfer.engine.scheduler.Scheduler.
    """

    def __init__(self, load, queue_size: int = 8, metrics=None, interrupt_after_s: float = 0.5,
                 shadow=None, max_active: int = 8, decode_share: float = 0.25):
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        if max_active < 1:
            raise ValueError("max_active must be >= 1")
        self._load = load
        self.queue_size = queue_size
        self.max_active = max_active
        self.metrics = metrics
        self.interrupt_after_s = interrupt_after_s
        self.shadow = shadow             # serve/shadow.ShadowMonitor, or None
        self.selfcal = None              # serve/selfcal.SelfCalibration, or None
        self.scheduler = Scheduler(decode_share)
        self.pipeline = None
        self.state = "new"               # new -> loading -> ready -> dead | stopped
        self.error: str | None = None
        self.served = 0                  # jobs run to the end (answer or error)
        self.stopped = 0                 # jobs stopped while running
        self.recent_s: collections.deque[float] = collections.deque(maxlen=32)
        self._queue: collections.deque[Job] = collections.deque()
        self._reserved = 0
        self._active: list[Job] = []     # in progress, oldest first
        self._cv = threading.Condition()
        self._ready = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._switch_was: float | None = None    # the interpreter's switch interval before
        self._fatal: BaseException | None = None
        self._idle_thread: threading.Thread | None = None    # a calibration step's (IDLE)

    # ------------------------------------------------------------------ control
    def start(self):
        if self._thread is not None:
            return
        self.state = "loading"
        self._switch_was = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_was, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._main, name="mminfer-model", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True when loaded; False on timeout or when loading failed (see ``error``)."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def begin_shutdown(self):
        """Refuse new jobs, answer the queued ones 503 and stop the ones in progress, at once:
        the HTTP server's graceful wait then sees every request answered in JSON."""
        with self._cv:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            active = list(self._active)
            self._cv.notify_all()
        self._preempt_shadow()
        for job in pending:
            self._fail(job, ShuttingDown("the server is shutting down; retry on another "
                                         "instance or after it restarts"))
        for job in active:
            job.cancel(ShuttingDown("the server is shutting down; the request was stopped"))
        self._gauges()

    def stop(self, timeout: float = 10.0):
        self.begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout)
            gc.unfreeze()                 # what the model leaves behind is collectable again
        if self._switch_was is not None:
            sys.setswitchinterval(self._switch_was)
            self._switch_was = None
        if self.state not in ("dead",):
            self.state = "stopped"
        self._gauges()

    @property
    def alive(self) -> bool:
        return self.state == "ready" and self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def running(self) -> int:
        """Jobs in progress (computing, paused or generating)."""
        return len(self._active)

    def running_job(self) -> Job | None:
        """The oldest job in progress."""
        active = self._active
        return active[0] if active else None

    def active_jobs(self) -> list:
        return list(self._active)

    def progress(self) -> dict:
        """What the jobs in progress are doing (mminfer.engine.scheduler.Scheduler.state)."""
        return self.scheduler.state()

    def retry_after(self, cap: int = 120) -> int:
        """Seconds until a queue place is likely free (:func:`retry_after_s`)."""
        return retry_after_s(self.recent_s, self.waiting + self.reserved + self.running, 1, cap)

    # ------------------------------------------------------------------ jobs
    def _refusal(self):
        return refusal(self.state, self._stopping, self.error)

    def reserve(self) -> QueuePlace:
        """A place in the queue for a request whose body is still to come; raises QueueFull,
        WorkerDead or ShuttingDown."""
        with self._cv:
            refused = self._refusal()
            if refused is not None:
                raise refused
            if len(self._queue) + self._reserved >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting); "
                                f"retry later", queue_size=self.queue_size)
            self._reserved += 1
        self._preempt_shadow()
        return QueuePlace(self)

    def _unreserve(self):
        with self._cv:
            self._reserved -= 1

    def submit(self, job: Job, place: QueuePlace | None = None) -> Job:
        """Queue a job (in ``place`` if given, else in a free place); raises QueueFull,
        WorkerDead or ShuttingDown (the caller still owns the file)."""
        with self._cv:
            refused = self._refusal()
            if refused is not None:
                raise refused
            if place is not None and place.held:
                place.held = False
                self._reserved -= 1
            elif len(self._queue) + self._reserved >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting); "
                                f"retry later", queue_size=self.queue_size)
            job.enqueued = time.monotonic()
            job.worker = self
            self._queue.append(job)
            self._cv.notify_all()
        self._preempt_shadow()
        self._gauges()
        return job

    def _remove(self, job: Job):
        with self._cv:
            try:
                self._queue.remove(job)
            except ValueError:
                pass
        self._gauges()

    # ------------------------------------------------------------------ the shadow monitor
    def _preempt_shadow(self):
        """A request arrived: no shadow re-run (nor calibration step) may stand in its way."""
        if self.shadow is not None:
            self.shadow.preempt()
        if self.selfcal is not None and (self.max_active == 1 or self._stopping):
            self.selfcal.preempt()      # with the scheduler, requests pause the step instead

    def _shadow_due(self) -> bool:
        """(Under the lock.) A shadow job waits and nothing else does; one that would be in a
        request's way is dropped here."""
        return self.shadow is not None and self.shadow.ready(
            busy=bool(self._queue or self._reserved or self._active or self._stopping))

    def _idle_due(self) -> bool:
        """(Under the lock.) Idle work is due: a shadow re-run, else a self-calibration step
        (serve/selfcal.py)."""
        if self._idle_thread is not None:         # a step is on its thread (maybe paused)
            return False
        if self._shadow_due():
            return True
        busy = bool(self._queue or self._reserved or self._active or self._stopping)
        return self.selfcal is not None and not busy and self.selfcal.ready()

    def _gauges(self):
        if self.metrics is not None:
            self.metrics.waiting.set(len(self._queue))
            self.metrics.running.set(len(self._active))
            self.metrics.worker_up.set(1 if self.state == "ready" else 0)
            progress = getattr(self.metrics, "progress", None)
            if progress is not None:
                progress(self.scheduler.state())

    def _fail(self, job: Job, exc: BaseException):
        if job.future.set_running_or_notify_cancel():
            job.future.set_exception(exc)
        job.remove_file()

    # ------------------------------------------------------------------ stopping a job
    def _stop_running(self, job: Job):
        self.scheduler.wake()             # a job paused at a step boundary looks at once
        if self.interrupt_after_s is None:
            return
        t = threading.Timer(self.interrupt_after_s, self._interrupt, args=(job,))
        t.daemon = True
        t.start()

    def _interrupt(self, job: Job):
        if job.guard.interrupt():
            log.info("job did not stop within %.1f s of being asked: interrupting it",
                     self.interrupt_after_s)

    def _run(self, job: Job):
        if job.stop is not None:           # asked to stop before it got here
            raise Cancelled("the request was cancelled before it started")
        if job.call is not None:
            return job.guard.run(job.call, self.pipeline, job.turn, job.should_stop)
        params = job.params if self.shadow is None else self.shadow.params(job, self.pipeline)
        extra = {} if job.on_token is None else {"on_token": job.on_token}
        if job.turn is not None:
            extra["turn"] = job.turn
        return job.guard.run(self.pipeline.answer, job.video_path, job.question,
                             cancel=job.should_stop, **params, **extra)

    def _run_again_after_oom(self, job: Job):
        """:meth:`_run`; a request that runs out of memory before its first token was sent
        runs once more after every idle cached prefix has left the device (moved to the host
        tier or dropped), so an allocation the room check could not foresee (free memory in
        pieces too small for a large tensor) costs that request time, not its answer. It also
        runs again where nothing was idle but a garbage collection freed device memory (at
        least ``RECLAIMED_BYTES``) that only reference cycles held. That time (the failed
        attempt and the spill) is the answer's ``retry`` stage, and in its ``ttft`` and
        ``total``: the stages still add up. Where neither freed anything, or a token was
        sent, the error stands."""
        sent, first = [], job.on_token
        t0 = time.perf_counter()
        if first is not None:
            def on_token(*args, **kwargs):
                sent.append(True)
                return first(*args, **kwargs)
            job.on_token = on_token
        try:
            try:
                return self._run(job)
            except BaseException as e:     # noqa: BLE001 - re-raised unless it is retried
                cache = getattr(self.pipeline, "video_cache", None)
                if not _is_oom(e) or sent or job.call is not None or job.stop is not None \
                        or cache is None:
                    raise
                error, e.__traceback__ = e, None   # its frames (the attempt's tensors) go
            evicted = self.scheduler.evict_idle()    # a paused calibration step's memory
            before = _device_allocated()
            gc.collect()            # device memory held only by reference cycles goes too
            reclaimed = before - _device_allocated()
            freed = cache.spill_idle()
            if freed <= 0 and not evicted and reclaimed < RECLAIMED_BYTES:
                raise error
            log.warning("request %s ran out of memory (%s); %.2f GiB of idle cached prefixes "
                        "left the device%s%s and it runs again", job.request_id,
                        str(error).splitlines()[0][:300] if str(error) else
                        type(error).__name__, freed / 2**30,
                        ", a paused calibration step gave its memory up" if evicted else "",
                        f", a garbage collection freed {reclaimed / 2**30:.2f} GiB"
                        if reclaimed >= RECLAIMED_BYTES else "")
            del error
            lost_ms = (time.perf_counter() - t0) * 1e3
            result = self._run(job)
            t = getattr(result, "timings_ms", None)
            if isinstance(t, dict) and "ttft" in t:
                result.timings_ms = {"retry": round(lost_ms, 3), **t,
                                     "ttft": round(t["ttft"] + lost_ms, 3),
                                     "total": round(t.get("total", 0.0) + lost_ms, 3)}
            return result
        finally:
            job.on_token = first

    # ------------------------------------------------------------------ threads
    def _main(self):
        try:
            try:
                self.pipeline = self._load()
            except BaseException as e:     # noqa: BLE001 - any load failure kills the worker
                self._die(f"loading the model failed: {getattr(e, 'message', None) or e}")
                log.error("model load failed: %s", e)
                return
            adapter = getattr(self.pipeline, "adapter", None)
            self.scheduler.drain = device_drain(getattr(adapter, "device", None))
            freeze_heap()
            self.state = "ready"
            self._gauges()
            self._ready.set()
            self._dispatch()
        except BaseException as e:        # noqa: BLE001 - the loop itself must not vanish
            self._die(f"{type(e).__name__}: {e}")
            log.exception("model worker died")
        finally:
            self._ready.set()
            if self.metrics is not None:
                self.metrics.running.set(0)

    def _dispatch(self):
        """Start queued jobs while fewer than ``max_active`` are in progress; run the shadow
        monitor's re-runs when nothing else is there."""
        while True:
            with self._cv:
                while not self._stopping and self._fatal is None and not (
                        self._queue and len(self._active) < self.max_active) \
                        and not self._idle_due():
                    self._cv.wait()
                if self._fatal is not None:
                    raise self._fatal
                if self._stopping:
                    break
                job = None
                if self._queue and len(self._active) < self.max_active:
                    job = self._queue.popleft()
                    if not job.future.set_running_or_notify_cancel():
                        job.remove_file()          # cancelled while queued
                        continue
                    self._active.append(job)
            if job is None:                        # idle: the shadow re-run (serve/shadow.py)
                if self.shadow is not None and self.shadow.pending:
                    self.shadow.run_pending(self.pipeline)
                elif self.max_active == 1:         # or a calibration step (serve/selfcal.py)
                    self._calibration_step()
                else:                              # as the scheduler's idle work
                    with self._cv:
                        self._idle_thread = threading.Thread(
                            target=self._idle_calibration_step, daemon=True,
                            name="mminfer-self-calibration")
                        self._idle_thread.start()
                continue
            job.started = time.monotonic()
            job.queue_ms = (job.started - job.enqueued) * 1e3
            if self.max_active > 1:
                job.turn = self.scheduler.turn(job.request_id or "", stop=job.should_stop)
            self._gauges()
            if self.max_active == 1:
                self._serve(job)                   # one at a time: on this thread
                if self._fatal is not None:
                    raise self._fatal
            else:
                threading.Thread(target=self._serve, args=(job,), daemon=True,
                                 name=f"mminfer-request-{job.request_id or ''}"[:40]).start()
        # shutting down: wait for the jobs in progress to unwind (they were asked to stop)
        deadline = time.monotonic() + 10.0
        with self._cv:
            while (self._active or self._idle_thread is not None) \
                    and time.monotonic() < deadline:
                self._cv.wait(0.1)

    def _calibration_step(self):
        """One self-calibration step in idle time. Its failure is the calibration's, never
        the server's: it is logged and self-calibration stops (requests go on, dense or with
        the config already serving); a fatal error (a poisoned CUDA context) still kills."""
        try:
            self.selfcal.run_step(self.pipeline)
        except BaseException as e:        # noqa: BLE001 - see the docstring
            if is_fatal(e):
                raise
            log.exception("self-calibration failed and stops")
            self.selfcal = None

    def _idle_calibration_step(self):
        """One self-calibration step on a thread of its own, holding the scheduler's turn as
        IDLE work: paused while requests run, evicted when one needs its memory."""
        sc = self.selfcal
        turn = self.scheduler.turn("self-calibration", stop=lambda: self._stopping)
        fatal = None
        try:
            if turn.idle():
                sc.run_step(self.pipeline, check=turn.checkpoint)
        except BaseException as e:        # noqa: BLE001 - see _calibration_step
            if is_fatal(e):
                fatal = e
            else:
                log.exception("self-calibration failed and stops")
                self.selfcal = None
        finally:
            turn.close()
            with self._cv:
                sc.steps_paused += turn.pauses
                self._idle_thread = None
                if fatal is not None and self._fatal is None:
                    self._fatal = fatal
                self._cv.notify_all()

    def _serve(self, job: Job):
        """One job, start to end (on its own thread unless ``max_active`` is 1)."""
        result, error, fatal = None, None, None
        try:
            try:
                try:
                    result = self._run_again_after_oom(job)
                except Interrupted:
                    job.guard.disarm()
                    raise Cancelled("the request was interrupted") from None
            except MMInferError as e:
                error = e
            except BaseException as e:     # noqa: BLE001
                if _is_oom(e):
                    log.warning("request %s ran out of memory (%s); %s", job.request_id,
                                str(e).splitlines()[0][:300] if str(e) else type(e).__name__,
                                _memory_state())
                    self._free_memory()
                    error = OutOfMemory("out of memory for this request; lower fps or "
                                        "max_frames")
                elif is_fatal(e):
                    error, fatal = WorkerDead(f"the model worker died: {e}"), e
                else:
                    log.exception("request failed")
                    error = e
        finally:
            if job.turn is not None:
                job.turn.close()
        if job.stop is not None:           # asked to stop: that is its answer
            result, error = None, job.stop
            self.stopped += 1
        if self.shadow is not None and result is not None and job.call is None:
            self.shadow.offer(job, result)     # takes the kept inputs off the answer
        # Book-keeping first, so whoever the answer wakes sees the file gone and the
        # job counted.
        job.finished = time.monotonic()
        self.served += 1
        self.recent_s.append(job.finished - job.started)
        job.remove_file()
        with self._cv:
            try:
                self._active.remove(job)
            except ValueError:
                pass
            if fatal is not None and self._fatal is None:
                self._fatal = fatal
            self._cv.notify_all()
        self._gauges()
        if self.metrics is not None and job.stop_at is not None:
            self.metrics.stop_latency.observe(job.finished - job.stop_at)
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)
        # after the answer is out: a trim of a big heap takes tens of ms
        release_freed_memory()

    def _free_memory(self):
        try:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:                  # noqa: BLE001 - best effort
            pass

    def _die(self, reason: str):
        with self._cv:
            self.state = "dead"
            self.error = reason
            pending = list(self._queue)
            self._queue.clear()
            active = list(self._active)
        for job in pending:
            self._fail(job, WorkerDead(f"the model worker is dead: {reason}"))
        for job in active:
            job.cancel(WorkerDead(f"the model worker is dead: {reason}"))
        self._gauges()
