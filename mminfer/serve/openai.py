"""The OpenAI-compatible routes: ``POST /v1/chat/completions`` and ``GET /v1/models``.

The whole message list is the prompt (``conversation_of``): the system prompt, earlier user
and assistant turns and the question, through the model's chat template; exactly one
``video_url`` part, in whichever user message holds it (usually the first): a data: URL, a
stored video (``mminfer://videos/{id}``, see videos.py), a live stream
(``mminfer://streams/{id}``, live.py: answered over what it holds when the question runs;
``mminfer.video.seen_until`` says up to which media time), an allow-listed local path or an
allow-listed remote URL. A follow-up turn about the same video with the same turns before
the video reuses the video's cached prefix (``mminfer.cache`` says ``hit``).

The body is read by the service (size-limited and timed as it arrives), parsed off the event
loop (a 400 for anything the JSON parser rejects, deep nesting included), then validated by
``ChatCompletionRequest``, the schema /openapi.json documents. Of OpenAI's parameters, the
sampling ones a video QA client needs work (``temperature``, ``top_p``, ``seed``, ``stop``,
``logprobs``/``top_logprobs``; mminfer.models.sampler); every other one (penalties,
``response_format``, tools, ``logit_bias``...) is refused with a 400 naming it unless it has the
value that changes nothing (``presence_penalty: 0``), and so is a parameter nobody defined: a
client never gets an answer that silently ignored what it asked for.

``stream: true`` answers with server-sent events (stream.py) once the first token exists:
a ``chat.completion.chunk`` with the role, one per piece of answer text, one with the
finish reason (and mminfer's timings), with ``stream_options.include_usage`` a last one with
the usage and no choices, then ``data: [DONE]``; the request's budgets, queue, deadline and
records are those of any other.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any, Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, create_model

from mminfer.errors import InputError, ModelNotFound, UnsupportedMedia
from mminfer.models.base import VIDEO, Conversation, Turn
from mminfer.models.sampler import (MAX_STOP, MAX_STOP_CHARS, MAX_TEMPERATURE, MAX_TOP_LOGPROBS,
                                    SamplingParams)

from . import jsonbody, live, media
from .budget import request_params
from .errors import validate
from .schemas import ATTENTION_DOC, CACHE_SALT_DOC, FPS_DOC, MAX_FRAMES_DOC, Attention
from .schemas import JsonBool as Bool
from .schemas import JsonInteger as Integer
from .schemas import JsonNumber as Number
from .service import video_facts
from .stream import StreamReply, TokenFeed
from .videos import video_id_of

router = APIRouter()


# ------------------------------------------------------------------ the schema

class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class VideoURL(_Open):
    url: str = Field(min_length=1, description="data:video/...;base64,..., "
                                               "mminfer://videos/{id} (POST /v1/videos), "
                                               "mminfer://streams/{id} (a live stream, "
                                               "answered over what it holds now), "
                                               "file:///path or /path (inside "
                                               "--allowed-local-media-path), "
                                               "http(s)://host/... (--allowed-media-domains)")


class VideoURLPart(_Open):
    type: Literal["video_url"]
    video_url: VideoURL | str


class OtherMediaPart(_Open):
    """Media OpenAI clients may send; refused here with 415 (send one video)."""
    type: Literal["image_url", "input_audio", "audio_url", "image"]


ContentPart = Annotated[Union[TextPart, VideoURLPart, OtherMediaPart],
                        Field(discriminator="type")]


class Message(_Open):
    role: str = Field(description="system (or developer), user, assistant; the whole list is "
                                  "the prompt and the last message, a user's, is answered")
    content: str | list[ContentPart] | None = None


class MMProcessorKwargs(_Open):
    fps: Number | None = Field(None, description=FPS_DOC)
    max_frames: Integer | None = Field(None, description=MAX_FRAMES_DOC)


class StreamOptions(_Open):
    include_usage: Bool = Field(False, description="send a last chunk with the usage "
                                                   "(prompt and completion tokens)")


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]

# OpenAI's and vLLM's parameters this server does not implement, each accepted only at the
# values that change nothing (and null); any other value is a 400 naming it
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "response_format": ({"type": "text"},), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "top_k": (-1, 0), "min_p": (0,), "best_of": (1,),
    "min_tokens": (0,), "echo": (False,), "ignore_eos": (False,), "stop_token_ids": ([],),
    "skip_special_tokens": (True,), "include_stop_str_in_output": (False,),
    "store": (False,), "metadata": ({},), "service_tier": ("auto", "default"),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
    "web_search_options": (),
}


class _ChatRequest(BaseModel):
    """OpenAI's chat completion request, as far as a video question needs it."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="a name this server serves (GET /v1/models); "
                                                "empty: the served model")
    messages: list[Message] = Field(min_length=1)
    max_tokens: Integer | None = Field(None, description="answer length cap in tokens")
    max_completion_tokens: Integer | None = Field(None, description="same as max_tokens "
                                                                    "(wins over it)")
    stream: Bool = Field(False, description="answer as server-sent events "
                                            "(chat.completion.chunk), from the first token")
    stream_options: StreamOptions | None = Field(None, description="with stream=true only")
    n: Integer = Field(1, description="must be 1")
    fps: Number | None = Field(None, description=FPS_DOC + " (mminfer extension)")
    max_frames: Integer | None = Field(None, description=MAX_FRAMES_DOC +
                                       " (mminfer extension)")
    attention: Attention | None = Field(None, description=ATTENTION_DOC +
                                        " (mminfer extension)")
    mm_processor_kwargs: MMProcessorKwargs | None = Field(
        None, description="vLLM's place for fps and max_frames")
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description=CACHE_SALT_DOC)
    temperature: Number | None = Field(
        None, ge=0, le=MAX_TEMPERATURE,
        description="0 or absent: greedy (the most likely token); above 0: sampled from "
                    "softmax(logits / temperature)")
    top_p: Number | None = Field(None, gt=0, le=1, description="sample only from the most "
                                 "likely tokens whose mass reaches top_p (with temperature)")
    seed: Integer | None = Field(None, description="the same seed (and request) gives the "
                                 "same answer; absent: a fresh one (mminfer.sampling.seed "
                                 "says which)")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = Field(
        None, description="the answer ends before the first of these strings "
                          "(finish_reason stop)")
    logprobs: Bool | None = Field(False, description="choices[0].logprobs.content: each "
                                  "answer token's logprob (the model's own distribution)")
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                         description="with logprobs: that many most likely "
                                                     "tokens at each position")
    user: str | None = Field(None, description="the end user's id (not used)")


def _neutral_doc(values: tuple) -> str:
    said = [json.dumps(v) for v in values]
    return ("not supported: accepted only as " + " or ".join([*said, "null"])
            + (" (which changes nothing)" if said else ""))


ChatCompletionRequest = create_model(
    "ChatCompletionRequest", __base__=_ChatRequest, __doc__=_ChatRequest.__doc__,
    **{name: (Any, Field(None, description=_neutral_doc(values),
                         json_schema_extra={"enum": [*values, None]}))
       for name, values in NEUTRAL.items()})


def _same(a, b) -> bool:
    """JSON equality: 0 and 0.0 are equal, false and 0 are not (Python says they are)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def refuse_unsupported(data: dict) -> None:
    """A 400 naming the first parameter that this server would otherwise ignore: one it does
    not implement sent at a value that would change the answer, or one nobody defined."""
    for name, value in data.items():
        if name in NEUTRAL:
            if value is not None and not any(_same(value, v) for v in NEUTRAL[name]):
                raise InputError(f"{name} is not supported by this server; "
                                 f"{_neutral_doc(NEUTRAL[name]).split(': ', 1)[1]}, not "
                                 f"{_shown(value)}", field=name)
        elif name not in ChatCompletionRequest.model_fields:
            raise InputError(f"unknown parameter `{_shown(name, 40)}`: this server's chat "
                             f"completions take {', '.join(sorted(_ChatRequest.model_fields))}",
                             field=name)


def _shown(value, n: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def sampling_of(body) -> SamplingParams:
    stop = body.stop
    return SamplingParams(temperature=body.temperature or 0.0,
                          top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                          stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
                          logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0)


REQUEST_BODY = {"required": True, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}}
SCHEMAS = (ChatCompletionRequest,)


# ------------------------------------------------------------------ routes

@router.post("/v1/chat/completions", openapi_extra={"requestBody": REQUEST_BODY},
             summary="OpenAI chat completion with one video_url part")
async def chat(request: Request):
    svc = request.app.state.service
    return await svc.handle(request, "chat", lambda req: _chat(svc, req))


@router.get("/v1/models", summary="The served model and its names")
async def models(request: Request):
    svc = request.app.state.service
    svc.check_auth(request)
    p = svc.worker.pipeline
    ctx_len = getattr(getattr(p, "adapter", None), "max_context", None)
    # the served names, then "default", which every server answers to (clients that do not
    # know the name ask for it); the checkpoint's own name also works, unlisted
    ids = [svc.model_id()] + [n for n in svc.s.served_model_names[1:]]
    ids += [] if "default" in ids else ["default"]
    policy = p.attention_policy() if hasattr(p, "attention_policy") else None
    kv = getattr(p, "kv_cache_dtype", None)          # "auto" | "fp8_e4m3"
    return {"object": "list", "data": [{"id": i, "object": "model", "owned_by": "mminfer",
                                        "root": svc.model_id(), "max_model_len": ctx_len,
                                        **({"kv_cache_dtype": kv} if kv else {}),
                                        **({"mminfer": policy} if policy else {})}
                                       for i in ids]}


async def _chat(svc, req):
    s = svc.s
    ctype = req.http.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise UnsupportedMedia(f"send the request as application/json, not "
                               f"{ctype or 'a body without Content-Type'}")
    raw = await media.read_body(req.http, req.body(svc.intake), s.max_json_bytes)
    req.received()
    data = await jsonbody.parse_body(raw, s.max_json_items, s.max_json_depth)
    del raw
    if not isinstance(data, dict):
        raise InputError("the request body must be a JSON object")
    refuse_unsupported(data)
    body = await asyncio.to_thread(validate, ChatCompletionRequest, data)
    if body.model not in (None, "") and body.model not in svc.model_names():
        raise ModelNotFound(f"the model {body.model!r} is not served here; this server serves "
                            f"{svc.model_id()!r}", served=svc.model_id())
    if body.stream_options is not None and not body.stream:
        raise InputError("stream_options is only allowed with stream=true")
    if body.n != 1:
        raise InputError("n must be 1")
    sampling = sampling_of(body)
    if sampling.logprobs and body.stream:
        raise InputError("logprobs are not streamed by this server: ask with stream=false",
                         field="logprobs")
    url, conv = conversation_of(body.messages)
    mm = body.mm_processor_kwargs or MMProcessorKwargs()
    max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                  else body.max_tokens)
    # the limits on a question apply to the conversation's whole text
    _, params = request_params(
        s, fps=body.fps if body.fps is not None else mm.fps,
        max_frames=body.max_frames if body.max_frames is not None else mm.max_frames,
        max_new_tokens=max_tokens, attention=body.attention, question=conversation_text(conv))
    params["conversation"] = conv
    req.cache_salt = body.cache_salt
    params["sampling_params"] = sampling
    stream = body.stream
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    del data, body
    stream_id = live.stream_id_of(url)
    if stream_id is None:
        req.label = "the video"
        await _media(svc, req, url)
        media.check_file(req.path, req.label)
        await svc.check_budget(req, conversation_text(conv), params)
    upload_ms = (time.monotonic() - req.arrival) * 1e3
    if stream:
        feed = TokenFeed(asyncio.get_running_loop())
        if stream_id is None:
            job, fut = svc.submit(req, None, params, on_token=feed)
        else:
            job, fut = await live.ask(svc, req, stream_id, None, params, on_token=feed,
                                      wait=False)
        if await svc.wait(req, job, fut, until=feed.first):
            fut.result()                # failed before its first token: a JSON error
        chunks = ChatChunks(svc, req.id, sampling, include_usage, req.stored)
        return StreamReply(svc, req, "chat", job, fut, feed, chunks, upload_ms), {}
    if stream_id is None:
        result, job = await svc.run_job(req, None, params)
    else:
        job, fut = await live.ask(svc, req, stream_id, None, params)
        result = fut.result()
    timings = svc.timings(result, job, upload_ms, req.arrival)
    answer = {
        "id": f"chatcmpl-{req.id}", "object": "chat.completion", "created": int(time.time()),
        "model": svc.model_id(),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.answer},
                     "logprobs": ({"content": result.logprobs}
                                  if result.logprobs is not None else None),
                     "finish_reason": result.finish_reason}],
        "usage": usage(result),
        "timings": timings,
        "mminfer": extension(result, sampling, req.stored),
    }
    return answer, {"result": result, "timings": timings}


def usage(result) -> dict:
    gen = result.tokens["generated"]
    return {"prompt_tokens": result.tokens["total"], "completion_tokens": gen,
            "total_tokens": result.tokens["total"] + gen,
            # cached_tokens: OpenAI's (and vLLM's) count of prompt tokens reused from a cached
            # prefix, here the video's prefix on a hit
            "prompt_tokens_details": {"visual_tokens": result.tokens["visual"],
                                      "cached_tokens": result.tokens.get("cached", 0)}}


def extension(result, sampling: SamplingParams, stored=None) -> dict:
    """The answer's ``mminfer`` object; ``stored``: the videos.StoredVideo asked by id."""
    video = (video_facts(result, None) if stored is None else
             video_facts(result, stored.filename, stored.id))
    out = {"attention": result.attention, "cache": result.cache,
           "tokens": {"cached": result.tokens.get("cached", 0)},
           "sparsity": result.sparsity, "video": video}
    if not sampling.greedy:        # the seed drawn when none was sent: to ask again alike
        out["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                           "seed": sampling.seed}
    return out


class ChatChunks:
    """The ``chat.completion.chunk`` events of one streamed answer, as OpenAI sends them
    (with ``include_usage``, every chunk carries ``usage: null`` but the last)."""

    def __init__(self, svc, rid: str, sampling: SamplingParams, include_usage: bool,
                 stored=None):
        self.stored = stored
        self.head = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": svc.model_id()}
        self.sampling = sampling
        self.include_usage = include_usage

    def _chunk(self, delta: dict, finish=None, **extra) -> dict:
        out = {**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}], **extra}
        if self.include_usage:
            out["usage"] = None
        return out

    def start(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, text: str) -> dict:
        return self._chunk({"content": text})

    def end(self, result, timings: dict) -> list[dict]:
        out = [self._chunk({}, result.finish_reason, timings=timings,
                           mminfer=extension(result, self.sampling, self.stored))]
        if self.include_usage:
            out.append({**self.head, "choices": [], "usage": usage(result)})
        return out


async def _media(svc, req, url: str):
    """The request's video (``req.path``): a temp file it owns (data:, http(s)), a stored
    video it leases (``mminfer://videos/{id}``), or an allow-listed local file."""
    s = svc.s
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        req.path = await asyncio.to_thread(media.save_data_url, url, svc.upload_dir,
                                           s.max_data_url_bytes)
        req.own = True
    elif scheme in ("http", "https"):
        req.path = await media.fetch_remote(url, svc.upload_dir, s.max_upload_bytes,
                                            s.allowed_media_domains, s.media_fetch_timeout_s,
                                            s.media_fetch_deadline_s,
                                            s.allow_private_media_addresses)
        req.own = True
    elif scheme == "mminfer":
        req.use_stored(svc.videos, video_id_of(url))
    elif scheme == "file" or url.startswith("/"):
        req.path, req.own = media.local_media(url, s.allowed_local_media_path), False
    else:
        raise InputError("video_url must be a data: URL, an http(s) URL, a stored video "
                         "(mminfer://videos/{id}) or a local path (file:// or absolute), not "
                         f"{url[:40]!r}")


ROLE_NAMES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}


def conversation_of(messages: list[Message]):
    """``(video_url, Conversation)`` of the whole message list: system (and OpenAI's newer
    ``developer``) messages first, merged into one system turn, then user and assistant turns
    in order, text parts as text and the one ``video_url`` part, in whichever user message
    holds it, as the video. Exactly one video in the conversation (400 otherwise); other
    media 415; the last message must be a user message with text (400)."""

    turns, urls = [], []
    for i, m in enumerate(messages):
        role = ROLE_NAMES.get(m.role)
        if role is None:
            raise InputError(f"messages[{i}]: role {m.role!r} is not supported here (system, "
                             f"developer, user, assistant)")
        content = m.content
        if content is None:
            raise InputError(f"messages[{i}] has no content")
        parts: list = []
        for part in ([TextPart(type="text", text=content)] if isinstance(content, str)
                     else content):
            if isinstance(part, TextPart):
                if not part.text:
                    continue
                if parts and isinstance(parts[-1], str):       # adjacent texts: one text
                    parts[-1] = parts[-1] + "\n" + part.text
                else:
                    parts.append(part.text)
            elif isinstance(part, VideoURLPart):
                if role != "user":
                    raise InputError(f"messages[{i}]: only a user message may hold the video")
                v = part.video_url
                url = v.url if isinstance(v, VideoURL) else v
                if not url:
                    raise InputError("a video_url part has no `url`")
                urls.append(url)
                parts.append(VIDEO)
            else:
                raise UnsupportedMedia(f"{part.type} parts are not supported; send one "
                                       f"video_url")
        if role == "system":
            if any(t.role != "system" for t in turns):
                raise InputError(f"messages[{i}]: a system message may only come before the "
                                 f"user and assistant messages")
            parts = ["\n".join([*(turns.pop().parts if turns else ()), *parts])]
        turns.append(Turn(role, tuple(parts)))
    if not any(t.role == "user" for t in turns):
        raise InputError("`messages` has no user message")
    if len(urls) != 1:
        raise InputError(
            f"the conversation must have exactly one video_url part (it has {len(urls)})"
            + ("" if urls else ": give a user message's `content` as a list with a "
               "{\"type\": \"video_url\", \"video_url\": {\"url\": ...}} part"))
    conv = Conversation(tuple(turns))
    conv.validate()
    return urls[0], conv


def conversation_text(conv) -> str:
    """All the conversation's text, as the budget counts it (the question's token limit
    applies to every turn's text together)."""
    return "\n".join(p for t in conv.turns for p in t.parts if isinstance(p, str))
