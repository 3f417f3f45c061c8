"""One request's life, the same for both POST routes.

    auth -> a queue place and an upload place (503 at once when there is none, body unread)
         -> the body, timed (408 when too slow) and size-checked (413)
         -> the request's numbers (400/413) -> the video's budget (413), off the event loop
         -> the job, in the queue place reserved on arrival -> wait for it, stopping it when the
            client leaves (499) or the deadline passes (504)
         -> the answer, its metrics and its latency record

A streamed answer (stream.StreamReply) leaves this path once its first token exists: until
then every error is the JSON answer above; after it, the stream itself answers, releases the
request and records it when it ends (stream.py).

A temp file belongs to the request until the job takes it (``Request.own``); whatever ends
the request, a file still owned is removed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import ClientDisconnect

from mminfer.errors import ClientGone, MMInferError, Timeout, Unauthorized, WorkerDead

from . import guard, media, tenants
from .budget import Budget
from .errors import describe, error_body, json_response
from .intake import Intake
from .stream import StreamReply, stop_job
from .worker import Job

log = logging.getLogger("mminfer.serve")

_RID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass
class Request:
    """What the route knows about the request it is serving."""
    http: object                          # the starlette Request
    id: str
    arrival: float                        # time.monotonic()
    path: str | None = None               # the video on disk
    own: bool = False                     # the path is a temp file still ours to delete
    label: str = "the uploaded video"     # what messages call the video instead of its path
    queue_place: object = None            # worker.QueuePlace
    upload: object = None                 # intake.UploadPlace
    client_upload: object = None          # guard.ClientUpload
    deadline: float | None = None         # time.monotonic() by which the job must be done
    lease: object = None                  # videos.FileLease, held until the job has it
    tenant: tenants.Tenant = tenants.ANONYMOUS   # whose request it is (its API key's)
    tenant_upload: object = None          # tenants.Place among the tenant's bodies in flight
    tenant_place: object = None           # tenants.Place among the tenant's requests
    cache_salt: str | None = None         # the request's own (vLLM's cache_salt field)
    stored: object = None                 # videos.StoredVideo asked by id (its name, for answers)

    def body(self, intake: Intake):
        """The request body as timed chunks."""
        return intake.timed(self.http.stream())

    def received(self):
        """The body is in: its upload place is free for another."""
        if self.upload is not None:
            self.upload.end()
        if self.client_upload is not None:
            self.client_upload.end()
        if self.tenant_upload is not None:
            self.tenant_upload.end()

    def release(self):
        self.received()
        if self.tenant_place is not None:
            self.tenant_place.end()
        if self.queue_place is not None:
            self.queue_place.release()
        if self.own:
            media.remove(self.path)
            self.own = False
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def use_stored(self, store, video_id: str):
        """The stored video ``video_id`` of this request's tenant is this request's (404 when
        there is none)."""
        self.lease = store.acquire(video_id, self.tenant.name)
        self.stored = self.lease.video
        self.path, self.own = self.lease.path, False
        self.label = f"the stored video {video_id!r}"


class Service:
    def __init__(self, settings, worker, store, metrics, model_path: str, upload_dir: Path,
                 videos=None):
        self.s = settings
        self.videos = videos                # videos.VideoStore
        self.worker = worker
        self.store = store
        self.metrics = metrics
        self.model_path = model_path
        self.upload_dir = upload_dir
        self.intake = Intake(settings.max_concurrent_uploads or settings.queue_size,
                             settings.upload_deadline_s, settings.min_upload_kbps * 1024,
                             settings.upload_grace_s)
        self.budget = Budget(settings)
        self.clients = guard.ClientUploads(settings.uploads_per_client)
        self.storage = guard.Storage(upload_dir, 64 * 2**20)
        self.keys = tenants.load(settings)
        self.tenant_uploads = tenants.Places("request bodies arriving", "max_uploads")
        self.tenant_requests = tenants.Places("requests waiting or running", "max_queue")
        self.sessions = None                # login.Sessions, set by the app

    # ------------------------------------------------------------ names and keys
    def model_id(self) -> str:
        if self.s.served_model_names:
            return self.s.served_model_names[0]
        return getattr(self.worker.pipeline, "model_id", None) or self.metrics.model

    def model_names(self) -> set:
        """Every name a request may ask for this model by."""
        names = {self.model_id(), "default", *self.s.served_model_names}
        p = self.worker.pipeline
        names |= {n for n in (getattr(p, "model_id", None), self.s.model,
                              Path(self.model_path).name) if n}
        return names

    def check_auth(self, request, *, cookie: bool = False) -> tenants.Tenant:
        """The request's tenant, from its bearer key (or, where ``cookie``, a /login
        session's cookie); 401 without a valid one when the server has keys."""
        if not self.keys.enabled:
            return tenants.ANONYMOUS
        token = bearer(request)
        tenant = self.keys.lookup(token) if token else None
        if tenant is None and cookie and self.sessions is not None:
            tenant = self.sessions.tenant(request)
        if tenant is None:
            raise Unauthorized("missing or wrong API key: send `Authorization: Bearer <key>`"
                               + (" (or log in at /login)" if cookie else ""))
        return tenant

    def quota(self, tenant: tenants.Tenant) -> tenants.Quota:
        return self.keys.quota(tenant, self.s)

    def tenant_share(self, req: Request):
        """The request's tenant's upload place (429 past its quota)."""
        req.tenant_upload = self.tenant_uploads.begin(req.tenant.name,
                                                      self.quota(req.tenant).max_uploads)

    def cache_salt(self, req: Request) -> str | None:
        return tenants.cache_salt(req.tenant, req.cache_salt,
                                  self.s.share_cache_across_tenants,
                                  len(self.keys.tenants()) == 1)

    # ------------------------------------------------------------ the request
    async def handle(self, http, endpoint: str, impl):
        """Serve one POST with ``impl(req) -> (body, info)``; every outcome is JSON."""
        arrival = time.monotonic()
        rid = http.headers.get("x-request-id", "")
        rid = rid if _RID.match(rid) else uuid.uuid4().hex
        req = Request(http=http, id=rid, arrival=arrival)
        headers = {"X-Request-ID": rid}
        info: dict = {}
        stream = None
        try:
            req.tenant = self.check_auth(http)
            req.tenant_place = self.tenant_requests.begin(req.tenant.name,
                                                          self.quota(req.tenant).max_queue)
            # Refused here, the 503 goes out before a byte of the body is read (no 100
            # Continue either); the server drops whatever the client still sends.
            req.queue_place = self.worker.reserve()
            req.upload = self.intake.begin()
            req.client_upload = self.clients.begin(guard.client_host(http))
            self.tenant_share(req)
            body, info = await impl(req)
            status = 200
            if isinstance(body, StreamReply):
                stream = body
        except MMInferError as e:
            status, code, body = describe(e, req.path, req.label)
            body["error"]["request_id"] = rid
            info = {"code": code}
            if status in (503, 429):
                headers["Retry-After"] = str(self.worker.retry_after(self.s.retry_after_max_s))
            if status == 401:
                headers["WWW-Authenticate"] = "Bearer"
        except ClientDisconnect:
            status, info = 499, {"code": "client_disconnected"}
            body = error_body("client_disconnected", "the client disconnected", 499)
        except Exception as e:  # noqa: BLE001 - a bug, not bad input: the service lives on
            full = self.storage.failed(e)
            if full is not None:            # a full disk is not a bug: 507, /health says so
                log.warning("request %s: no space left under the data folder", rid)
                status, code, body = describe(full)
                body["error"]["request_id"] = rid
                info = {"code": code}
            else:                           # the log has the exception; the client its id
                log.exception("request %s failed", rid)
                status, info = 500, {"code": "internal"}
                body = error_body("internal", f"internal error ({type(e).__name__}); the "
                                  f"server log has the details under request id {rid}", 500,
                                  request_id=rid)
        finally:
            if stream is None:
                req.release()
        if stream is not None:          # it releases, counts and records when it ends
            return stream.response(headers)
        if status == 200:
            self.storage.ok()
        if status == 401:               # refused before authentication: counted, not stored
            self.metrics.count(status, info.get("code"))
            self.metrics.refuse("unauthorized")
            return json_response(status, body, headers)
        self.finish(rid, endpoint, status, info, arrival, tenant=req.tenant)
        return json_response(status, body, headers)

    def finish(self, rid, endpoint, status, info, arrival, tenant=None):
        """A request's outcome in the metrics and the latency store (``tenant``'s
        history)."""
        self.metrics.count(status, info.get("code"))
        self.record(rid, endpoint, status, info, arrival, tenant)

    def record(self, rid, endpoint, status, info, arrival, tenant=None):
        name = tenant.name if tenant is not None else None
        result = info.get("result")
        try:
            if result is not None:
                density = (result.sparsity or {}).get("mean_density", 1.0)
                self.metrics.observe_success(info["timings"], result.tokens["total"],
                                             result.tokens["generated"], density)
                self.metrics.observe_cache(getattr(result, "cache", None))
                self.store.add(id=rid, endpoint=endpoint, status=200, model=result.model,
                               attention=result.attention, cache=getattr(result, "cache", None),
                               tokens=result.tokens["total"],
                               visual_tokens=result.tokens["visual"],
                               generated=result.tokens["generated"], density=density,
                               timings=info["timings"], tenant=name)
            else:
                self.store.add(id=rid, endpoint=endpoint, status=status, code=info.get("code"),
                               model=self.model_id(), tenant=name, timings={
                                   "total": round((time.monotonic() - arrival) * 1e3, 3)})
        except Exception:       # noqa: BLE001 - a full disk must not turn answers into errors
            log.exception("could not record request %s", rid)

    async def check_budget(self, req: Request, question: str, params: dict) -> dict:
        """The video's budget, once the model is loaded (it knows the token layout)."""
        while self.worker.state in ("new", "loading"):
            if time.monotonic() - req.arrival > self.s.timeout_s:
                raise Timeout(f"the model did not finish loading within {self.s.timeout_s:g} s")
            await asyncio.sleep(0.1)
        if self.worker.state != "ready":
            raise WorkerDead(f"the model worker is dead: {self.worker.error}")
        adapter = getattr(self.worker.pipeline, "adapter", None)
        return await asyncio.to_thread(self.budget.check_video, req.path, question, params,
                                       adapter)

    async def run_job(self, req: Request, question: str, params: dict):
        """Queue the job in the request's queue place (the temp file, if ours, goes with it)
        and wait for its result, stopping it when the client leaves or the timeout passes."""
        job, fut = self.submit(req, question, params)
        await self.wait(req, job, fut)
        return fut.result(), job

    def submit(self, req: Request, question: str | None, params: dict, on_token=None):
        """The job, queued in the request's queue place, and its future on this loop; the request's
        deadline starts now. ``question`` None: ``params`` holds the ``conversation``."""
        params = {**params, "use_cache": self.s.video_cache}
        salt = self.cache_salt(req)
        if salt is not None:
            params["cache_salt"] = salt
        job = Job(video_path=req.path, question=question, params=params,
                  cleanup=req.path if req.own else None, request_id=req.id, on_token=on_token,
                  release=req.lease.release if req.lease is not None else None)
        self.worker.submit(job, req.queue_place)
        req.own, req.lease = False, None    # the job deletes or releases it when done
        req.deadline = time.monotonic() + self.s.timeout_s
        return job, asyncio.wrap_future(job.future)

    async def wait(self, req: Request, job: Job, fut, until=None) -> bool:
        """Wait until the job is done (True) or the future ``until`` is (False, the job still
        running); stop it and raise when the client leaves (499) or the deadline passes
        (504)."""
        aws = {fut} if until is None else {fut, until}
        while True:
            left = req.deadline - time.monotonic()
            if left <= 0:
                err = self.timeout_error(job)
                stop_job(job, fut, err)
                raise err
            await asyncio.wait(aws, timeout=min(0.1, left),
                               return_when=asyncio.FIRST_COMPLETED)
            if fut.done():
                return True
            if until is not None and until.done():
                return False
            if await req.http.is_disconnected():
                err = ClientGone("the client disconnected before the answer was ready")
                stop_job(job, fut, err)
                raise err

    def timeout_error(self, job: Job) -> Timeout:
        t = self.s.timeout_s
        return Timeout(f"the request did not finish within {t:g} s (it timed out "
                       f"{'while running' if job.started else 'in the queue'})", timeout_s=t)

    def timings(self, result, job, upload_ms: float, arrival: float) -> dict:
        """Request timings: upload, queue and retry (an attempt that ran out of memory: the
        worker's), the pipeline's stages in its order, then ttft (arrival to first token) and
        total (arrival to answer)."""
        t = dict(result.timings_ms)
        pipeline_ttft = t.pop("ttft", 0.0)
        t.pop("total", None)
        out = {"upload": upload_ms, "queue": job.queue_ms, "retry": t.pop("retry", 0.0), **t,
               "ttft": upload_ms + job.queue_ms + pipeline_ttft,
               "total": (time.monotonic() - arrival) * 1e3}
        return {k: round(float(v), 3) for k, v in out.items()}


def bearer(request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def video_facts(result, label, video_id: str | None = None) -> dict:
    """The answer's ``video``: the engine's facts (no server path), the file's name as the
    client gave it and, for a stored video, its id."""
    v = {k: val for k, val in result.video.items() if k != "path"}
    v["filename"] = label
    if video_id is not None:
        v["id"] = video_id
    return v
