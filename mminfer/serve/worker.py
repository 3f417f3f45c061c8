"""The one thread that owns the model (and its GPU), with a bounded queue in front of it.

A GPU runs one long prefill at a time well and two badly, so requests are serialized here and
the HTTP layer only waits. Jobs carry a ``concurrent.futures.Future``: the event loop awaits it
(``asyncio.wrap_future``), and cancelling a job that has not started removes it from the queue
at once (``Future.cancel`` and ``set_running_or_notify_cancel`` settle the race with the
worker picking it up). A job that has started cannot be interrupted; its result is dropped.

The worker dies only of what leaves the model unusable (load failure, a CUDA error that
poisons the context, KeyboardInterrupt...). Then every queued job fails, new ones are
refused, and ``state`` says "dead" with the reason, which ``/health`` reports as 503.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from mminfer.errors import MMInferError

log = logging.getLogger("mminfer.serve")


class ServiceUnavailable(MMInferError):
    code = "unavailable"
    http_status = 503


class QueueFull(ServiceUnavailable):
    code = "queue_full"


class WorkerDead(ServiceUnavailable):
    code = "worker_dead"


class OutOfMemory(MMInferError):
    code = "out_of_memory"
    http_status = 500


@dataclass
class Job:
    video_path: str
    question: str
    params: dict                          # keyword arguments of Pipeline.answer
    cleanup: str | None = None            # a temp file to delete once nobody needs it
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = 0.0                 # time.monotonic()
    started: float | None = None
    queue_ms: float = 0.0
    worker: "ModelWorker | None" = None

    def cancel(self) -> bool:
        """Drop the job if it has not started; True when it was dropped."""
        if not self.future.cancel():
            return False
        if self.worker is not None:
            self.worker._remove(self)
        self.remove_file()
        return True

    def remove_file(self):
        if self.cleanup:
            try:
                os.unlink(self.cleanup)
            except FileNotFoundError:
                pass


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the model (the CUDA context) cannot be trusted with another request."""
    if not isinstance(exc, Exception):
        return True                       # KeyboardInterrupt, SystemExit
    if type(exc).__name__ == "AcceleratorError":
        return True
    msg = str(exc)
    return any(s in msg for s in ("CUDA error", "device-side assert", "CUBLAS_STATUS",
                                  "cuDNN error", "illegal memory access"))


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


class ModelWorker:
    """``load()`` returns the object with ``answer(video_path, question, **params)`` (a
    Pipeline); it runs on the worker thread, so the model lives on that thread from the start.
    """

    def __init__(self, load, queue_size: int = 8, metrics=None):
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        self._load = load
        self.queue_size = queue_size
        self.metrics = metrics
        self.pipeline = None
        self.state = "new"               # new -> loading -> ready -> dead | stopped
        self.error: str | None = None
        self.served = 0                  # jobs run to the end (answer or error)
        self.mean_s = 1.0                # moving mean of a job's run time (for Retry-After)
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._ready = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control
    def start(self):
        if self._thread is not None:
            return
        self.state = "loading"
        self._thread = threading.Thread(target=self._main, name="mminfer-model", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True when loaded; False on timeout or when loading failed (see ``error``)."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def stop(self, timeout: float = 10.0):
        with self._cv:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for job in pending:
            self._fail(job, WorkerDead("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)
        if self.state not in ("dead",):
            self.state = "stopped"
        self._gauges()

    @property
    def alive(self) -> bool:
        return self.state == "ready" and self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ jobs
    def submit(self, job: Job) -> Job:
        """Queue a job; raises QueueFull or WorkerDead (the caller still owns the file)."""
        with self._cv:
            if self.state == "dead":
                raise WorkerDead(f"the model worker is dead: {self.error}")
            if self._stopping or self.state == "stopped":
                raise WorkerDead("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting); "
                                f"retry later", queue_size=self.queue_size)
            job.enqueued = time.monotonic()
            job.worker = self
            self._queue.append(job)
            self._cv.notify()
        self._gauges()
        return job

    def _remove(self, job: Job):
        with self._cv:
            try:
                self._queue.remove(job)
            except ValueError:
                pass
        self._gauges()

    def _gauges(self):
        if self.metrics is not None:
            self.metrics.waiting.set(len(self._queue))
            self.metrics.worker_up.set(1 if self.state == "ready" else 0)

    def _fail(self, job: Job, exc: BaseException):
        if job.future.set_running_or_notify_cancel():
            job.future.set_exception(exc)
        job.remove_file()

    # ------------------------------------------------------------------ thread
    def _main(self):
        try:
            try:
                self.pipeline = self._load()
            except BaseException as e:     # noqa: BLE001 - any load failure kills the worker
                self._die(f"loading the model failed: {getattr(e, 'message', None) or e}")
                log.error("model load failed: %s", e)
                return
            self.state = "ready"
            self._gauges()
            self._ready.set()
            self._loop()
        except BaseException as e:        # noqa: BLE001 - the loop itself must not vanish
            self._die(f"{type(e).__name__}: {e}")
            log.exception("model worker died")
        finally:
            self._ready.set()
            if self.metrics is not None:
                self.metrics.running.set(0)

    def _loop(self):
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
            self._gauges()
            if not job.future.set_running_or_notify_cancel():
                job.remove_file()          # cancelled while queued
                continue
            job.started = time.monotonic()
            job.queue_ms = (job.started - job.enqueued) * 1e3
            if self.metrics is not None:
                self.metrics.running.set(1)
            result, error, fatal = None, None, None
            try:
                result = self.pipeline.answer(job.video_path, job.question, **job.params)
            except MMInferError as e:
                error = e
            except BaseException as e:     # noqa: BLE001
                if _is_oom(e):
                    self._free_memory()
                    error = OutOfMemory("out of memory for this request; lower fps or "
                                        "max_frames")
                elif is_fatal(e):
                    error, fatal = WorkerDead(f"the model worker died: {e}"), e
                else:
                    log.exception("request failed")
                    error = e
            # Book-keeping first, so whoever the answer wakes sees the file gone and the
            # job counted.
            self.served += 1
            self.mean_s = 0.8 * self.mean_s + 0.2 * (time.monotonic() - job.started)
            job.remove_file()
            if self.metrics is not None:
                self.metrics.running.set(0)
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
            if fatal is not None:
                raise fatal

    def _free_memory(self):
        try:
            import torch
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
        for job in pending:
            self._fail(job, WorkerDead(f"the model worker is dead: {reason}"))
        self._gauges()
