"""``mminfer serve --data-parallel N``: N engine processes (one per GPU), one HTTP front end.

Each engine (dp_engine.py) is a process of its own with its own model copy, video cache and
scheduler, started with ``multiprocessing``'s spawn context and fed through one pipe. The
front end is the ordinary service (every route, budget, tenant rule, metric and the latency
report, as one server) whose model worker is a :class:`DataParallelWorker`: it has the
``ModelWorker`` interface the service uses (``reserve``/``submit``/``Job.future``/
``Job.cancel``, ``state``, the queue counts) and places each job on an engine.

Placing a job (``--dp-routing affinity``, the default): its video's key is the sha256 of the
file's bytes (a stored video's is known from its upload; an upload's is hashed off the event
loop). The front end knows which engines hold an entry for each video (every engine reports
its cached videos after each job and every half second) and which have one on the way (a
job for that video sent there and not yet answered). A job whose video is held goes to the
least loaded holder, unless that holder has more than ``--affinity-max-imbalance`` requests
in flight beyond the least loaded engine: then to the least loaded engine, which rebuilds
the prefix (counted as an ``overflow``). A new video goes to the least loaded engine
(requests in flight: queued or running there), and its next questions follow it.
``round_robin`` ignores the cache: the comparison the benchmark measures.

A live stream (live.py) lives on one engine: the job that creates it goes to the least loaded
engine (requests in flight, then streams held), and every later job naming its id
(``params["stream_id"]``: a piece, a question, its deletion) to that engine. Such a job
carries its work as a call (live_ops.py) that goes down the pipe. When the engine dies its
streams are gone, and a call naming one says so. The engines' statuses carry their streams
(listings, /metrics and /report read those); a stream's own status (``GET
/v1/streams/{id}``) is asked of its engine (``stream_status``: a ``peek`` down the pipe), the
last status answering when it cannot say in time: a pulled stream's pieces are appended by a
thread of its engine, with no job of the front end's whose end would send a status, so the
periodic statuses alone leave its GET up to ``STATUS_EVERY_S`` behind its source.

An engine that dies (its process ends: a crash, a device error, a kill) is restarted on its
GPU (again at once; after quick repeated deaths with a growing pause, at most 30 s). Its
requests are never lost: one that had not streamed any of its answer is moved once to
another engine; any other (streaming, or moved once already) is answered 503
``engine_restarted``. A request asked to stop (client gone, deadline) is answered with that
reason, and the stop reaches the engine's job.

``/health`` lists the engines (state, pid, GPU, queue, running, restarts, cached videos) and
says ``ok`` while any engine serves; ``/metrics`` adds per-engine series
(``mminfer:engine_*{engine="0"}``) to the server's, whose prefix-cache counters are the sum
over the engines (a restarted engine's counts are carried over).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import time
from types import SimpleNamespace

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mminfer.engine.cache import file_digest
from mminfer.errors import (Cancelled, ConfigError, EngineRestarted, QueueFull,
                            ShuttingDown, StreamNotFound)

from . import dp_engine
from .settings import DEFAULT_MAX_IMBALANCE
from .worker import QueuePlace, refusal, retry_after_s

log = logging.getLogger("mminfer.serve")

ROUTING_MODES = ("affinity", "round_robin")
# A loaded engine that sends no status for this long is hung (its status thread runs beside
# the model every STATUS_EVERY_S, whatever the model does): it is killed, then restarted.
HUNG_AFTER_S = 60.0
# An engine that dies within this long of being ready died quickly: restarts back off.
QUICK_DEATH_S = 60.0
MAX_RESTART_DELAY_S = 30.0
# A stream's status asked of its engine: past this its last status answers (the engine's pipe
# reader answers between the jobs' messages, within a millisecond unless it is stuck).
PEEK_TIMEOUT_S = 2.0
# Statuses asked of the engines at once; past this the last statuses answer, so clients
# polling many GETs cannot pile messages on an engine's pipe.
PEEKS_AT_ONCE = 4
# counters of an engine's video cache (summed over its lives); the rest of its stats are gauges
CACHE_COUNTERS = ("queries", "hits", "host_hits", "misses", "evictions_gpu", "evictions_host",
                  "inserted", "rejected", "build_waits", "room_waits", "tail_reads",
                  "idle_spills", "spilled_bytes", "spill_seconds")


def choose_engine(key: str | None, load: dict, holders, cached: dict, max_imbalance: int):
    """The video-affinity choice, (engine, reason), among the engines that are the keys of
    ``load`` (requests in flight on each; ties go to the earlier key): the least loaded of
    the ``holders`` (engines whose cache holds the video ``key``, or will once a request sent
    there ends) unless it has more than ``max_imbalance`` requests beyond the least loaded
    engine ("affinity", else "overflow" to the least loaded); a video held nowhere, or
    unknown (``key`` None), goes to the least loaded engine, the one caching fewer videos
    (``cached``) on a tie ("new"). ``--data-parallel``'s front end (:class:`Router`) and the
    Ray Serve request router (serve/ray_serve.py) both decide with this."""
    least = min(load, key=lambda e: (load[e], cached.get(e, 0)))
    held = [e for e in load if e in holders] if key is not None else []
    if not held:
        return least, "new"
    best = min(held, key=lambda e: load[e])
    if load[best] - load[least] > max_imbalance:
        return least, "overflow"
    return best, "affinity"


class Router:
    """Which engine a job goes to (pure bookkeeping, under the worker's lock)."""

    def __init__(self, n: int, mode: str = "affinity",
                 max_imbalance: int = DEFAULT_MAX_IMBALANCE):
        if mode not in ROUTING_MODES:
            raise ConfigError(f"--dp-routing must be one of {', '.join(ROUTING_MODES)}, "
                              f"not {mode!r}")
        if max_imbalance < 0:
            raise ConfigError("--affinity-max-imbalance must be >= 0")
        self.n, self.mode, self.max_imbalance = n, mode, int(max_imbalance)
        self.held: list[set[str]] = [set() for _ in range(n)]          # reported cached
        self.coming: list[collections.Counter] = [collections.Counter() for _ in range(n)]
        self._next = 0

    def choose(self, key: str | None, load: list[int], usable: list[int]):
        """(engine, reason) for a job whose video is ``key`` (None: unknown) among the
        ``usable`` engines, ``load[e]`` requests in flight on each; None when none is
        usable. Reasons: affinity, new, overflow, round_robin."""
        if not usable:
            return None
        if self.mode == "round_robin":
            for k in range(self.n):
                e = (self._next + k) % self.n
                if e in usable:
                    self._next = e + 1
                    return e, "round_robin"
        return choose_engine(
            key, {e: load[e] for e in usable},
            {e for e in usable if key in self.held[e] or self.coming[e][key]},
            {e: len(self.held[e]) for e in usable}, self.max_imbalance)

    def sent(self, engine: int, key: str | None):
        if key is not None:
            self.coming[engine][key] += 1

    def finished(self, engine: int, key: str | None):
        if key is not None:
            c = self.coming[engine]
            c[key] -= 1
            if c[key] <= 0:
                del c[key]

    def reported(self, engine: int, videos):
        self.held[engine] = set(videos)

    def forget(self, engine: int):
        """The engine died: its cache is gone."""
        self.held[engine] = set()
        self.coming[engine].clear()


class _Flight:
    """A job between ``submit`` and its answer: where it is."""
    __slots__ = ("id", "job", "key", "engine", "started", "streamed", "moved")

    def __init__(self, jid: int, job):
        self.id, self.job = jid, job
        self.key: str | None = None
        self.engine: int | None = None    # None: being hashed, or waiting for an engine
        self.started = False              # running on its engine
        self.streamed = False             # a piece of its answer went to the client
        self.moved = False                # moved once from an engine that died


class EngineHandle:
    """The front end's view of one engine process."""

    def __init__(self, index: int, gpu: str | None):
        self.index, self.gpu = index, gpu
        self.proc = None
        self.conn = None
        self.send_lock = threading.Lock()
        self.generation = 0
        self.state = "new"       # new -> starting -> ready -> down (-> starting ...) | stopped
        self.error: str | None = None
        self.pid: int | None = None
        self.status: dict = {}
        self.status_at: float | None = None
        self.ready_at: float | None = None
        self.restarts = 0
        self.quick_deaths = 0
        self.routed = collections.Counter()     # reason -> jobs sent here
        self.carried = collections.Counter()    # cache counters of its earlier lives
        self.flights: set[int] = set()          # jids sent here, not answered

    def send(self, *msg) -> bool:
        with self.send_lock:
            conn = self.conn
            if conn is None:
                return False
            try:
                conn.send(msg)
                return True
            except (OSError, ValueError):   # dying: its reader thread sees the end
                return False

    def cache_stats(self) -> dict:
        c = dict(self.status.get("cache") or {})
        for k in CACHE_COUNTERS:
            c[k] = c.get(k, 0) + self.carried[k]
        return c


class EngineFacts:
    """What the routes read of ``worker.pipeline``, from the first engine that loaded: the
    model's id, attention policy, device type, KV cache dtype, quantization, the adapter
    without weights (the budget's tokenizer and token layout), and the video cache's stats
    summed over the engines."""

    def __init__(self, facts: dict, worker: "DataParallelWorker"):
        self.model_id = facts.get("model_id")
        self._policy = facts.get("policy")
        self.device = SimpleNamespace(type=facts.get("device"))
        self.kv_cache_dtype = facts.get("kv_cache_dtype")
        self.quantization = facts.get("quantization")
        self.adapter = None
        if facts.get("adapter") is not None:
            try:
                self.adapter = pickle.loads(facts["adapter"])
            except Exception as e:  # noqa: BLE001 - frames and pixels are still checked
                log.warning("the engines' model adapter did not load here (%s): budgets check "
                            "frames and pixels only", e)
        self.video_cache = SimpleNamespace(stats=worker.cache_stats)

    def attention_policy(self):
        return dict(self._policy) if self._policy is not None else None


def engine_devices(n: int, device: str | None) -> list[str | None]:
    """Each engine's ``CUDA_VISIBLE_DEVICES`` (None: the CPU, or the device as given)."""
    if n < 1:
        raise ConfigError("--data-parallel must be at least 1")
    if device is not None and device != "cuda":
        if device.startswith("cuda"):
            raise ConfigError(f"--data-parallel gives each engine one GPU of its own; leave "
                              f"--device out or say cuda, not {device!r}")
        return [None] * n                   # the CPU: N processes (tests, CPU hosts)
    if not torch.cuda.is_available():
        if device == "cuda":
            raise ConfigError("--device cuda: no GPU is visible")
        return [None] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < n:
        raise ConfigError(f"--data-parallel {n} needs {n} GPUs; {len(ids)} visible")
    return ids[:n]


class FrontWorker:
    """What the front end's worker over several engines (``DataParallelWorker``: processes;
    ray_serve.RayServeWorker: Ray Serve replicas) does the same way: the queue's budget and
    places, the counts the service reads, a job's future settled. A subclass keeps its
    flights in ``_flights`` (values with ``job`` and ``started``), says how many engines
    serve (``_serving``) and their last statuses (``_statuses``), and sends a new flight on
    its way (``_new_flight`` under the lock, ``_dispatch`` after it)."""

    def _init_queue(self, settings, engines: int):
        self.queue_size = settings.queue_size * engines   # each engine's queue, as one queue
        self.max_active = settings.max_num_seqs * engines
        self.shadow = None            # the shadow monitor is the engines' business: off here
        self.selfcal = None           # so is self-calibration
        self.pipeline: EngineFacts | None = None
        self.error: str | None = None
        self.served = self.stopped = 0
        self.moved = 0                # jobs moved from an engine that died
        self.recent_s: collections.deque[float] = collections.deque(maxlen=32)
        self._metrics = None
        self._state = "new"
        self._lock = threading.Condition()
        self._ready = threading.Event()
        self._stopping = False
        self._reserved = 0
        self._flights: dict = {}

    # ------------------------------------------------------------------ metrics
    @property
    def metrics(self):
        return self._metrics

    @metrics.setter
    def metrics(self, metrics):
        self._metrics = metrics
        if metrics is not None:
            metrics.registry.register(EngineCollector(self, metrics.model))

    # ------------------------------------------------------------------ counts
    @property
    def alive(self) -> bool:
        return self.state == "ready"

    @property
    def waiting(self) -> int:
        """Jobs not running yet: being placed, waiting for an engine, or queued on one."""
        with self._lock:
            return self._queued()

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def running(self) -> int:
        with self._lock:
            return sum(1 for f in self._flights.values() if f.started)

    def active_jobs(self) -> list:
        with self._lock:
            return [f.job for f in self._flights.values() if f.started]

    def running_job(self):
        active = self.active_jobs()
        return active[0] if active else None

    def progress(self) -> dict:
        """The engines' schedulers' counts, summed."""
        out = collections.Counter()
        for st in self._statuses():
            out.update(st.get("progress") or {})
        return {"active": 0, "prefilling": 0, "paused": 0, "decoding": 0,
                "waiting_admission": 0, "switches": 0, **out}

    def retry_after(self, cap: int = 120) -> int:
        return retry_after_s(self.recent_s, self.waiting + self.reserved + self.running,
                             self._serving(), cap)

    # ------------------------------------------------------------------ jobs
    def _refusal(self):
        return refusal(self._state, self._stopping, self.error)

    def _queued(self) -> int:
        return sum(1 for f in self._flights.values() if not f.started)

    def reserve(self) -> QueuePlace:
        with self._lock:
            refused = self._refusal()
            if refused is not None:
                raise refused
            if self._queued() + self._reserved >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting); "
                                f"retry later", queue_size=self.queue_size)
            self._reserved += 1
        return QueuePlace(self)        # its release calls our _unreserve

    def _unreserve(self):
        with self._lock:
            self._reserved -= 1

    def submit(self, job, slot: QueuePlace | None = None):
        """Queue a job (in ``slot`` if given) and send it on its way."""
        with self._lock:
            refused = self._refusal()
            if refused is not None:
                raise refused
            if slot is not None and slot.held:
                slot.held = False
                self._reserved -= 1
            elif self._queued() + self._reserved >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting); "
                                f"retry later", queue_size=self.queue_size)
            job.enqueued = time.monotonic()
            job.worker = self
            f = self._new_flight(job)
        self._dispatch(f)
        return job

    def _answer(self, job, result=None, error: BaseException | None = None):
        """Settle a job's future (its file released first, as ModelWorker does)."""
        job.finished = time.monotonic()
        job.remove_file()
        fut = job.future
        if not fut.done() and not fut.running() and not fut.set_running_or_notify_cancel():
            return                                  # cancelled meanwhile
        _settle(fut, result, error)


class DataParallelWorker(FrontWorker):
    """The front end's model worker over ``n`` engine processes (see the module doc).
    ``settings``: the server's (each engine loads the model as one server would);
    ``model_path``: resolved; ``routing``: "affinity" or "round_robin"."""

    def __init__(self, settings, model_path: str, n: int, *, routing: str = "affinity",
                 max_imbalance: int = DEFAULT_MAX_IMBALANCE, log_level: str = "WARNING"):
        gpus = engine_devices(n, settings.device)
        self.s, self.model_path, self.n = settings, model_path, n
        self.router = Router(n, routing, max_imbalance)
        self.log_level = log_level
        self._init_queue(settings, n)
        self.engines = [EngineHandle(i, g) for i, g in enumerate(gpus)]
        self._by_job: dict[int, _Flight] = {}           # id(job) -> its flight
        self._parked: collections.deque[_Flight] = collections.deque()
        self.streams: dict[str, int] = {}             # live stream id -> its engine
        self.lost_streams: dict[str, str] = {}        # id -> why it is gone
        self._peeks: dict[int, tuple] = {}    # peek id -> (engine, stream id, future)
        self._ids = itertools.count(1)
        self._ctx = multiprocessing.get_context("spawn")
        self._hashers = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix="mminfer-route")

    # ------------------------------------------------------------------ control
    def start(self):
        with self._lock:
            if self._state != "new":
                return
            self._state = "loading"
        for e in self.engines:
            self._spawn(e)
        threading.Thread(target=self._watch, name="mminfer-engine-watch", daemon=True).start()

    def _watch(self):
        """Kill a loaded engine whose status stopped coming (its death path restarts it)."""
        with self._lock:
            while not self._stopping:
                self._lock.wait(HUNG_AFTER_S / 10)
                now = time.monotonic()
                for e in self.engines:
                    if e.state == "ready" and e.status_at is not None and e.proc is not None \
                            and now - e.status_at > HUNG_AFTER_S and not self._stopping:
                        log.error("engine %d (pid %s) sent no status for %.0f s: killing it",
                                  e.index, e.pid, now - e.status_at)
                        e.error = f"hung: no status for {now - e.status_at:.0f} s"
                        e.status_at = None
                        e.proc.kill()

    def _spawn(self, e: EngineHandle):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=dp_engine.main, name=f"mminfer-engine-{e.index}", daemon=True,
            args=(child, self.s, self.model_path, e.index, e.gpu, self.log_level))
        with self._lock:
            if self._stopping:
                parent.close()
                child.close()
                return
            e.generation += 1
            gen = e.generation
            e.state, e.error, e.pid, e.status = "starting", None, None, {}
        proc.start()
        child.close()         # the engine's end lives in the engine: its death ends the pipe
        with e.send_lock:
            e.proc, e.conn = proc, parent
        threading.Thread(target=self._read, args=(e, gen, parent), daemon=True,
                         name=f"mminfer-engine-{e.index}-reader").start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once every engine has loaded; False on timeout or when one failed to."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def begin_shutdown(self):
        with self._lock:
            self._stopping = True
            parked = list(self._parked)
            self._parked.clear()
            for f in parked:
                self._drop(f)
            self._lock.notify_all()
        for f in parked:
            self._answer(f.job, error=ShuttingDown(
                "the server is shutting down; retry on another instance or after it restarts"))
        for e in self.engines:
            e.send("shutdown")

    def stop(self, timeout: float = 10.0):
        self.begin_shutdown()
        deadline = time.monotonic() + timeout
        with self._lock:              # the engines answer what they held, then stop
            while self._flights and time.monotonic() < deadline:
                self._lock.wait(0.1)
            left = list(self._flights.values())
            for f in left:
                self._drop(f)
            for e in self.engines:
                e.state = "stopped"
        for f in left:
            self._answer(f.job, error=ShuttingDown("the server is shutting down; the request "
                                                   "was stopped"))
        for e in self.engines:
            e.send("stop")
        for e in self.engines:
            if e.proc is not None:
                e.proc.join(max(deadline - time.monotonic(), 1.0))
                if e.proc.is_alive():
                    log.warning("engine %d did not stop: terminating it", e.index)
                    e.proc.terminate()
                    e.proc.join(5)
            with e.send_lock:
                if e.conn is not None:
                    e.conn.close()
                    e.conn = None
        self._hashers.shutdown(wait=False, cancel_futures=True)
        if self._state != "dead":
            self._state = "stopped"
        self._ready.set()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        """new, loading, ready (an engine serves), restarting (none does: all are being
        restarted), dead (an engine failed to load at start), stopped."""
        if self._state == "ready" and not any(e.state == "ready" for e in self.engines):
            return "restarting"
        return self._state

    def _serving(self) -> int:
        return sum(1 for e in self.engines if e.state == "ready")

    def _statuses(self) -> list[dict]:
        return [e.status for e in self.engines if e.state == "ready"]

    def cache_stats(self) -> dict | None:
        """The engines' video caches, summed (``pipeline.video_cache.stats()``)."""
        total = collections.Counter()
        seen = False
        for e in self.engines:
            if e.status.get("cache") is not None or any(e.carried.values()):
                seen = True
                total.update({k: v for k, v in e.cache_stats().items()
                              if isinstance(v, (int, float))})
        return dict(total) if seen else None

    def compile_stats(self) -> dict:
        """The running engines' Triton compilations, summed (an engine started again counts
        its own from 0: its process compiles again)."""
        kernels: dict = {}
        for st in self._statuses():
            for name, k in ((st.get("compiles") or {}).get("kernels") or {}).items():
                got = kernels.setdefault(name, {"compiles": 0, "seconds": 0.0})
                got["compiles"] += k["compiles"]
                got["seconds"] += k["seconds"]
        return {"compiles": sum(k["compiles"] for k in kernels.values()),
                "seconds": sum(k["seconds"] for k in kernels.values()), "kernels": kernels}

    def engines_health(self, ids: bool = True) -> list[dict]:
        """Each engine, for /health (``ids``: with its running requests' ids)."""
        now = time.monotonic()
        out = []
        with self._lock:
            for e in self.engines:
                mine = [self._flights[j] for j in e.flights if j in self._flights]
                row = {"engine": str(e.index), "state": e.state, "pid": e.pid,
                       "gpu": e.gpu, "queue": sum(1 for f in mine if not f.started),
                       "running": sum(1 for f in mine if f.started),
                       "restarts": e.restarts, "cached_videos": len(self.router.held[e.index]),
                       "routed": dict(e.routed),
                       "status_age_s": None if e.status_at is None
                       else round(now - e.status_at, 3)}
                if e.error:
                    row["error"] = e.error
                if ids:
                    row["running_request_ids"] = [f.job.request_id for f in mine if f.started]
                out.append(row)
        return out

    # ------------------------------------------------------------------ jobs
    def _new_flight(self, job) -> _Flight:
        f = _Flight(next(self._ids), job)
        self._flights[f.id] = f
        self._by_job[id(job)] = f
        return f

    def _dispatch(self, f: _Flight):
        """Placed on an engine once its video's key is known (hashed on a thread of the front
        end: never on the event loop)."""
        self._hashers.submit(self._place_new, f)

    def _place_new(self, f: _Flight):
        try:
            f.key = None if f.job.params.get("stream_id") else file_digest(f.job.video_path)
        except OSError:
            f.key = None          # the engine's decoder says what is wrong with the path
        self._place(f)

    def forget_stream(self, stream_id: str):
        with self._lock:
            self.streams.pop(stream_id, None)

    async def stream_status(self, stream_id: str, tenant: str | None) -> dict | None:
        """The stream's status as its engine has it now (with ``engine``), for its GET (see
        the module doc); None when that cannot be had (no engine holds it, it is not ready,
        silent for PEEK_TIMEOUT_S, or PEEKS_AT_ONCE asked already): the caller answers from
        the last statuses. StreamNotFound when its engine holds no such stream of ``tenant``
        (deleted meanwhile) or died."""
        fut = concurrent.futures.Future()
        with self._lock:
            engine = self.streams.get(stream_id)
            if engine is None or self.engines[engine].state != "ready" \
                    or len(self._peeks) >= PEEKS_AT_ONCE:
                return None
            pid = next(self._ids)
            self._peeks[pid] = (engine, stream_id, fut)
        try:
            if not self.engines[engine].send("peek", pid, stream_id, tenant):
                return None
            st = await asyncio.wait_for(asyncio.wrap_future(fut), PEEK_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.info("stream %s: engine %d did not say its status in %.0f s; answering from "
                     "its last status", stream_id, engine, PEEK_TIMEOUT_S)
            return None
        finally:
            with self._lock:
                self._peeks.pop(pid, None)
        if isinstance(st, BaseException):       # the engine's log has why
            return None
        if st is None:
            raise StreamNotFound(f"no stream {stream_id!r}", stream=str(stream_id))
        return {**st, "engine": str(engine)}

    def _place(self, f: _Flight, avoid: int | None = None):
        """Send ``f`` to the engine the router picks (``avoid``: not that one), or park it
        until one is ready."""
        job = f.job
        with self._lock:
            if self._flights.get(f.id) is not f or job.future.done():
                return
            if self._stopping or job.stop is not None:
                self._drop(f)
                error = job.stop or ShuttingDown("the server is shutting down")
            else:
                usable = [e.index for e in self.engines
                          if e.state == "ready" and e.index != avoid]
                load = [len(e.flights) for e in self.engines]
                choice, error = self._choose(f, load, usable)
                if error is not None:
                    self._drop(f)
                elif choice is None:
                    self._parked.append(f)
                    return
                else:
                    engine, reason = choice
                    e = self.engines[engine]
                    f.engine, f.started, f.streamed = engine, False, False
                    e.flights.add(f.id)
                    e.routed[reason if avoid is None else "moved"] += 1
                    self.router.sent(engine, f.key)
        if error is not None:
            self._answer(job, error=error)
            return
        with e.send_lock:       # a cancel sent after this reaches the engine after it
            stopped = job.stop is not None or job.future.cancelled()
            if not stopped and e.conn is not None:
                try:
                    e.conn.send(("submit", f.id, job.video_path, job.question, job.params,
                                 job.request_id, job.on_token is not None, job.call))
                except (OSError, ValueError):
                    pass        # the engine is dying: its reader moves this flight
        if stopped:             # stopped while being placed: its engine never saw it
            with self._lock:
                self._drop(f)
            self._answer(job, error=job.stop or Cancelled("the request was cancelled"))

    def _choose(self, f: _Flight, load: list[int], usable: list[int]):
        """(Under the lock.) ``((engine, reason) or None, error or None)`` for ``f``: a live
        stream's job goes to the stream's engine (the first, its creation, to the least
        loaded one), any other where the router says."""
        sid = f.job.params.get("stream_id")
        if sid is None:
            return self.router.choose(f.key, load, usable), None
        if sid in self.lost_streams:
            return None, StreamNotFound(f"stream {sid!r} is gone: {self.lost_streams[sid]}",
                                        stream=sid)
        engine = self.streams.get(sid)
        if engine is None:                  # its creation: the least loaded engine
            if not usable:
                return None, None
            held = collections.Counter(self.streams.values())
            engine = min(usable, key=lambda e: (load[e], held[e], e))
            self.streams[sid] = engine
            return (engine, "new"), None
        return ((engine, "stream") if engine in usable else None), None

    def _drop(self, f: _Flight):
        """(Under the lock.) Forget a flight."""
        self._flights.pop(f.id, None)
        self._by_job.pop(id(f.job), None)
        if f.engine is not None:
            self.engines[f.engine].flights.discard(f.id)
            self.router.finished(f.engine, f.key)
        self._lock.notify_all()

    def _remove(self, job):
        """``Job.cancel`` of a job not started: forget it, and tell its engine."""
        with self._lock:
            f = self._by_job.get(id(job))
            if f is None:
                return
            try:
                self._parked.remove(f)
            except ValueError:
                pass
            engine = f.engine
            self._drop(f)
        if engine is not None:
            self.engines[engine].send("cancel", f.id, Cancelled("the request was cancelled"))

    def _stop_running(self, job):
        """``Job.cancel`` of a running job (``job.stop`` says why): its engine stops it."""
        with self._lock:
            f = self._by_job.get(id(job))
            if f is None:
                return
            engine = f.engine
            if engine is None:           # not on an engine (moved, waiting for one)
                try:
                    self._parked.remove(f)
                except ValueError:
                    return               # being placed: _place sees job.stop
                self._drop(f)
        if engine is None:
            self._answer(job, error=job.stop)
        else:
            self.engines[engine].send("cancel", f.id, job.stop)

    # ------------------------------------------------------------------ the engines' messages
    def _read(self, e: EngineHandle, gen: int, conn):
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:      # noqa: BLE001 - a message that did not unpickle
                log.exception("engine %d: a message could not be read", e.index)
                continue
            try:
                self._on_message(e, gen, msg)
            except Exception:      # noqa: BLE001 - one bad message must not stop the reader
                log.exception("engine %d: handling %r failed", e.index, msg[:1])
        proc = e.proc
        if proc is not None:
            proc.join(2.0)
        code = proc.exitcode if proc is not None else None
        self._died(e, gen, f"the engine process exited (exit status {code})"
                   if code is not None else "the engine process stopped answering")

    def _on_message(self, e: EngineHandle, gen: int, msg):
        kind = msg[0]
        if e.generation != gen:
            return
        if kind == "token":
            _, jid, text, token_id = msg
            f = self._flights.get(jid)
            if f is not None and f.engine == e.index and f.job.on_token is not None:
                f.streamed = True
                f.job.on_token(text, token_id)
        elif kind == "started":
            _, jid, _engine_queue_ms = msg
            with self._lock:
                f = self._flights.get(jid)
                if f is None or f.engine != e.index:
                    return
                f.started = True
            job = f.job
            job.started = time.monotonic()
            job.queue_ms = (job.started - job.enqueued) * 1e3
            if not job.future.running():
                try:
                    job.future.set_running_or_notify_cancel()
                except RuntimeError:       # answered meanwhile (the engine died, a cancel)
                    pass
        elif kind == "done":
            self._done(e, *msg[1:])
        elif kind == "status":
            st = msg[1]
            with self._lock:
                e.status, e.status_at = st, time.monotonic()
                if st.get("videos") is not None:
                    self.router.reported(e.index, st["videos"])
        elif kind == "peeked":
            _, pid, st = msg
            with self._lock:
                peek = self._peeks.get(pid)
            if peek is not None and peek[0] == e.index:
                _settle(peek[2], st)
        elif kind == "ready":
            self._engine_ready(e, msg[1])
        elif kind == "failed":
            e.error = f"loading the model failed: {msg[1]}"
            log.error("engine %d: %s", e.index, e.error)

    def _engine_ready(self, e: EngineHandle, facts: dict):
        with self._lock:
            e.state, e.pid, e.ready_at = "ready", facts.get("pid"), time.monotonic()
            if self.pipeline is None:
                self.pipeline = EngineFacts(facts, self)
            if self._state == "loading" and all(x.state == "ready" for x in self.engines):
                self._state = "ready"
                self._ready.set()
            parked = list(self._parked)
            self._parked.clear()
        if e.restarts:
            log.warning("engine %d is back (pid %s, restart %d)", e.index, e.pid, e.restarts)
        for f in parked:
            self._place(f)

    def _done(self, e: EngineHandle, jid: int, ok: bool, payload):
        with self._lock:
            f = self._flights.get(jid)
            if f is None or f.engine != e.index:
                return          # answered already (cancelled before it started, moved)
            self._drop(f)
        job = f.job
        self.served += 1
        if job.started is not None:
            self.recent_s.append(time.monotonic() - job.started)
        if job.stop is not None:               # asked to stop: that is its answer
            ok, payload = False, job.stop
            self.stopped += 1
            if self._metrics is not None and job.stop_at is not None:
                self._metrics.stop_latency.observe(time.monotonic() - job.stop_at)
        if ok:
            self._answer(job, result=payload)
        else:
            self._answer(job, error=payload)

    def _died(self, e: EngineHandle, gen: int, why: str):
        fail, move = [], []
        with self._lock:
            if e.generation != gen:
                return
            was = e.state
            with e.send_lock:
                if e.conn is not None:
                    e.conn.close()
                    e.conn = None
            if was == "stopped":
                return
            e.state = "down"
            e.error = e.error or why
            for k in CACHE_COUNTERS:
                e.carried[k] += (e.status.get("cache") or {}).get(k, 0)
            e.status = {}
            self.router.forget(e.index)
            for sid in [k for k, v in self.streams.items() if v == e.index]:
                del self.streams[sid]
                self.lost_streams[sid] = f"its engine stopped ({why})"
            peeks = [(sid, fut) for engine, sid, fut in self._peeks.values()
                     if engine == e.index]
            mine = [self._flights[j] for j in list(e.flights) if j in self._flights]
            e.flights.clear()
            for f in mine:
                f.engine = None
                if f.job.stop is not None or self._stopping:
                    self._drop(f)
                    fail.append((f, f.job.stop or ShuttingDown("the server is shutting down")))
                elif f.streamed or f.moved or self.n == 1:
                    self._drop(f)
                    fail.append((f, EngineRestarted(
                        f"the engine running this request stopped ({why}) and is being "
                        f"restarted; "
                        + ("part of the answer was already sent" if f.streamed else
                           "the request had been moved once already" if f.moved else
                           "there is no other engine") + "; retry the request",
                        engine=str(e.index))))
                else:
                    f.moved, f.started = True, False
                    move.append(f)
            initial = self._state == "loading"
            if initial:
                self._state = "dead"
                self.error = f"engine {e.index}: {e.error}"
            restart = not (initial or self._stopping)
            if e.ready_at is not None and time.monotonic() - e.ready_at > QUICK_DEATH_S:
                e.quick_deaths = 0
            else:
                e.quick_deaths += 1
            e.ready_at = None
        if was != "starting" or not initial:
            log.error("engine %d (pid %s): %s; %d request(s) moved to another engine, %d "
                      "answered 503", e.index, e.pid, why, len(move), len(fail))
        self.moved += len(move)
        for sid, fut in peeks:
            _settle(fut, error=StreamNotFound(
                f"stream {sid!r} is gone: its engine stopped ({why})", stream=sid))
        for f, err in fail:
            self._answer(f.job, error=err)
        for f in move:
            self._place(f, avoid=e.index)
        if initial:
            self._ready.set()
        if restart:
            threading.Thread(target=self._restart, args=(e, gen), daemon=True,
                             name=f"mminfer-engine-{e.index}-restart").start()

    def _restart(self, e: EngineHandle, gen: int):
        delay = 0.0 if e.quick_deaths <= 1 else \
            min(MAX_RESTART_DELAY_S, 0.5 * 2 ** (e.quick_deaths - 1))
        deadline = time.monotonic() + delay
        with self._lock:
            while not self._stopping and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            if self._stopping or e.generation != gen:
                return
            e.restarts += 1
        log.warning("restarting engine %d%s", e.index,
                    f" after {delay:.1f} s" if delay else "")
        self._spawn(e)


def _settle(fut: concurrent.futures.Future, result=None, error: BaseException | None = None):
    """Settle ``fut`` unless it was settled already (a job answered twice; a peek whose GET
    gave up on it, timed out)."""
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


class EngineCollector:
    """Per-engine series for /metrics, read at scrape time: ``mminfer:engine_up``,
    ``mminfer:engine_restarts``, ``mminfer:engine_requests_waiting`` / ``_running``,
    ``mminfer:engine_requests_routed{reason}`` and the engine's video cache's
    ``mminfer:engine_prefix_cache_queries`` / ``_hits`` and ``mminfer:engine_kv_cache_entries``,
    each labelled ``engine="0"``..."""

    def __init__(self, worker: DataParallelWorker, model: str):
        self.worker, self.model = worker, model

    def describe(self):
        return []

    def collect(self):
        w, m = self.worker, self.model
        lab = ["model_name", "engine"]
        rows = {r["engine"]: r for r in w.engines_health(ids=False)}
        up = GaugeMetricFamily("mminfer:engine_up", "1 while the engine process is loaded "
                               "and serving", labels=lab)
        restarts = CounterMetricFamily("mminfer:engine_restarts",
                                       "Times the engine process was restarted", labels=lab)
        waiting = GaugeMetricFamily("mminfer:engine_requests_waiting",
                                    "Requests sent to the engine, not running yet", labels=lab)
        running = GaugeMetricFamily("mminfer:engine_requests_running",
                                    "Requests running on the engine", labels=lab)
        routed = CounterMetricFamily(
            "mminfer:engine_requests_routed", "Requests placed on the engine, by why: affinity "
            "(its cache holds the video), new (least loaded, video not cached anywhere), "
            "overflow (the video's engine was too busy), round_robin, moved (from an engine "
            "that died)", labels=lab + ["reason"])
        queries = CounterMetricFamily("mminfer:engine_prefix_cache_queries",
                                      "The engine's video-cache lookups", labels=lab)
        hits = CounterMetricFamily("mminfer:engine_prefix_cache_hits",
                                   "The engine's video-cache hits (either tier)", labels=lab)
        entries = GaugeMetricFamily("mminfer:engine_kv_cache_entries",
                                    "Cached prefixes on the engine, per tier",
                                    labels=lab + ["tier"])
        for e in w.engines:
            k = [m, str(e.index)]
            up.add_metric(k, 1 if e.state == "ready" else 0)
            restarts.add_metric(k, e.restarts)
            row = rows.get(str(e.index), {})
            waiting.add_metric(k, row.get("queue", 0))
            running.add_metric(k, row.get("running", 0))
            for reason in ("affinity", "new", "overflow", "round_robin", "moved"):
                routed.add_metric(k + [reason], e.routed[reason])
            c = e.cache_stats()
            queries.add_metric(k, c.get("queries", 0))
            hits.add_metric(k, c.get("hits", 0))
            for tier in ("gpu", "host"):
                entries.add_metric(k + [tier], c.get(f"{tier}_entries", 0) or 0)
        yield from (up, restarts, waiting, running, routed, queries, hits, entries)
