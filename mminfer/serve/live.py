"""Live video over HTTP: ``/v1/streams`` (mminfer.engine.streams does the work; the calls that
run where the model is are live_ops.py).

    POST   /v1/streams                 JSON {fps, min_pixels, max_pixels, model, attention,
                                       keep, source} -> the stream; ``source``: a live URL
                                       (or an allowed local path) the server reads itself
                                       (pull mode); ``keep``: "all" (full past the budgets)
                                       or "window" (the oldest frames dropped past them)
    POST   /v1/streams/{id}/segments   multipart ``file``: a piece of video in any container the
                                       decoders read (an MP4 fragment, an MPEG-TS segment, a
                                       short file); ``start`` form field: its media time
                                       (default: right after what the stream covers)
    GET    /v1/streams[/{id}]          state, frames, tokens, media time covered and seen,
                                       ingest lag, the last piece, where the KV lives, the
                                       source being pulled
    DELETE /v1/streams/{id}            ends it and frees its cache

A question names the stream: ``stream_id`` on ``/v1/answer``, a ``video_url`` of
``mminfer://streams/{id}`` in chat; it is answered over everything the stream holds when it
runs, and its ``video.seen_until`` says up to which media time.

A piece and a question are jobs of the model worker like any answer (a queue place, the
request's deadline, cancelled when the client leaves): a piece's vision and prefill are long
work the scheduler admits one at a time and pauses between layers for questions and decode
steps, a question is short work. A piece the decoder or the stream refuses (corrupt, another
frame size, going back in time) is a 400 with the reason, recorded in the stream's
``last_error``; the stream keeps everything before it. Idle streams move to pinned host memory
when the streams' device budget (``--stream-kv-gb``) is spent (``--stream-host-kv-gb``) and
come back on their next piece or question. A stream whose cache would pass both, or the
model's context, is ``full`` (409 ``stream_full``) and still answers, unless it was created
with ``keep: "window"``: then its oldest frames go and its answers say ``seen_from``. Streams
belong to the tenant of the API key that created them (another's is 404).

Pull mode: ``source`` is allowed as remote media is (``--allowed-media-domains``, private
addresses only with ``--allow-private-media-addresses``; http, https, rtsp, rtmp and HLS
playlists) or, for a local path (a growing file, a FIFO), inside
``--allowed-local-media-path``. The stream's ``source`` says its state, lag and last error.

Under ``--data-parallel`` a stream lives on one engine, under ``--ray`` on one replica: it is
created on the least loaded one and every later call about it goes there (the front end's
map of stream ids, data_parallel.py and ray_serve.py); listings, /metrics and /report read
the engines' reports (``engines``, each with its last ``status``), and a stream's GET asks its
engine or replica (``worker.stream_status``: a pulled stream's engine appends pieces between
its reports), the reports answering when it cannot say in time.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from mminfer.engine.pipeline import MAX_FPS
from mminfer.engine.scheduler import Solo
from mminfer.errors import (Forbidden, InputError, MissingField, ModelNotFound, RemoteRefused,
                            StreamNotFound, WorkerDead)

from . import live_ops, media
from .errors import validate
from .schemas import FPS_DOC, Attention, Integer, Number
from .service import video_facts
from .worker import Job

router = APIRouter()

MAX_CREATE_BYTES = 16 * 1024
SCHEME = "mminfer://streams/"         # a chat video_url naming a stream
PULL_SCHEMES = ("http", "https", "rtsp", "rtsps", "rtmp")


class StreamCreate(BaseModel):
    """``POST /v1/streams``: how the stream samples and sizes its frames, and where it comes
    from when the server reads it itself."""
    model_config = ConfigDict(extra="forbid")

    model: str = Field(None, description="a model this server serves (default: its own)")
    fps: Number = Field(2.0, gt=0, le=MAX_FPS, description=FPS_DOC)
    min_pixels: Integer = Field(None, ge=1, description="pixels per frame at least "
                                                        "(Qwen2.5-VL; default: the model's)")
    max_pixels: Integer = Field(None, ge=1, description="pixels per frame at most, the "
                                                        "stream's pixel budget (Qwen2.5-VL; "
                                                        "default: the model's)")
    attention: Attention = Field(None, description="the pieces' prefill attention: auto (each "
                                 "piece decided by the stream's length and the piece's: "
                                 "pieces under 2048 rows run dense), sparse (if the server "
                                 "allows clients to ask for it) or dense; default: the "
                                 "server's --attention")
    source: str = Field(None, min_length=1, max_length=2048,
                        description="pull mode: a live source the server reads (http(s), HLS, "
                                    "rtsp URL on --allowed-media-domains; a local path inside "
                                    "--allowed-local-media-path); absent: push pieces to "
                                    ".../segments")
    keep: Literal["all", "window"] = Field(
        "all", description="past the streams' memory (device and host tiers) or the model's "
                           "context: all (the stream becomes full: it takes no more video and "
                           "answers over everything it holds) or window (the oldest frames "
                           "are dropped to make room; the status's window and each answer's "
                           "seen_from say from which media time it holds frames)")


def data_parallel(svc) -> bool:
    return getattr(svc.worker, "engines", None) is not None


def _budget(svc) -> int | None:
    gb = svc.s.stream_kv_gb
    return None if gb is None else int(gb * 2**30)


def _host_budget(settings) -> int:
    return int((settings.stream_host_kv_gb or 0) * 2**30)


def local(svc) -> live_ops.Live:
    """This process's streams (one server: the model worker's pipeline)."""
    pipe = svc.worker.pipeline
    if svc.worker.state != "ready" or pipe is None:
        raise WorkerDead(f"the model is not ready ({svc.worker.state})")
    return live_ops.attach(pipe, svc.worker, _budget(svc), svc.s.media_fetch_timeout_s,
                           _host_budget(svc.s))


# ------------------------------------------------------------------ where a stream is

def _reported(svc) -> list[dict]:
    """--data-parallel: every stream the engines last reported (each with ``engine``)."""
    out = []
    for e in svc.worker.engines:
        rep = (e.status or {}).get("streams") if e.state == "ready" else None
        for st in (rep or {}).get("streams", []):
            out.append({**st, "engine": str(e.index)})
    return out


def status(svc, stream_id: str, tenant: str | None) -> dict:
    """The stream's status (StreamNotFound when it is not the tenant's)."""
    if not data_parallel(svc):
        live = local(svc)
        st = live.status(live.streams.get(stream_id, tenant))
        return st
    for st in _reported(svc):
        if st["id"] == stream_id and st.get("tenant") == tenant:
            return _public(st)
    lost = svc.worker.lost_streams.get(stream_id)
    raise StreamNotFound(f"no stream {stream_id!r}" + (f": {lost}" if lost else ""),
                         stream=str(stream_id))


def _public(st: dict) -> dict:
    return {k: v for k, v in st.items() if k != "tenant"}


def summary(svc, tenant: str | None, every: bool = False) -> dict | None:
    """The report's Streams section: the server's figures and the streams of ``tenant``
    (``every``: all tenants', the admin's view)."""
    st = stats(svc)
    if st is None:
        return None
    if data_parallel(svc):
        rows = [st_ for st_ in _reported(svc) if every or st_.get("tenant") == tenant]
    else:
        rows = [r for r in local(svc).report()["streams"]
                if every or r.get("tenant") == tenant]
    return {"stats": st, "streams": rows}


def listing(svc, tenant: str | None) -> list[dict]:
    if data_parallel(svc):
        return [_public(st) for st in _reported(svc) if st.get("tenant") == tenant]
    if svc.worker.state != "ready":
        return []
    live = local(svc)
    return [live.status(s) for s in live.streams.list(tenant)]


def stats(svc) -> dict | None:
    """The streams' figures for /metrics and /report: one process's, or the engines' summed
    (the piece-time histogram bucket by bucket, the lag the largest)."""
    if not data_parallel(svc):
        if svc.worker.state != "ready" or svc.worker.pipeline is None:
            return None
        return local(svc).report()["stats"]
    total, seen = collections.Counter(), False
    buckets, lag = None, 0.0
    for e in svc.worker.engines:
        st = ((e.status or {}).get("streams") or {}).get("stats")
        if not st:
            continue
        seen = True
        for k, v in st.items():
            if k == "piece_buckets":
                buckets = v if buckets is None else [a + b for a, b in zip(buckets, v)]
            elif k == "max_lag_seconds":
                lag = max(lag, v or 0.0)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] += v
    if not seen:
        return None
    return {**total, "piece_buckets": buckets, "max_lag_seconds": lag}


async def _job(svc, req, stream_id: str, call, on_token=None, wait: bool = True):
    """``call`` as a job of the model worker (one server) or of the stream's engine, in the
    request's queue place (the piece's temp file goes with it): ``(job, future)``, the
    future done unless ``wait`` is False."""
    job = Job(video_path=req.path or "", question="", params={"stream_id": stream_id},
              request_id=req.id, cleanup=req.path if req.own else None, call=call,
              on_token=on_token)
    svc.worker.submit(job, req.queue_place)
    req.own = False
    req.deadline = time.monotonic() + svc.s.timeout_s
    fut = asyncio.wrap_future(job.future)
    if wait:
        await svc.wait(req, job, fut)
    return job, fut


async def _admin_call(svc, stream_id: str, call):
    """A create or delete under --data-parallel: a job on the stream's engine, in a queue
    place of its own, within the server's timeout."""
    place = svc.worker.reserve()
    job = Job(video_path="", question="", params={"stream_id": stream_id}, call=call)
    try:
        svc.worker.submit(job, place)
    finally:
        place.release()
    return await asyncio.wait_for(asyncio.wrap_future(job.future), svc.s.timeout_s)


# ------------------------------------------------------------------ pull sources

async def check_source(svc, source: str) -> str:
    """The source as the server will open it, when the operator allows it: a remote URL as
    remote media (allowed domains, public addresses unless allowed), a local path inside the
    allowed folder."""
    s = svc.s
    scheme = source.split(":", 1)[0].lower() if "://" in source else ""
    if scheme in PULL_SCHEMES:
        parts = media.parse_url(source)
        host = (parts.hostname or "").lower()
        if not s.allowed_media_domains:
            raise RemoteRefused("remote sources are disabled on this server (start it with "
                                "--allowed-media-domains)", field="source")
        if host not in s.allowed_media_domains:
            raise RemoteRefused(f"the source host {host!r} is not in this server's allowed "
                                "media domains", host=host, field="source")
        try:
            port = parts.port or 0
        except ValueError:
            raise InputError("the source URL has a bad port", field="source") from None
        await media._resolve(host, port, s.allow_private_media_addresses)
        return source
    if scheme in ("", "file"):
        if "\x00" in source:
            raise InputError("the source contains a NUL byte", field="source")
        if not s.allowed_local_media_path:
            raise Forbidden("local sources are disabled on this server (start it with "
                            "--allowed-local-media-path DIR to allow a folder)", field="source")
        if os.path.isfile(_path_of(source)):
            return media.local_media(source, s.allowed_local_media_path)
        return _local_any(source, s.allowed_local_media_path)
    raise InputError(f"a stream's source is an {', '.join(PULL_SCHEMES)} URL or a local path, "
                     f"not {source[:40]!r}", field="source")


def _path_of(source: str) -> str:
    return media.parse_url(source).path if source[:5].lower() == "file:" else source


def _local_any(source: str, allowed: str) -> str:
    """A local source that is not a regular file (a FIFO), inside the allowed folder."""
    real = os.path.realpath(_path_of(source))
    root = os.path.realpath(allowed)
    if os.path.commonpath([root, real]) != root:
        raise Forbidden("the source path is outside the allowed local media folder",
                        field="source")
    if not os.path.exists(real):
        raise InputError("the source path does not exist", field="source")
    return real


# ------------------------------------------------------------------ routes

CREATE_BODY = {"required": False, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/StreamCreate"}}}}


@router.post("/v1/streams", openapi_extra={"requestBody": CREATE_BODY},
             summary="Start a live stream (push its pieces to .../segments, or name a source)")
async def create_stream(request: Request):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    raw = await media.read_body(request, svc.intake.timed(request.stream()), MAX_CREATE_BYTES)
    try:
        data = json.loads(raw or b"{}")
    except ValueError as e:
        raise InputError(f"the body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise InputError("the body must be a JSON object")
    form = validate(StreamCreate, data)
    if form.model is not None and form.model not in svc.model_names():
        raise ModelNotFound(f"this server serves {sorted(svc.model_names())}, not "
                            f"{form.model!r}", field="model")
    if form.attention == "sparse" and not svc.s.allow_client_sparse:
        raise Forbidden("this server does not let clients choose attention=sparse (it decides "
                        "dense or sparse itself: leave attention out or send auto)",
                        field="attention")
    source = None if form.source is None else await check_source(svc, form.source)
    sid = uuid.uuid4().hex[:16]
    call = live_ops.call(live_ops.create, sid, form.fps, form.min_pixels, form.max_pixels,
                         tenant.name, source, form.attention, form.keep)
    if data_parallel(svc):
        if svc.worker.state != "ready":
            raise WorkerDead(f"the model is not ready ({svc.worker.state})")
        try:
            st = _public(await _admin_call(svc, sid, call))
        except BaseException:
            svc.worker.forget_stream(sid)           # it was never made
            raise
    else:
        st = await asyncio.to_thread(call, local(svc).streams.pipeline, None, None)
    if source is not None:       # the client's words, not the server's resolved path
        st["source"] = {**st["source"], "url": form.source}
    return st


@router.get("/v1/streams", summary="Your live streams")
async def list_streams(request: Request):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    return {"object": "list", "data": listing(svc, tenant.name)}


@router.get("/v1/streams/{stream_id}", summary="A live stream of yours: what it holds")
async def get_stream(request: Request, stream_id: str):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    st = status(svc, stream_id, tenant.name)
    now = getattr(svc.worker, "stream_status", None)
    if now is not None:          # asked of the stream's engine or replica (its reports lag)
        st = _public(await now(stream_id, tenant.name) or st)
    return st


@router.delete("/v1/streams/{stream_id}", summary="End a live stream and free its cache")
async def delete_stream(request: Request, stream_id: str):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    call = live_ops.call(live_ops.delete, stream_id, tenant.name)
    if data_parallel(svc):
        status(svc, stream_id, tenant.name)           # 404 before any engine is asked
        out = await _admin_call(svc, stream_id, call)
        svc.worker.forget_stream(stream_id)
        return out
    return await asyncio.to_thread(call, local(svc).streams.pipeline, Solo(), None)


SEGMENT_BODY = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {"file": {"type": "string", "format": "binary",
                            "description": "a piece of video (MP4 fragment, MPEG-TS segment, "
                                           "short file)"},
                   "start": {"type": "number", "minimum": 0,
                             "description": "its media time in seconds (default: right "
                                            "after what the stream covers)"}}}}}}


@router.post("/v1/streams/{stream_id}/segments", openapi_extra={"requestBody": SEGMENT_BODY},
             summary="Append a piece of video to a live stream")
async def append_segment(request: Request, stream_id: str):
    svc = request.app.state.service
    return await svc.handle(request, "stream_segment",
                            lambda req: _append(svc, req, stream_id))


async def _append(svc, req, stream_id):
    status(svc, stream_id, req.tenant.name)          # 404 before the body is read
    up = await media.read_multipart(req.http, req.body(svc.intake), svc.upload_dir,
                                    svc.s.max_upload_bytes, file_field="file")
    req.path, req.own = up.video, up.video is not None
    req.received()
    req.label = "the piece"
    unknown = sorted(set(up.fields) - {"start"})
    if unknown:
        raise InputError(f"unknown form field `{unknown[0][:40]}`: this form takes file, "
                         "start", field=unknown[0][:40])
    if req.path is None:
        raise MissingField("the form has no `file` part (the piece of video)", field="file")
    start = media.text_field(up, "start")
    if start is not None:
        try:
            start = float(start)
        except ValueError:
            raise InputError(f"start must be a number of seconds, not {start[:40]!r}",
                             field="start") from None
    media.check_file(req.path, req.label)
    call = live_ops.call(live_ops.append, stream_id, req.tenant.name, req.path, start)
    job, fut = await _job(svc, req, stream_id, call)
    report, st = fut.result()
    return {"id": stream_id, "object": "stream.segment", "piece": report,
            "stream": _public(st)}, {}


def stream_id_of(url: str) -> str | None:
    """The id of a ``mminfer://streams/{id}`` URL, else None."""
    if not url[:len(SCHEME)].lower() == SCHEME:
        return None
    sid = url[len(SCHEME):]
    if not sid or "/" in sid or "?" in sid or "#" in sid:
        raise InputError(f"a stream's URL is {SCHEME}{{id}} with the id POST /v1/streams "
                         f"gave, not {url[:80]!r}", field="video_url")
    return sid


async def ask(svc, req, stream_id: str, question, params: dict, on_token=None,
              wait: bool = True):
    """A question about the stream (``question``, or ``params["conversation"]``) over what it
    holds now: ``(job, future)`` of the job that answers it."""
    status(svc, stream_id, req.tenant.name)
    call = live_ops.call(live_ops.ask, stream_id, req.tenant.name, question,
                         params.get("conversation"), params["max_new_tokens"],
                         params.get("sampling_params"))
    if on_token is not None and not data_parallel(svc):   # an engine adds its own
        call = functools.partial(call, on_token=on_token)
    return await _job(svc, req, stream_id, call, on_token=on_token, wait=wait)


async def answer(svc, req, form, question: str, params: dict):
    """``/v1/answer`` with ``stream_id``: the question over the stream as it is now."""
    upload_ms = (time.monotonic() - req.arrival) * 1e3
    job, fut = await ask(svc, req, form.stream_id, question, params)
    result = fut.result()
    timings = svc.timings(result, job, upload_ms, req.arrival)
    video = video_facts(result, None)
    video.pop("filename", None)
    return result, timings, video
