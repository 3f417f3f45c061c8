"""``POST /v1/answer``: a multipart upload (a ``video`` file part, or a ``video_id`` of
``POST /v1/videos``, and form fields), answered with the answer, the video and token facts,
whether the video's prefix came from the video cache (``cache``), and where the time went.

The body is parsed as it streams (``media.read_multipart``) rather than by FastAPI, so an
upload over the limit is refused while it arrives; the form's schema (``AnswerForm``) still
validates the fields and is what /openapi.json documents. A field it does not name is refused
(400), never ignored.

Sampling works as on chat completions (``temperature``, ``top_p``, ``seed``; ``stop``: one
stop string per form); with ``logprobs=true`` the answer has ``logprobs``: per answer token
the entry OpenAI's chat ``choices[0].logprobs.content`` has (``token``, ``logprob``,
``bytes``, ``top_logprobs``), and ``finish_reason`` says why it ended.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mminfer.engine.pipeline import MAX_FPS, MAX_NEW_TOKENS
from mminfer.errors import InputError, MissingField
from mminfer.models.sampler import (MAX_STOP_CHARS, MAX_TEMPERATURE, MAX_TOP_LOGPROBS,
                                    SamplingParams)

from . import live, media
from .budget import request_params
from .errors import validate
from .schemas import (ATTENTION_DOC, CACHE_SALT_DOC, FPS_DOC, MAX_FRAMES_DOC, Attention,
                      Integer, Number)
from .service import video_facts

router = APIRouter()


class AnswerFields(BaseModel):
    """The form fields of an answer request (all text, as forms are: a field left out is the
    default, and none can be null)."""
    model_config = ConfigDict(extra="forbid")

    question: str = Field(description="the question about the video",
                          json_schema_extra={"pattern": r"\S"})   # not blank: the server says so
    video_id: str = Field(None, min_length=1, description="instead of a `video` file: the id "
                                                          "of a video stored with POST "
                                                          "/v1/videos")
    stream_id: str = Field(None, min_length=1, description="instead of a video: the id of a "
                                                           "live stream (POST /v1/streams), "
                                                           "asked over what it holds now")
    fps: Number = Field(None, gt=0, le=MAX_FPS, description=FPS_DOC)
    max_frames: Integer = Field(None, ge=1, description=MAX_FRAMES_DOC)
    max_new_tokens: Integer = Field(
        None, ge=1, le=MAX_NEW_TOKENS,
        description="answer length cap in tokens (default: the server's)")
    attention: Attention = Field(None, description=ATTENTION_DOC)
    temperature: Number = Field(0.0, ge=0, le=MAX_TEMPERATURE,
                                description="0: greedy; above 0: sampled")
    top_p: Number = Field(1.0, gt=0, le=1, description="nucleus mass (with temperature)")
    seed: Integer = Field(None, description="the same seed gives the same answer")
    stop: str = Field(None, min_length=1, max_length=MAX_STOP_CHARS,
                      description="the answer ends before this string")
    logprobs: bool = Field(False, description="each answer token's logprob in `logprobs`")
    top_logprobs: Integer = Field(0, ge=0, le=MAX_TOP_LOGPROBS,
                                  description="with logprobs: that many likeliest tokens")
    cache_salt: str = Field(None, min_length=1, max_length=256, description=CACHE_SALT_DOC)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_unset(cls, data):
        # an HTML form sends every field, the ones left blank as ""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v == "" and k != "question")}
        return data


class AnswerForm(AnswerFields):
    """multipart/form-data: the video file (or a `video_id`) and the fields."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["video"]},
                                                           {"required": ["video_id"]}]})
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
    unknown = sorted(set(up.fields) - set(AnswerFields.model_fields))
    if unknown:
        raise InputError(f"unknown form field `{unknown[0][:40]}`: this form takes "
                         f"{', '.join(AnswerForm.model_fields)}", field=unknown[0][:40])
    fields = {k: media.text_field(up, k) for k in AnswerFields.model_fields if k in up.fields}
    form = validate(AnswerFields, fields,
                    missing=lambda field: f"the form field `{field}` is missing")
    req.cache_salt = form.cache_salt
    sampling = SamplingParams(temperature=form.temperature, top_p=form.top_p, seed=form.seed,
                              stop=(form.stop,) if form.stop else (), logprobs=form.logprobs,
                              top_logprobs=form.top_logprobs)
    if form.video_id and req.path is not None:
        raise InputError("the form has both a `video` file and a `video_id`; send one of them")
    if form.stream_id:
        return await _answer_stream(svc, req, form, sampling)
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
    params["sampling_params"] = sampling
    media.check_file(req.path, req.label)
    await svc.check_budget(req, question, params)
    upload_ms = (time.monotonic() - req.arrival) * 1e3
    result, job = await svc.run_job(req, question, params)
    timings = svc.timings(result, job, upload_ms, req.arrival)
    body = {"request_id": req.id, "answer": result.answer, "model": svc.model_id(),
            "attention": result.attention,
            "attention_requested": result.attention_requested, "cache": result.cache,
            "video": video_facts(result, filename, form.video_id), "tokens": result.tokens,
            "sparsity": result.sparsity, "timings_ms": timings,
            "finish_reason": result.finish_reason}
    if sampling.logprobs:
        body["logprobs"] = result.logprobs
    if not sampling.greedy:
        body["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                            "seed": sampling.seed}
    return body, {"result": result, "timings": timings}


async def _answer_stream(svc, req, form, sampling):
    """A question about a live stream (mminfer.serve.live)."""
    if req.path is not None or form.video_id:
        raise InputError("the form has a `stream_id` and a video; send one of them")
    question, params = request_params(svc.s, fps=form.fps, max_frames=form.max_frames,
                                      max_new_tokens=form.max_new_tokens,
                                      attention=form.attention, question=form.question)
    params["sampling_params"] = sampling
    result, timings, video = await live.answer(svc, req, form, question, params)
    body = {"request_id": req.id, "answer": result.answer, "model": svc.model_id(),
            "attention": result.attention,
            "attention_requested": result.attention_requested, "cache": result.cache,
            "video": video, "tokens": result.tokens, "sparsity": None,
            "timings_ms": timings, "finish_reason": result.finish_reason}
    if sampling.logprobs:
        body["logprobs"] = result.logprobs
    return body, {"result": result, "timings": timings}
