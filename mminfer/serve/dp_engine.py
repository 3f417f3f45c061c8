"""One engine process of ``mminfer serve --data-parallel N`` (the front end is
data_parallel.py).

The process owns one model copy, its video cache and its scheduler: an ordinary
``ModelWorker`` (worker.py), fed through one ``multiprocessing`` pipe to the front end. Every
message is a tuple whose first item names it.

    front end -> engine
        ("submit", jid, video_path, question, params, request_id, stream, call)
                                       ``call``: None (Pipeline.answer), or a live stream's
                                       work (live_ops.py)
        ("cancel", jid, reason)        stop the job (dropped if queued); ``reason`` answers it
        ("peek", pid, stream_id, tenant)
                                       a live stream's status as it is now (a GET of it)
        ("shutdown",)                  answer the queued jobs 503, stop the running ones
        ("stop",)                      stop the worker and exit
    engine -> front end
        ("ready", facts)               loaded: the model's facts for the front end's routes
        ("failed", reason)             the model did not load; the process exits
        ("started", jid, queue_ms)     the job left the engine's queue and runs
        ("token", jid, text, token_id) a streamed job's answer piece, in order
        ("status", status)             queue counts, scheduler, cache stats, cached videos,
                                       live streams (their figures and statuses)
        ("done", jid, ok, payload)     the AnswerResult, or the error that answers it
        ("peeked", pid, status)        a peek's answer: the stream's status, None when this
                                       engine holds no such stream of the tenant, or the
                                       error that kept it from being read

The pipe ending (EOF) means the other side is gone: the front end restarts a dead engine; an
engine whose front end died stops. Videos are files on the host, passed by path: the front
end keeps each file until the job's "done". A ``status`` follows every job's end before its
``done``, so the front end's map of cached videos is current when the next question about
that video is placed; another goes out every ``STATUS_EVERY_S`` while the engine runs.

The device: the front end gives each engine one GPU as ``CUDA_VISIBLE_DEVICES`` (set below
before anything initialises CUDA), so each sees its GPU as ``cuda:0``.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import threading
import time

import torch
from transformers.utils import logging as hf_logging

from mminfer.errors import Cancelled, MMInferError, StreamNotFound
from mminfer.kernels import compiles

from .app import load_pipeline
from . import live_ops
from .budget import configure_decoding
from .worker import Job, ModelWorker

log = logging.getLogger("mminfer.serve")

STATUS_EVERY_S = 0.5
# The front end bounds the queue (queued and reserved requests, over every engine); an engine
# takes whatever the router sends it.
ENGINE_QUEUE = 1 << 20


class EngineWorker(ModelWorker):
    """A ModelWorker that says when each job starts running (``on_start(job)``)."""

    def __init__(self, load, *, on_start, **kw):
        super().__init__(load, **kw)
        self._on_start = on_start

    def _serve(self, job):
        self._on_start(job)
        super()._serve(job)


def light_adapter(adapter) -> bytes | None:
    """The adapter pickled without its weights: what the front end's budget checks use (the
    tokenizer, the chat template, the sampling rule, the visual token layout, the context).
    None when it does not pickle (the front end then checks frames and pixels only)."""

    def heavy(v) -> bool:
        if isinstance(v, (torch.nn.Module, torch.Tensor)):
            return True
        d = getattr(v, "__dict__", None)
        return isinstance(d, dict) and any(isinstance(x, (torch.nn.Module, torch.Tensor))
                                           for x in d.values())

    lite = copy.copy(adapter)
    for name, value in list(vars(lite).items()):
        if heavy(value):
            setattr(lite, name, None)
    try:
        return pickle.dumps(lite)
    except Exception as e:   # noqa: BLE001 - a budget without the tokenizer is still a budget
        log.warning("the model adapter does not pickle (%s): the front end checks frames and "
                    "pixels only", e)
        return None


def facts(p) -> dict:
    """What a front end's routes read of an engine's loaded pipeline
    (data_parallel.EngineFacts)."""
    return {"pid": os.getpid(), "model_id": getattr(p, "model_id", None),
            "policy": p.attention_policy() if hasattr(p, "attention_policy") else None,
            "device": getattr(getattr(p, "device", None), "type", None),
            "kv_cache_dtype": getattr(p, "kv_cache_dtype", None),
            "quantization": getattr(p, "quantization", None),
            "adapter": light_adapter(p.adapter) if getattr(p, "adapter", None) else None}


def portable(exc: BaseException) -> BaseException:
    """``exc`` as the front end can unpickle it: our errors as they are, anything else (a bug:
    the engine's log has its traceback) as a RuntimeError that names it."""
    if isinstance(exc, MMInferError):
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:        # noqa: BLE001 - an error class that does not round-trip
            pass
        out = MMInferError(exc.message, **{k: str(v) for k, v in exc.details.items()})
        out.code, out.http_status = exc.code, exc.http_status
        return out
    return RuntimeError(f"{type(exc).__name__}: {exc}")


class Engine:
    def __init__(self, conn, index: int, settings, model_path: str):

        self.conn, self.index = conn, index
        self.settings = settings
        self._send_lock = threading.Lock()
        self._status_lock = threading.Lock()
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._ids: dict[int, int] = {}            # id(job) -> jid
        self._videos: set | None = None           # the cached videos last sent
        self._stop = threading.Event()
        self.worker = EngineWorker(lambda: load_pipeline(settings, model_path),
                                   on_start=self._started, queue_size=ENGINE_QUEUE,
                                   max_active=settings.max_num_seqs,
                                   decode_share=settings.decode_share)

    # ------------------------------------------------------------ to the front end
    def send(self, *msg) -> bool:
        with self._send_lock:
            try:
                self.conn.send(msg)
                return True
            except (OSError, EOFError, ValueError):   # the front end is gone: recv ends us
                return False

    def send_status(self):
        # read and sent under one lock: a status read earlier never arrives after a later one
        with self._status_lock:
            self.send("status", self.status())

    def status(self) -> dict:
        w = self.worker
        cache = getattr(w.pipeline, "video_cache", None)
        videos = cache.videos() if cache is not None else set()
        out = {"state": w.state, "waiting": w.waiting, "running": w.running,
               "served": w.served, "stopped": w.stopped, "progress": w.progress(),
               "cache": cache.stats() if cache is not None else None, "videos": None,
               "streams": live_ops.report(w.pipeline) if w.pipeline is not None else None,
               "compiles": compiles.stats()}
        with self._lock:
            if videos != self._videos:
                self._videos = videos
                out["videos"] = sorted(videos)
        return out

    def _started(self, job: Job):
        jid = self._ids.get(id(job))
        if jid is not None:
            self.send("started", jid, round(job.queue_ms, 3))

    def _done(self, jid: int, job: Job, fut):
        with self._lock:
            self._jobs.pop(jid, None)
            self._ids.pop(id(job), None)
        self.send_status()                        # the cache as this job left it, first
        if fut.cancelled():
            self.send("done", jid, False, Cancelled("the request was cancelled"))
            return
        exc = fut.exception()
        if exc is None:
            self.send("done", jid, True, fut.result())
        else:
            self.send("done", jid, False, portable(exc))

    # ------------------------------------------------------------ from the front end
    def submit(self, jid, video_path, question, params, request_id, stream, call=None):
        on_token = None
        if stream:
            def on_token(text, token_id):
                self.send("token", jid, text, token_id)
            if call is not None:
                call = functools.partial(call, on_token=on_token)
        job = Job(video_path=video_path, question=question, params=params,
                  request_id=request_id, on_token=on_token, call=call)
        with self._lock:
            self._jobs[jid] = job
            self._ids[id(job)] = jid
        try:
            self.worker.submit(job)
        except MMInferError as e:
            with self._lock:
                self._jobs.pop(jid, None)
                self._ids.pop(id(job), None)
            self.send("done", jid, False, portable(e))
            return
        job.future.add_done_callback(lambda fut: self._done(jid, job, fut))

    def cancel(self, jid, reason):
        with self._lock:
            job = self._jobs.get(jid)
        if job is not None:
            job.cancel(reason)

    def peek(self, pid, stream_id, tenant):
        """A stream's status for the front end's GET, read here in the pipe's reader beside
        the jobs (as the status thread reads the streams, and one server's GET reads them):
        a pulled stream's pieces are appended by a thread of this engine that sends no
        message, so only the periodic statuses would carry them."""
        try:
            live = live_ops.live_of(self.worker.pipeline)
            st = live.status(live.streams.get(stream_id, tenant))
        except StreamNotFound:
            st = None
        except Exception as e:   # noqa: BLE001 - a bug: the front end answers from the reports
            log.exception("engine %d: the status of stream %s could not be read", self.index,
                          stream_id)
            st = portable(e)
        self.send("peeked", pid, st)

    def _heartbeat(self):
        while not self._stop.wait(STATUS_EVERY_S):
            self.send_status()
            if self.worker.state == "dead":       # a poisoned device: the front end restarts us
                log.error("engine %d: the model worker died (%s); exiting", self.index,
                          self.worker.error)
                os._exit(3)

    def run(self) -> int:
        w = self.worker
        w.start()
        if not w.wait_ready():
            self.send("failed", w.error or "the model did not load")
            return 1
        p = w.pipeline
        live_ops.attach(p, w, None if self.settings.stream_kv_gb is None
                        else int(self.settings.stream_kv_gb * 2**30),
                        self.settings.media_fetch_timeout_s,
                        int((self.settings.stream_host_kv_gb or 0) * 2**30))
        self.send("ready", facts(p))
        self.send_status()
        threading.Thread(target=self._heartbeat, name="mminfer-engine-status",
                         daemon=True).start()
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):          # the front end is gone
                break
            kind = msg[0]
            if kind == "submit":
                self.submit(*msg[1:])
            elif kind == "cancel":
                self.cancel(*msg[1:])
            elif kind == "peek":
                self.peek(*msg[1:])
            elif kind == "shutdown":
                w.begin_shutdown()
            elif kind == "stop":
                break
        self._stop.set()
        w.stop()
        return 0


def main(conn, settings, model_path: str, index: int, cuda_device: str | None,
         log_level: str = "WARNING"):
    """The engine process's entry point (multiprocessing spawn)."""
    if cuda_device is not None:               # before torch looks at the devices
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_device
    logging.basicConfig(level=log_level,
                        format=f"%(levelname)s %(name)s[engine {index}]: %(message)s")
    try:
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    configure_decoding(settings)
    t0 = time.monotonic()
    engine = Engine(conn, index, settings, model_path)
    code = engine.run()
    log.info("engine %d stopped after %.0f s", index, time.monotonic() - t0)
    conn.close()
    os._exit(code)     # not the interpreter's teardown: worker threads may still unwind
