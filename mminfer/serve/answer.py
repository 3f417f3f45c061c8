"""``POST /v1/answer``: a multipart upload (a ``video`` file part, or a ``video_id`` of
``POST /v1/videos``, and form fields), answered with the answer, the video and token facts,
whether the video's prefix came from the video cache (``cache``), and where the time went.

The body is parsed as it streams (``media.read_multipart``) rather than by FastAPI, so an
upload over the limit is refused while it arrives; the form's schema (``AnswerForm``) still
validates the fields and is what /openapi.json documents.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mminfer.errors import InputError, MissingField

from . import media
from .budget import request_params
from .errors import validate
from .schemas import (ATTENTION_DOC, CACHE_SALT_DOC, FPS_DOC, MAX_FRAMES_DOC, Attention,
                      Integer, Number)
from .service import video_facts

router = APIRouter()


class AnswerFields(BaseModel):
    """The form fields of an answer request (all text, as forms are)."""
    model_config = ConfigDict(extra="ignore")

    question: str = Field(description="the question about the video")
    video_id: str | None = Field(None, description="instead of a `video` file: the id of a "
                                                   "video stored with POST /v1/videos")
    fps: Number | None = Field(None, description=FPS_DOC)
    max_frames: Integer | None = Field(None, description=MAX_FRAMES_DOC)
    max_new_tokens: Integer | None = Field(
        None, description="answer length cap in tokens (default: the server's)")
    attention: Attention | None = Field(None, description=ATTENTION_DOC)
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description=CACHE_SALT_DOC)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_unset(cls, data):
        # an HTML form sends every field, the ones left blank as ""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v == "" and k != "question")}
        return data


class AnswerForm(AnswerFields):
    """multipart/form-data: the video file (or a `video_id`) and the fields."""
    video: bytes = Field(None, description="the video file (mp4, webm, mkv, ...); required "
                                           "unless `video_id` is given")


REQUEST_BODY = {"required": True, "content": {"multipart/form-data": {
    "schema": {"$ref": "#/components/schemas/AnswerForm"}}}}


@router.post("/v1/answer", openapi_extra={"requestBody": REQUEST_BODY},
             summary="Answer a question about an uploaded video",
             response_description="the answer, the video and token facts, timings in ms")
async def answer(request: Request):
    svc = request.app.state.service
    return await svc.handle(request, "answer", lambda req: _answer(svc, req))


async def _answer(svc, req):
    s = svc.s
    up = await media.read_multipart(req.http, req.body(svc.intake), svc.upload_dir,
                                    s.max_upload_bytes)
    req.path, req.own = up.video, up.video is not None
    req.received()
    if up.filename:
        req.label = f"the uploaded video {up.filename!r}"
    fields = {k: media.text_field(up, k) for k in AnswerFields.model_fields if k in up.fields}
    form = validate(AnswerFields, fields,
                    missing=lambda field: f"the form field `{field}` is missing")
    req.cache_salt = form.cache_salt
    if form.video_id and req.path is not None:
        raise InputError("the form has both a `video` file and a `video_id`; send one of them")
    filename = up.filename
    if form.video_id:
        req.use_stored(svc.videos, form.video_id)
        filename = req.lease.video.filename
    if req.path is None:
        raise MissingField("the form has no `video` file part (nor a `video_id`)",
                           field="video")
    question, params = request_params(s, fps=form.fps, max_frames=form.max_frames,
                                      max_new_tokens=form.max_new_tokens,
                                      attention=form.attention, question=form.question)
    media.check_file(req.path, req.label)
    await svc.check_budget(req, question, params)
    upload_ms = (time.monotonic() - req.arrival) * 1e3
    result, job = await svc.run_job(req, question, params)
    timings = svc.timings(result, job, upload_ms, req.arrival)
    body = {"request_id": req.id, "answer": result.answer, "model": svc.model_id(),
            "attention": result.attention,
            "attention_requested": result.attention_requested, "cache": result.cache,
            "video": video_facts(result, filename, form.video_id), "tokens": result.tokens,
            "sparsity": result.sparsity, "timings_ms": timings}
    return body, {"result": result, "timings": timings}
