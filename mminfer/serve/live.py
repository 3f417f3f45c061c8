"""Live video over HTTP: ``/v1/streams`` (mminfer.engine.streams does the work).

    POST   /v1/streams                 JSON {fps, min_pixels, max_pixels, model} -> the stream
    POST   /v1/streams/{id}/segments   multipart ``file``: a piece of video in any container the
                                       decoders read (an MP4 fragment, an MPEG-TS segment, a
                                       short file); ``start`` form field: its media time
                                       (default: right after what the stream covers)
    GET    /v1/streams[/{id}]          state, frames, tokens, media time covered and seen,
                                       ingest lag, the last piece, where the KV lives
    DELETE /v1/streams/{id}            ends it and frees its cache

A question names the stream: ``stream_id`` on ``/v1/answer``; it is answered over everything the
stream holds when it runs, and its ``video.seen_until`` says up to which media time.

A piece and a question are jobs of the model worker like any answer (a queue place, the
request's deadline, cancelled when the client leaves): a piece's vision and prefill are long
work the scheduler admits one at a time and pauses between layers for questions and decode
steps, a question is short work. A piece the decoder or the stream refuses (corrupt, another
frame size, going back in time) is a 400 with the reason, recorded in the stream's
``last_error``; the stream keeps everything before it. A stream whose cache would pass the
streams' budget or the model's context is ``full`` (409 ``stream_full``) and still answers.
Streams belong to the tenant of the API key that created them (another's is 404).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from mminfer.engine.pipeline import MAX_FPS
from mminfer.engine.streams import Streams
from mminfer.errors import (InputError, MissingField, ModelNotFound, ServiceUnavailable,
                            VideoError, WorkerDead)
from mminfer.models.base import PrepareOptions

from . import media
from .errors import validate
from .schemas import FPS_DOC, Integer, Number
from .service import video_facts
from .worker import Job

router = APIRouter()

MAX_CREATE_BYTES = 16 * 1024


class StreamCreate(BaseModel):
    """``POST /v1/streams``: how the stream samples and sizes its frames."""
    model_config = ConfigDict(extra="forbid")

    model: str = Field(None, description="a model this server serves (default: its own)")
    fps: Number = Field(2.0, gt=0, le=MAX_FPS, description=FPS_DOC)
    min_pixels: Integer = Field(None, ge=1, description="pixels per frame at least "
                                                        "(Qwen2.5-VL; default: the model's)")
    max_pixels: Integer = Field(None, ge=1, description="pixels per frame at most, the "
                                                        "stream's pixel budget (Qwen2.5-VL; "
                                                        "default: the model's)")


def registry(svc) -> Streams:
    """The server's streams (made with the pipeline, once it is loaded)."""
    reg = getattr(svc, "live_streams", None)
    if reg is None:
        pipe = svc.worker.pipeline
        if getattr(svc.worker, "engines", None) is not None or (
                pipe is not None and not hasattr(pipe, "adapter")):
            # a stream's KV lives in one process: under --data-parallel it would have to stay
            # on one engine, which the front end does not do yet
            raise ServiceUnavailable("live streams are not available on a server running "
                                     "--data-parallel; run one without it for streams")
        if svc.worker.state != "ready" or pipe is None:
            raise WorkerDead(f"the model is not ready ({svc.worker.state})")
        budget = getattr(svc.s, "stream_kv_gb", None)
        reg = svc.live_streams = Streams(
            pipe, None if budget is None else int(float(budget) * 2**30))
    return reg


async def run(svc, req, call):
    """``call(pipeline, turn, cancel)`` as a job of the model worker in the request's queue
    place (the piece's temp file goes with it); its result."""
    job = Job(video_path=req.path or "", question="", params={}, request_id=req.id,
              cleanup=req.path if req.own else None, call=call)
    svc.worker.submit(job, req.queue_place)
    req.own = False
    req.deadline = time.monotonic() + svc.s.timeout_s
    fut = asyncio.wrap_future(job.future)
    await svc.wait(req, job, fut)
    return fut.result(), job


CREATE_BODY = {"required": False, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/StreamCreate"}}}}


@router.post("/v1/streams", openapi_extra={"requestBody": CREATE_BODY},
             summary="Start a live stream (push its pieces to .../segments)")
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
    reg = registry(svc)
    s = reg.create(fps=form.fps, tenant=tenant.name,
                   options=PrepareOptions(min_pixels=form.min_pixels,
                                          max_pixels=form.max_pixels))
    return s.status()


@router.get("/v1/streams", summary="Your live streams")
async def list_streams(request: Request):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    reg = getattr(svc, "live_streams", None)
    return {"object": "list",
            "data": [s.status() for s in (reg.list(tenant.name) if reg else [])]}


@router.get("/v1/streams/{stream_id}", summary="A live stream of yours: what it holds")
async def get_stream(request: Request, stream_id: str):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    return registry(svc).get(stream_id, tenant.name).status()


@router.delete("/v1/streams/{stream_id}", summary="End a live stream and free its cache")
async def delete_stream(request: Request, stream_id: str):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    s = await asyncio.to_thread(registry(svc).delete, stream_id, tenant.name)
    return {"id": s.id, "object": "stream", "deleted": True}


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
    stream = registry(svc).get(stream_id, req.tenant.name)
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
    path = req.path

    def call(pipeline, turn, cancel):
        try:
            return stream.append_file(path, start=start, turn=turn, cancel=cancel)
        except VideoError as e:
            stream.refused(e)
            raise

    report, _ = await run(svc, req, call)
    status = stream.status()
    return {"id": stream.id, "object": "stream.segment", "piece": report,
            "stream": status}, {}


async def answer(svc, req, form, question: str, params: dict):
    """``/v1/answer`` with ``stream_id``: the question over the stream as it is now."""
    stream = registry(svc).get(form.stream_id, req.tenant.name)
    upload_ms = (time.monotonic() - req.arrival) * 1e3

    def call(pipeline, turn, cancel):
        return stream.ask(question, max_new_tokens=params["max_new_tokens"],
                          sampling_params=params.get("sampling_params"), turn=turn,
                          cancel=cancel)

    result, job = await run(svc, req, call)
    timings = svc.timings(result, job, upload_ms, req.arrival)
    video = video_facts(result, None)
    video.pop("filename", None)
    return result, timings, video
