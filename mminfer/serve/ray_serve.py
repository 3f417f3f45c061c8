"""``mminfer serve --ray ADDRESS``: the engine as Ray Serve replicas across a cluster, behind
one HTTP front end, each video's questions sent to the replica that holds its prefix.

The replicas: a Ray Serve deployment (:class:`EngineReplica`) with one replica per GPU of the
cluster (``--ray-replicas N``; without GPUs one CPU process each). A replica is what one
``--data-parallel`` engine is: its own model copy, video cache and scheduler (an ordinary
ModelWorker). Ray Serve places the replicas on the cluster's nodes, restarts one whose
process dies or whose model worker dies (``check_health``), and routes each call with the
deployment's request router.

The front end: this process runs the ordinary service (uvicorn with the guarded HTTP protocol,
every route, budget, tenant rule, metric, the video store and the latency report, as one
server), whose model worker is a :class:`RayServeWorker` that sends each job to the
deployment through a Ray Serve ``DeploymentHandle``. Not Ray Serve's HTTP proxy with the
FastAPI app as ingress: behind that proxy the app would see the proxy's address as every
client's (the per-client connection and upload limits count client addresses), its slow-header
and connection guards would be the proxy's, and the stored videos, tenants' quotas and latency
history would be split over ingress replicas. Here they are one server's, as without Ray.

The request router (:class:`VideoAffinityRouter`, Ray Serve's request-router API) runs in the
front end's process (it is the handle's) and decides with ``data_parallel.choose_engine``,
the same function ``--data-parallel`` uses: a job's video key is the sha256 of its bytes
(a stored video's and an upload's alike); a replica holds a video when its cache reports it
(``record_routing_stats``, every ``STATS_PERIOD_S``), when a request for it is on its way there,
or when one ended there in the last ``REMEMBER_S`` (until the next reports carry it). A held
video goes to its least loaded holder unless that holder has more than
``--affinity-max-imbalance`` requests beyond the least loaded replica (Ray Serve's count of the
replica's ongoing requests), a new one to the least loaded. ``--dp-routing round_robin``
ignores the caches, for comparison.

The video bytes travel with the request, through Ray's object store: the front end puts a
video's bytes once (``ray.put``; the last ones are kept, at most ``--video-store-gb``) and
passes the reference; a replica reads the bytes only when its own spool (a local folder, by
content hash, at most ``--video-store-gb``) lacks them, so a follow-up moves no bytes. Not a
store on shared storage: it would need a file system every node mounts, which a Ray cluster
does not have by default, and a test on one host could not tell it from a local folder.

A replica that dies: a request it had not accepted yet is routed again by Ray Serve; one it
had accepted that had not streamed any of its answer is sent once more (to another replica:
the router drops a dead replica, and the retry asks to avoid it); a streaming one, or one
sent once more already, is answered 503 ``engine_restarted``. Ray Serve starts a replacement.
``/health`` lists the replicas (node, queue, running, cached videos, requests routed by
reason) and ``/metrics`` their series, as for ``--data-parallel``.

Live streams (``/v1/streams``, live.py): a stream lives on one replica, in its pipeline's
streams (live_ops.py, set up as a ``--data-parallel`` engine sets them up). Its creation goes
to the least loaded replica (fewer streams on a tie) and every later call naming it
(``params["stream_id"]``: a piece, a question, its deletion) to that replica: the front end
keeps each stream's replica and the router sends the call there alone (``pin``). A stream's
job carries its work as a call (a pickled function of the pipeline) that the replica runs in
its model worker; a piece's bytes travel with the call through the object store and the
replica runs the call on its own copy. Each replica reports its streams with its routing
stats and after every stream call (numbered: the front end keeps the latest), which live.py
reads for listings, /metrics and /report; a stream's own status (``GET /v1/streams/{id}``)
is asked of its replica (``peek``, not counted as a request routed), the reports answering
only when it cannot say. A replica that dies takes its streams: a
call running there is answered 404 ``stream_not_found`` saying so (503 ``engine_restarted``
when part of a streamed answer was sent), as is every later call naming one. Such a call is
never sent once more (no other replica holds the stream); one that Ray Serve routes again
before the router has dropped the dead replica lands on another, which answers that it holds
no such stream (404). A pulled stream's source is read by its replica (its node must reach
the source: the front end checks the source against the operator's flags, as one server
does, and the replica opens it), whose own thread appends the pieces, with no call of the
front end's: hence a status asked of the replica, whose reports are a period or more behind.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import importlib
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RequestCancelledError
from ray.serve.request_router import RequestRouter

from mminfer.engine.cache import file_digest
from mminfer.errors import (Cancelled, ConfigError, EngineRestarted, InputError, MMInferError,
                            ShuttingDown, StreamNotFound)

from . import live_ops
from .app import load_pipeline
from .budget import configure_decoding
from .data_parallel import (CACHE_COUNTERS, ROUTING_MODES, EngineFacts, FrontWorker,
                            choose_engine)
from .dp_engine import ENGINE_QUEUE, EngineWorker, facts, portable
from .settings import DEFAULT_MAX_IMBALANCE
from .worker import Job

log = logging.getLogger("mminfer.serve")

APP = "mminfer"                 # the Ray Serve application's name
LOST_STREAMS_KEPT = 4096       # streams whose replica died, kept with why (newest)
STATS_PERIOD_S = 1.0            # how often each replica reports its cached videos
PEEK_TIMEOUT_S = 2.0            # a stream's status asked of its replica: the reports past it
# statuses asked of replicas at once: each holds a thread of the event loop's executor (which
# parses other clients' JSON bodies) for up to PEEK_TIMEOUT_S; past this the reports answer
PEEKS_AT_ONCE = 4
REMEMBER_S = 5 * STATS_PERIOD_S
# The routers of this process by application name: the router lives in the process that
# holds the handle (the front end), which reads what it routed where for /health and /metrics.
ROUTERS: dict[str, "VideoAffinityRouter"] = {}


def routers() -> dict:
    """This module's ROUTERS, from anywhere: Ray Serve pickles a request router's module by
    value (RequestRouterConfig), so the router's methods see a copy of these globals."""
    return importlib.import_module(__name__).ROUTERS


# ---------------------------------------------------------------------------- the router
class VideoAffinityRouter(RequestRouter):
    """Ray Serve's request router for :class:`EngineReplica` (see the module doc). A call's
    first argument is the request dict: ``video_key`` (sha256, or None), ``avoid`` (a
    replica's id: a retry after that replica died) and ``token`` (the front end's name for
    the call, to find where it went); a live stream's call has ``stream_id``, ``pin`` (the
    id of the replica that holds the stream; None: its creation) and ``streams`` (replica id
    -> streams it holds, the creation's tie-break); ``peek``: a read of a stream's status,
    sent to its replica and not counted as a request routed."""

    def initialize_state(self, mode: str = "affinity",
                         max_imbalance: int = DEFAULT_MAX_IMBALANCE, app: str = APP):
        if mode not in ROUTING_MODES:
            raise ConfigError(f"--dp-routing must be one of {', '.join(ROUTING_MODES)}")
        self.mode, self.max_imbalance = mode, int(max_imbalance)
        self.lock = threading.Lock()        # the front end reads ``routed`` from its threads
        self.inflight = collections.defaultdict(collections.Counter)   # rid -> key -> n
        self.ended = collections.defaultdict(dict)                    # rid -> key -> when
        self.requests: dict[str, tuple] = {}       # internal request id -> (rid, key, reason)
        self.routed = collections.defaultdict(collections.Counter)    # replica -> reason -> n
        # the request's ``token`` -> the replica it went to (the last ones): where a retry
        # after a replica's death must not go, which the front end cannot see otherwise
        self.placed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._next = 0
        routers()[app] = self

    def held(self, replica, now: float) -> set:
        """The videos ``replica`` holds or is about to."""
        rid = replica.replica_id
        out = set((replica.routing_stats or {}).get("videos") or ())
        out.update(k for k, n in self.inflight[rid].items() if n > 0)
        ended = self.ended[rid]
        for k, t in list(ended.items()):
            if now - t < REMEMBER_S:
                out.add(k)
            else:
                del ended[k]
        return out

    def load(self, replica) -> int:
        """Requests ongoing on ``replica``: Ray Serve's count (kept by every send and end, and
        the replica's answers to its probes), else the ones this router sent there."""
        n = self.replica_queue_len_cache.get(replica.replica_id)
        return n if n is not None else sum(self.inflight[replica.replica_id].values())

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        req = pending_request.args[0] if pending_request is not None and \
            pending_request.args and isinstance(pending_request.args[0], dict) else {}
        key, avoid = req.get("video_key"), req.get("avoid")
        cands = [r for r in candidate_replicas if r.replica_id.unique_id != avoid] \
            or list(candidate_replicas)
        load = {r.replica_id: self.load(r) for r in cands}
        pin = req.get("pin")
        home = [r for r in cands if r.replica_id.unique_id == pin] if pin else []
        if home:           # a stream's call: only its replica holds it
            if pending_request is not None and not req.get("peek"):
                self._note(pending_request, home[0].replica_id, None, "stream", req.get("token"))
            return [[home[0]]]
        if req.get("peek"):     # its replica is gone: another says it holds no such stream
            return [cands]
        if "stream_id" in req:
            # a creation goes to the least loaded replica, the one holding fewer streams on
            # a tie; a call whose replica is gone goes there too, and is answered that the
            # stream is not found
            held = req.get("streams") or {}
            chosen = min(load, key=lambda r: (load[r], held.get(r.unique_id, 0)))
            reason = "new" if pin is None else "stream"
        elif self.mode == "round_robin":
            chosen, reason = cands[self._next % len(cands)].replica_id, "round_robin"
            self._next += 1
        else:
            now = time.monotonic()
            held = {r.replica_id: self.held(r, now) for r in cands}
            chosen, reason = choose_engine(key, load, {e for e, h in held.items() if key in h},
                                           {e: len(h) for e, h in held.items()},
                                           self.max_imbalance)
        if pending_request is not None and "video_key" in req:      # an answer, not facts
            self._note(pending_request, chosen, key, "moved" if avoid else reason,
                       req.get("token"))
        if "stream_id" in req:
            if pending_request is not None:
                self._note(pending_request, chosen, None, reason, req.get("token"))
            return [[r for r in cands if r.replica_id == chosen]]
        by_id = {r.replica_id: r for r in cands}
        rest = sorted((r for r in cands if r.replica_id != chosen),
                      key=lambda r: load[r.replica_id])
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def _note(self, pr, rid, key, reason, token=None):
        iid = pr.metadata.internal_request_id
        with self.lock:
            if token is not None:
                self.placed[token] = rid.unique_id
                while len(self.placed) > 4096:
                    self.placed.popitem(last=False)
            prev = self.requests.pop(iid, None)
            if prev is not None:               # chosen again (the first choice was full)
                self._undo(*prev)
            self.requests[iid] = (rid, key, reason)
            if key is not None:
                self.inflight[rid][key] += 1
            self.routed[rid.unique_id][reason] += 1

    def _undo(self, rid, key, reason):
        if key is not None:
            self.inflight[rid][key] -= 1
            if self.inflight[rid][key] <= 0:
                del self.inflight[rid][key]
        self.routed[rid.unique_id][reason] -= 1

    def on_request_routed(self, pending_request, replica_id, result):
        noted = self.requests.get(pending_request.metadata.internal_request_id)
        if noted is not None and noted[0] != replica_id:     # a later rank took it
            req = pending_request.args[0]
            self._note(pending_request, replica_id, noted[1], "overflow", req.get("token"))

    def on_request_completed(self, replica_id, internal_request_id):
        with self.lock:
            noted = self.requests.pop(internal_request_id, None)
            if noted is None or noted[1] is None:
                return
            rid, key, _ = noted
            c = self.inflight[rid]
            c[key] -= 1
            if c[key] <= 0:
                del c[key]
            self.ended[rid][key] = time.monotonic()

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self.inflight.pop(replica_id, None)
        self.ended.pop(replica_id, None)

    def update_replicas(self, replicas):
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for table in (self.inflight, self.ended):
            for rid in [r for r in table if r not in live]:
                del table[rid]

    def replicas(self) -> list:
        """(replica id, its last routing stats, reason -> requests routed) of the live ones."""
        with self.lock:
            return [(rid.unique_id, dict(r.routing_stats or {}), dict(self.routed[rid.unique_id]))
                    for rid, r in list(self.curr_replicas.items())]


# ---------------------------------------------------------------------------- the replica
class Spool:
    """A replica's local copies of the videos it was sent, by content hash, the least
    recently used deleted past ``max_bytes`` (never one a job is reading)."""

    def __init__(self, max_bytes: int):
        self.dir = Path(tempfile.mkdtemp(prefix="mminfer-ray-spool-"))
        self.max_bytes = max_bytes
        self.files: collections.OrderedDict[str, tuple[Path, int]] = collections.OrderedDict()
        self.using = collections.Counter()
        self.lock = threading.Lock()
        self.fetched = 0             # videos whose bytes came from the front end

    async def take(self, key: str, suffix: str, ref) -> str:
        with self.lock:
            if key in self.files:
                self.files.move_to_end(key)
                self.using[key] += 1
                return str(self.files[key][0])
        data = await ref
        path = self.dir / f"{key}{suffix}"
        await asyncio.to_thread(_write, path, data)
        with self.lock:
            self.fetched += 1
            self.files[key] = (path, len(data))
            self.files.move_to_end(key)
            self.using[key] += 1
            self._trim()
        return str(path)

    def release(self, key: str):
        with self.lock:
            self.using[key] -= 1
            if self.using[key] <= 0:
                del self.using[key]
            self._trim()

    def _trim(self):
        total = sum(n for _, n in self.files.values())
        for key in list(self.files):
            if total <= self.max_bytes:
                break
            if self.using[key] == 0:
                path, n = self.files.pop(key)
                path.unlink(missing_ok=True)
                total -= n

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _with_file(call, theirs: str, ours: str):
    """A stream call naming the front end's copy of its piece (``theirs``), naming this
    replica's copy instead: the call was made where the piece was received."""
    args = tuple(ours if isinstance(a, str) and a == theirs else a for a in call.args)
    return functools.partial(call.func, *args, **call.keywords)


def _write(path: Path, data: bytes):
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class EngineReplica:
    """One Ray Serve replica: the model, its video cache and scheduler (a ModelWorker, as one
    ``--data-parallel`` engine), and a :class:`Spool` of the videos sent to it."""

    def __init__(self, settings, model_path: str):
        configure_decoding(settings)
        self.id = serve.get_replica_context().replica_id.unique_id
        node = ray.get_runtime_context().get_node_id()
        self.node = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node),
                         None)          # the address the node joined the cluster with
        self.spool = Spool(int(settings.video_store_gb * 2**30))
        self._starts: dict[int, object] = {}          # id(job) -> called when it starts
        self.worker = EngineWorker(lambda: load_pipeline(settings, model_path),
                                   on_start=self._started, queue_size=ENGINE_QUEUE,
                                   max_active=settings.max_num_seqs,
                                   decode_share=settings.decode_share)
        self.worker.start()
        if not self.worker.wait_ready():
            raise RuntimeError(f"the model did not load: {self.worker.error}")
        live_ops.attach(self.worker.pipeline, self.worker,
                        None if settings.stream_kv_gb is None
                        else int(settings.stream_kv_gb * 2**30),
                        settings.media_fetch_timeout_s,
                        int((settings.stream_host_kv_gb or 0) * 2**30))
        self._seq = itertools.count(1)       # orders this replica's streams reports
        self._facts = {**facts(self.worker.pipeline), "replica": self.id, "node": self.node}

    def _started(self, job):
        call = self._starts.get(id(job))
        if call is not None:
            call()

    def facts(self) -> dict:
        return self._facts

    def record_routing_stats(self) -> dict:
        """Ray Serve hands these to the router: the videos this replica's cache holds, and
        what /health and /metrics show of it."""
        w = self.worker
        cache = getattr(w.pipeline, "video_cache", None)
        return {"videos": sorted(cache.videos()) if cache is not None else [],
                "node": self.node, "pid": os.getpid(), "waiting": w.waiting,
                "running": w.running, "served": w.served, "stopped": w.stopped,
                "fetched": self.spool.fetched, "progress": w.progress(),
                "cache": cache.stats() if cache is not None else None,
                "streams": self.streams()}

    def streams(self) -> dict:
        """The live streams this replica holds (live_ops.report), numbered: the front end
        keeps the latest of these and the ones that come with each stream call's answer."""
        return {**(live_ops.report(self.worker.pipeline) or {}), "seq": next(self._seq)}

    def stream_status(self, req: dict, tenant: str | None) -> dict | None:
        """The status of stream ``req["stream_id"]`` as it is now (the router sends this to
        the replica that holds it), None when this replica holds no such stream of
        ``tenant``. Read beside the model worker's jobs, as one server's GET reads it."""
        live = live_ops.live_of(self.worker.pipeline)
        try:
            return live.status(live.streams.get(req["stream_id"], tenant))
        except StreamNotFound:
            return None

    def check_health(self):
        if self.worker.state == "dead":     # a poisoned device: Ray Serve replaces us
            raise RuntimeError(f"the model worker died: {self.worker.error}")

    async def answer(self, req: dict):
        """Streams ("queued", replica, node), ("started", queue_ms), ("token", text, id)...
        and last ("done", ok, the AnswerResult or the error that answers it)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def put(*msg):
            loop.call_soon_threadsafe(q.put_nowait, msg)

        yield ("queued", self.id, self.node)
        on_token = (lambda text, tid: put("token", text, tid)) if req["stream"] else None
        call, key = req.get("call"), req["video_key"]
        if call is None:
            path = await self.spool.take(key, req["suffix"], req["video_ref"])
        else:                       # a live stream's work (live_ops.py), maybe with a piece
            path = ""
            if req.get("piece_ref") is not None:
                path = str(self.spool.dir / f"piece-{uuid.uuid4().hex}{req['suffix']}")
                await asyncio.to_thread(_write, Path(path), await req["piece_ref"])
                call = _with_file(call, req["piece_of"], path)
            if on_token is not None:
                call = functools.partial(call, on_token=on_token)
        job = Job(video_path=path, question=req["question"], params=req["params"],
                  request_id=req["request_id"], on_token=on_token, call=call,
                  cleanup=path if call is not None and path else None)
        self._starts[id(job)] = lambda: put("started", round(job.queue_ms, 3))
        submitted = False
        try:
            try:
                self.worker.submit(job)
            except MMInferError as e:
                yield ("done", False, portable(e))
                return
            submitted = True
            # the spool's copy is the job's until it ends (a stopped job may still read it)
            job.future.add_done_callback(lambda _: (put("end"), self._finished(job, key)))
            try:
                while True:
                    msg = await q.get()
                    if msg[0] == "end":
                        break
                    yield msg
            except (asyncio.CancelledError, GeneratorExit):   # the front end stopped it
                job.cancel(Cancelled("the request was cancelled"))
                raise
            fut = job.future
            if call is not None:          # what the streams hold after it, for the front end
                yield ("streams", self.streams())
            if fut.cancelled():
                yield ("done", False, Cancelled("the request was cancelled"))
            elif fut.exception() is not None:
                yield ("done", False, portable(fut.exception()))
            else:
                yield ("done", True, fut.result())
        finally:
            if not submitted:
                self._finished(job, key)

    def _finished(self, job, key: str | None):
        self._starts.pop(id(job), None)
        if job.call is None:
            self.spool.release(key)
        else:
            job.remove_file()

    def __del__(self):
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.stop()
        spool = getattr(self, "spool", None)
        if spool is not None:
            spool.close()


# ---------------------------------------------------------------------------- the front end
def connect(address: str):
    """Join the Ray cluster at ``address`` (``auto``: the one this machine belongs to;
    ``local``: start one here for this server)."""
    if ray.is_initialized():
        return
    if address == "local":
        ray.init(include_dashboard=False, log_to_driver=False)
        return
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        raise ConfigError(f"no Ray cluster at --ray {address} ({str(e).splitlines()[0][:200]});"
                          f" start one (ray start --head) or pass --ray local to run one on "
                          f"this machine") from None


class _Flight:
    """A job between ``submit`` and its answer."""
    __slots__ = ("job", "gen", "replica", "started", "streamed", "moved")

    def __init__(self, job):
        self.job, self.gen, self.replica = job, None, None
        self.started = self.streamed = self.moved = False


class RayServeWorker(FrontWorker):
    """The front end's model worker over the Ray Serve deployment (see the module doc): the
    ``ModelWorker`` interface the service uses, each job sent to a replica by the handle."""

    def __init__(self, settings, model_path: str, replicas: int | None = None, *,
                 address: str = "auto", routing: str = "affinity",
                 max_imbalance: int = DEFAULT_MAX_IMBALANCE, app: str = APP):
        if routing not in ROUTING_MODES:
            raise ConfigError(f"--dp-routing must be one of {', '.join(ROUTING_MODES)}, "
                              f"not {routing!r}")
        if max_imbalance < 0:
            raise ConfigError("--affinity-max-imbalance must be >= 0")
        if replicas is not None and replicas < 1:
            raise ConfigError("--ray-replicas must be at least 1")
        self.s, self.model_path, self.address, self.app = settings, model_path, address, app
        self.routing, self.max_imbalance = routing, int(max_imbalance)
        self.n = replicas
        self._init_queue(settings, replicas or 1)       # _flights: id(job) -> its flight
        self.handle = None
        self.unary_handle = None        # the same deployment, for calls with one answer
        self._peeks = threading.BoundedSemaphore(PEEKS_AT_ONCE)
        self._refs: collections.OrderedDict = collections.OrderedDict()   # key -> (ref, n)
        self._refs_lock = threading.Lock()
        self._gone = collections.Counter()      # the cache counters of replicas gone
        self._seen: dict[str, dict] = {}        # replica -> its last routing stats
        self.streams: dict[str, str] = {}             # live stream id -> its replica
        # id -> why it is gone; the newest LOST_STREAMS_KEPT (older ones answer a plain 404)
        self.lost_streams: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._stream_reports: dict[str, dict] = {}    # replica -> its last streams report
        self._runner = concurrent.futures.ThreadPoolExecutor(
            max(8, self.queue_size + self.max_active), thread_name_prefix="mminfer-ray")

    # ------------------------------------------------------------------ control
    def start(self):
        """Join the cluster on this thread (``--ray local`` starts one whose processes end
        with the thread that started them: Linux's parent-death signal follows the thread),
        then deploy the replicas in the background."""
        with self._lock:
            if self._state != "new":
                return
            self._state = "loading"
        try:
            connect(self.address)
        except Exception as e:        # noqa: BLE001 - the server's start error
            with self._lock:
                self.error, self._state = str(getattr(e, "message", e)), "dead"
            self._ready.set()
            return
        threading.Thread(target=self._deploy, name="mminfer-ray-deploy", daemon=True).start()

    def _deploy(self):
        try:
            gpus = ray.cluster_resources().get("GPU", 0)
            n = self.n or (int(gpus) if gpus >= 1 else 1)
            self.n, self.queue_size = n, self.s.queue_size * n
            self.max_active = self.s.max_num_seqs * n
            # the replicas need the model's options, not the server's keys
            replica_settings = dataclasses.replace(self.s, api_key=None, api_keys=(),
                                                   api_keys_file=None, metrics_token=None)
            deployment = serve.deployment(EngineReplica).options(
                name="engine", num_replicas=n,
                ray_actor_options={"num_gpus": 1} if gpus >= 1 else {"num_cpus": 1},
                # the front end bounds the queue; a replica takes what the router sends it
                max_ongoing_requests=ENGINE_QUEUE, health_check_period_s=2.0,
                request_router_config=RequestRouterConfig(
                    request_router_class=VideoAffinityRouter,
                    request_router_kwargs={"mode": self.routing,
                                           "max_imbalance": self.max_imbalance,
                                           "app": self.app},
                    request_routing_stats_period_s=STATS_PERIOD_S))
            serve.start(proxy_location="Disabled")
            handle = serve.run(deployment.bind(replica_settings, self.model_path),
                               name=self.app, route_prefix=None)
            first = handle.facts.remote().result()      # the router starts with this call
            self.handle = handle.options(stream=True)   # and is shared with this handle
            self.unary_handle = handle
            with self._lock:
                self.pipeline = EngineFacts(first, self)
                self._state = "ready"
        except Exception as e:          # noqa: BLE001 - reported as the server's start error
            log.exception("the Ray Serve deployment did not start")
            with self._lock:
                self.error = f"the Ray Serve deployment did not start: {e}"
                self._state = "dead"
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.state == "ready"

    def begin_shutdown(self):
        with self._lock:
            self._stopping = True
            queued = [f for f in self._flights.values() if not f.started]
            for f in queued:
                f.job.stop = f.job.stop or ShuttingDown(
                    "the server is shutting down; retry on another instance or after it "
                    "restarts")
        for f in queued:
            self._cancel(f)

    def stop(self, timeout: float = 10.0):
        self.begin_shutdown()
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._flights and time.monotonic() < deadline:
                self._lock.wait(0.1)
            left = list(self._flights.values())
        for f in left:
            f.job.stop = f.job.stop or ShuttingDown("the server is shutting down; the request "
                                                    "was stopped")
            self._cancel(f)
        self._runner.shutdown(wait=False, cancel_futures=True)
        if self._state == "ready":
            try:
                serve.delete(self.app)        # the replicas are this server's
            except Exception as e:            # noqa: BLE001 - the cluster may be gone already
                log.warning("deleting the Ray Serve application failed: %s", e)
        with self._lock:
            if self._state != "dead":
                self._state = "stopped"
        self._ready.set()

    # ------------------------------------------------------------------ state
    def _router(self):
        return routers().get(self.app)

    def _replicas(self) -> list:
        r = self._router()
        rows = r.replicas() if r is not None else []
        with self._lock:                  # a replica gone: its cache counts carry over
            live = {rid for rid, _, _ in rows}
            for rid, st in list(self._seen.items()):
                if rid not in live:
                    del self._seen[rid]
                    self._gone.update({k: (st.get("cache") or {}).get(k, 0)
                                       for k in CACHE_COUNTERS})
            for rid, st, _ in rows:
                if st:
                    self._seen[rid] = st
            for sid, rid in list(self.streams.items()):     # a replica gone: its streams
                if rid not in live:
                    del self.streams[sid]
                    self._lose(sid, f"its replica {rid} stopped")
            for rid in [r for r in self._stream_reports if r not in live]:
                del self._stream_reports[rid]
        return rows

    def _streams_of(self, rid: str, st: dict) -> dict | None:
        """The replica's latest streams report: its routing stats' or a stream call's."""
        a, b = st.get("streams"), self._stream_reports.get(rid)
        return max((x for x in (a, b) if x), key=lambda x: x["seq"], default=None)

    def forget_stream(self, stream_id: str):
        with self._lock:
            self.streams.pop(stream_id, None)

    async def stream_status(self, stream_id: str, tenant: str | None) -> dict | None:
        """The stream's status as its replica has it now (with ``engine``); None when that
        cannot be had (its replica gone, silent for PEEK_TIMEOUT_S, or PEEKS_AT_ONCE asked
        already): the caller answers from the reports. Why a stream's GET asks its replica
        rather than read the reports: a pulled stream's pieces are appended by a thread of
        its replica, by no call of the front end's whose answer would carry the replica's
        streams, so the reports (every STATS_PERIOD_S, through Ray Serve's controller) leave
        its status a period or more behind its source, where one server's is current. One
        round trip to one replica makes it current; listings, /metrics and /report, which
        read every stream, keep to the reports."""
        with self._lock:
            rid = self.streams.get(stream_id)
        handle = self.unary_handle
        if rid is None or handle is None or not self._peeks.acquire(blocking=False):
            return None

        def ask():
            try:
                return handle.stream_status.remote(
                    {"stream_id": stream_id, "pin": rid, "peek": True}, tenant).result(
                    timeout_s=PEEK_TIMEOUT_S)
            finally:
                self._peeks.release()

        try:
            st = await asyncio.to_thread(ask)
        except Exception as e:        # noqa: BLE001 - gone or slow: the reports answer
            log.info("stream %s: its replica %s did not say its status (%s); answering from "
                     "its last report", stream_id, rid, type(e).__name__)
            return None
        return None if st is None else {**st, "engine": rid}

    @property
    def state(self) -> str:
        """new, loading, ready (a replica serves), restarting (none does), dead (the
        deployment did not start), stopped."""
        if self._state == "ready" and not self._replicas():
            return "restarting"
        return self._state

    def _serving(self) -> int:
        return len(self._replicas())

    def _statuses(self) -> list[dict]:
        return [st for _, st, _ in self._replicas()]

    def cache_stats(self) -> dict | None:
        """The replicas' video caches, summed (those gone included)."""
        total = collections.Counter(self._gone)
        seen = bool(total)
        for _, st, _ in self._replicas():
            if st.get("cache") is not None:
                seen = True
                total.update({k: v for k, v in st["cache"].items()
                              if isinstance(v, (int, float))})
        return dict(total) if seen else None

    @property
    def engines(self) -> list:
        """The live replicas as data_parallel.EngineCollector reads engines."""
        out = []
        for rid, st, routed in self._replicas():
            c = dict(st.get("cache") or {})
            with self._lock:
                streams = self._streams_of(rid, st)
            out.append(SimpleNamespace(index=rid, state="ready", restarts=0,
                                       routed=collections.Counter(routed),
                                       cache_stats=lambda c=c: c,
                                       status={"streams": streams}))
        return out

    def engines_health(self, ids: bool = True) -> list[dict]:
        """Each live replica, for /health (``ids``: with its running requests' ids)."""
        with self._lock:
            mine = collections.defaultdict(list)
            for f in self._flights.values():
                mine[f.replica].append(f)
        out = []
        for rid, st, routed in self._replicas():
            fl = mine.get(rid, [])
            row = {"engine": rid, "state": "ready", "node": st.get("node"), "pid": st.get("pid"),
                   "queue": sum(1 for f in fl if not f.started),
                   "running": sum(1 for f in fl if f.started), "restarts": 0,
                   "cached_videos": len(st.get("videos") or ()), "routed": routed,
                   "served": st.get("served"), "videos_fetched": st.get("fetched")}
            if ids:
                row["running_request_ids"] = [f.job.request_id for f in fl if f.started]
            out.append(row)
        return out

    # ------------------------------------------------------------------ jobs
    def _new_flight(self, job) -> _Flight:
        f = self._flights[id(job)] = _Flight(job)
        return f

    def _dispatch(self, f: _Flight):
        self._runner.submit(self._run, f)

    def _ref(self, key: str, path: str):
        """The object-store reference of the video's bytes (put once, the last ones kept)."""
        with self._refs_lock:
            hit = self._refs.get(key)
            if hit is not None:
                self._refs.move_to_end(key)
                return hit[0]
        data = Path(path).read_bytes()
        ref = ray.put(data)
        with self._refs_lock:
            self._refs[key] = (ref, len(data))
            total = sum(n for _, n in self._refs.values())
            while len(self._refs) > 1 and total > self.s.video_store_gb * 2**30:
                _, (_, n) = self._refs.popitem(last=False)
                total -= n
        return ref

    def _run(self, f: _Flight):
        job = f.job
        try:
            req = self._request(f)
            while True:
                try:
                    ok, payload = self._call(f, req)
                    break
                except (RayActorError, EngineRestarted) as e:
                    router = self._router()
                    placed = router.placed.get(req["token"]) if router is not None else None
                    f.replica = f.replica or placed
                    if job.call is not None:      # never sent elsewhere: none holds it
                        lost = self._stream_lost(req, f.replica, e)
                        if not (job.stop is not None or self._stopping or f.streamed):
                            raise lost from None
                        raise
                    if job.stop is not None or self._stopping or f.streamed or f.moved:
                        raise
                    log.error("replica %s died running request %s (%s): sending it once more",
                              f.replica, job.request_id, type(e).__name__)
                    with self._lock:
                        f.moved, f.started, f.gen = True, False, None
                    self.moved += 1
                    req["avoid"] = f.replica
        except RequestCancelledError:
            ok, payload = False, job.stop or Cancelled("the request was cancelled")
        except (RayActorError, EngineRestarted) as e:
            if job.stop is not None or self._stopping:
                payload = job.stop or ShuttingDown("the server is shutting down")
            else:
                payload = EngineRestarted(
                    f"the replica running this request died ({type(e).__name__}); "
                    + ("part of the answer was already sent" if f.streamed else
                       "the request had been sent once more already") + "; retry the request",
                    engine=str(f.replica))
            ok = False
        except MMInferError as e:
            ok, payload = False, e
        except Exception as e:          # noqa: BLE001 - a bug: its traceback is logged
            log.exception("request %s failed in the Ray front end", job.request_id)
            ok, payload = False, RuntimeError(f"{type(e).__name__}: {e}")
        with self._lock:
            self._flights.pop(id(job), None)
            self._lock.notify_all()
        self.served += 1
        if job.started is not None:
            self.recent_s.append(time.monotonic() - job.started)
        if job.stop is not None:               # asked to stop: that is its answer
            ok, payload = False, job.stop
            self.stopped += 1
            if self._metrics is not None and job.stop_at is not None:
                self._metrics.stop_latency.observe(time.monotonic() - job.stop_at)
        self._answer(job, payload if ok else None, None if ok else payload)

    def _request(self, f: _Flight) -> dict:
        """The request dict a replica's ``answer`` takes (and the router reads) for ``f``."""
        job = f.job
        req = {"video_key": None, "question": job.question, "params": job.params,
               "request_id": job.request_id, "stream": job.on_token is not None,
               "avoid": None, "token": f"{id(f)}-{time.monotonic_ns()}"}
        if job.call is not None:        # a live stream's: to the replica that holds it
            sid = job.params.get("stream_id")
            with self._lock:
                if sid in self.lost_streams:
                    raise StreamNotFound(f"stream {sid!r} is gone: {self.lost_streams[sid]}",
                                         stream=sid)
                req.update(call=job.call, stream_id=sid, pin=self.streams.get(sid),
                           streams=dict(collections.Counter(self.streams.values())))
            if job.video_path:          # a piece: its bytes go with the call
                try:
                    data = Path(job.video_path).read_bytes()
                except OSError as e:
                    raise InputError(f"the piece could not be read: {e.strerror or e}") \
                        from None
                req.update(piece_ref=ray.put(data), piece_of=job.video_path,
                           suffix=Path(job.video_path).suffix)
            return req
        try:
            key = file_digest(job.video_path)
            ref = self._ref(key, job.video_path)
        except OSError as e:
            raise InputError(f"the video could not be read: {e.strerror or e}") from None
        req.update(video_key=key, video_ref=ref, suffix=Path(job.video_path).suffix)
        return req

    def _lose(self, sid: str, why: str):
        """(Lock held.) Remember why stream ``sid`` is gone, within LOST_STREAMS_KEPT."""
        self.lost_streams[sid] = why
        while len(self.lost_streams) > LOST_STREAMS_KEPT:
            self.lost_streams.popitem(last=False)

    def _stream_lost(self, req: dict, rid: str | None, e: BaseException) -> StreamNotFound:
        """A stream call whose replica (``rid``) died: the replica's streams are gone (and a
        creation's stream was never made)."""
        sid = req["stream_id"]
        why = f"its replica {rid} stopped ({type(e).__name__})"
        with self._lock:
            for s_, r in list(self.streams.items()):
                if r == rid or s_ == sid:
                    del self.streams[s_]
                    self._lose(s_, why)
        log.error("replica %s died running a call of stream %s: its streams are gone", rid, sid)
        return StreamNotFound(f"stream {sid!r} is gone: {why}", stream=sid)

    def _call(self, f: _Flight, req: dict):
        """One call to a replica: (ok, payload) from its "done"."""
        job = f.job
        gen = self.handle.answer.remote(req)
        with self._lock:
            f.gen = gen
            stopped = job.stop is not None or job.future.cancelled()
        if stopped:
            gen.cancel()
        for msg in gen:
            kind = msg[0]
            if kind == "queued":
                with self._lock:
                    f.replica = msg[1]
                    if req.get("stream_id") is not None and req["pin"] is None:
                        self.streams[req["stream_id"]] = msg[1]     # its creation: its home
            elif kind == "streams":
                with self._lock:
                    last = self._stream_reports.get(f.replica)
                    if last is None or last["seq"] < msg[1]["seq"]:
                        self._stream_reports[f.replica] = msg[1]
            elif kind == "started":
                with self._lock:
                    f.started = True
                job.started = time.monotonic()
                job.queue_ms = (job.started - job.enqueued) * 1e3
                if not job.future.running():
                    try:
                        job.future.set_running_or_notify_cancel()
                    except RuntimeError:
                        pass
            elif kind == "token":
                f.streamed = True
                if job.on_token is not None:
                    job.on_token(msg[1], msg[2])
            elif kind == "done":
                return msg[1], msg[2]
        raise EngineRestarted("the replica ended the request without an answer",
                              engine=str(f.replica))

    def _cancel(self, f: _Flight):
        gen = f.gen
        if gen is not None:
            gen.cancel()

    def _remove(self, job):
        """``Job.cancel`` of a job not started: its replica drops it."""
        with self._lock:
            f = self._flights.get(id(job))
        if f is not None:
            self._cancel(f)

    def _stop_running(self, job):
        """``Job.cancel`` of a running job (``job.stop`` says why): its replica stops it."""
        self._remove(job)
