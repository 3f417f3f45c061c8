"""The HTTP service: upload a video and a question, get the answer with where the time went.

    POST /v1/answer             multipart: video file + question (+ fps, max_frames,
                                max_new_tokens, attention)
    POST /v1/chat/completions   OpenAI shape; ``video_url`` parts (data: URLs, allow-listed
                                local paths, allow-listed remote hosts), ``timings`` extension
    GET  /v1/models, /v1/latency-report (JSON), /report (page), /health, /metrics

Timings (ms) of a request: ``upload`` (receiving the body, decoding a data: URL, fetching a
URL), ``queue`` (waiting for the model worker), the pipeline stages (decode, preprocess,
vision, index, attention, llm_other, generate), ``ttft`` (request arrival to the first answer
token) and ``total`` (arrival to answer).

Every error is JSON ``{"error": {"code", "message", "type", ...}}`` with the HTTP status of
its kind (mminfer.errors and the classes in media.py / worker.py). Bearer auth
(``MMINFER_API_KEY``) guards the /v1 routes, as vLLM's ``--api-key`` does; /health, /metrics
and the /report page stay open for probes, scrapers and browsers.
"""

import asyncio
import hmac
import json
import logging
import math
import os
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mminfer.engine.timing import SERVED_STAGES as STAGE_ORDER
from mminfer.errors import ConfigError, InputError, MMInferError
from mminfer.models.embedded import resolve_model

from . import media
from .metrics import Metrics
from .store import LatencyStore, parse_time
from .worker import Job, ModelWorker, WorkerDead

log = logging.getLogger("mminfer.serve")



@dataclass
class Settings:
    model: str | None = None
    attention: str = "auto"
    device: str | None = None
    dtype: str | None = None
    min_sparse_len: int | None = None   # None: the pipeline's default (GPU 65536, CPU dense)
    data_dir: str = "./mminfer-data"
    max_upload_mb: float = 512.0
    queue_size: int = 8
    timeout_s: float = 600.0          # from queueing to answer
    fps: float = 2.0                  # request defaults
    max_frames: int = 768
    max_new_tokens: int = 32
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = 30.0
    api_key: str | None = field(default_factory=lambda: os.environ.get("MMINFER_API_KEY") or None)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)


# ---------------------------------------------------------------- error kinds

class Unauthorized(MMInferError):
    code = "unauthorized"
    http_status = 401


class ModelNotFound(MMInferError):
    code = "model_not_found"
    http_status = 404


class Timeout(MMInferError):
    code = "timeout"
    http_status = 504


class ClientGone(MMInferError):
    code = "client_disconnected"
    http_status = 499                  # nginx's "client closed request"


def _error_type(status: int) -> str:
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")


def error_body(code: str, message: str, status: int, **details) -> dict:
    return {"error": {"code": code, "message": message, "type": _error_type(status),
                      **details}}


def _plain(v):
    """Details must be JSON: numbers that are not finite become their repr."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)


_RID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


# ------------------------------------------------------------------------ app

def create_app(settings: Settings | None = None, worker: ModelWorker | None = None):
    """The FastAPI app; the model loads on the worker thread when the app starts (or pass a
    ``worker`` already started, as the CLI does to fail fast on a bad model)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, Response
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    s = settings or Settings()
    model_path = resolve_model(s.model)
    data_dir = Path(s.data_dir)
    upload_dir = data_dir / "uploads"
    upload_dir.mkdir(parents=True, exist_ok=True)
    store = LatencyStore(data_dir / "latency.sqlite3")
    metrics = Metrics(Path(model_path).name)
    if worker is None:
        def load():
            from mminfer.engine.pipeline import Pipeline
            return Pipeline(model_path, attention=s.attention, device=s.device, dtype=s.dtype,
                            min_sparse_len=s.min_sparse_len)
        worker = ModelWorker(load, queue_size=s.queue_size, metrics=metrics)
    else:
        worker.metrics = metrics

    def model_id() -> str:
        p = worker.pipeline
        return getattr(p, "model_id", None) or Path(model_path).name

    @asynccontextmanager
    async def lifespan(app):
        for stale in upload_dir.glob(media.TEMP_PREFIX + "*"):   # left by a killed server
            media.remove(str(stale))
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)
        store.close()

    app = FastAPI(title="mminfer", version=_version(), lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.settings, app.state.worker, app.state.store = s, worker, store
    app.state.metrics, app.state.upload_dir = metrics, upload_dir

    def json_error(status, code, message, rid=None, headers=None, **details):
        h = dict(headers or {})
        if rid:
            h["X-Request-ID"] = rid
        return JSONResponse(error_body(code, message, status, **details), status_code=status,
                            headers=h)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return json_error(exc.status_code, code, str(exc.detail),
                          headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return json_error(422, "invalid_request", "the request is malformed",
                          detail=json.loads(json.dumps(exc.errors(), default=str)))

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        log.exception("unhandled error")
        return json_error(500, "internal", f"internal error: {type(exc).__name__}")

    # ------------------------------------------------------------ helpers
    def check_auth(request):
        if not s.api_key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 s.api_key.encode()):
            raise Unauthorized("missing or wrong API key: send `Authorization: Bearer <key>`")

    def params_of(fps, max_frames, max_new_tokens, attention, question) -> tuple[str, dict]:
        from mminfer.engine.pipeline import check_request
        fps = s.fps if fps is None else media.number(fps, "fps")
        max_frames = s.max_frames if max_frames is None else media.number(
            max_frames, "max_frames", int)
        max_new_tokens = s.max_new_tokens if max_new_tokens is None else media.number(
            max_new_tokens, "max_new_tokens", int)
        attention = attention or None
        q = check_request(question, fps, max_frames, max_new_tokens, None, None,
                          attention or s.attention)
        return q, {"fps": fps, "max_frames": max_frames, "max_new_tokens": max_new_tokens,
                   "attention": attention}

    async def run_job(request, path, question, params, owned: bool):
        """Queue the job (the temp file, if ``owned``, goes with it) and wait for its
        result, cancelling it when the client leaves or the timeout passes."""
        job = Job(video_path=path, question=question, params=params,
                  cleanup=path if owned else None)
        try:
            worker.submit(job)
        except BaseException:
            if owned:
                media.remove(path)
            raise
        fut = asyncio.wrap_future(job.future)
        deadline = time.monotonic() + s.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                dropped = job.cancel()
                fut.add_done_callback(_quiet)
                where = "in the queue" if dropped else "while running"
                raise Timeout(f"the request did not finish within {s.timeout_s:g} s (it timed "
                              f"out {where})", timeout_s=s.timeout_s)
            done, _ = await asyncio.wait({fut}, timeout=min(0.1, left))
            if done:
                return fut.result(), job
            if await request.is_disconnected():
                job.cancel()
                fut.add_done_callback(_quiet)
                raise ClientGone("the client disconnected before the answer was ready")

    def timings_of(result, job, upload_ms, arrival) -> dict:
        t = dict(result.timings_ms)
        pipeline_ttft = t.pop("ttft", 0.0)
        t.pop("total", None)
        t["upload"], t["queue"] = upload_ms, job.queue_ms
        t["ttft"] = upload_ms + job.queue_ms + pipeline_ttft
        t["total"] = (time.monotonic() - arrival) * 1e3
        ordered = {k: round(float(t[k]), 3) for k in STAGE_ORDER if k in t}
        ordered.update({k: round(float(v), 3) for k, v in t.items() if k not in ordered})
        return ordered

    def video_facts(result, label) -> dict:
        v = {k: val for k, val in result.video.items() if k != "path"}
        v["filename"] = label
        return v

    def clean_message(e: MMInferError, path: str | None, label: str) -> tuple[str, dict]:
        msg = e.message
        details = {k: _plain(v) for k, v in e.details.items() if k != "path"}
        if path:
            msg = msg.replace(path, label)
        return msg, details

    async def serve(request, endpoint: str, impl):
        arrival = time.monotonic()
        rid = request.headers.get("x-request-id", "")
        rid = rid if _RID.match(rid) else uuid.uuid4().hex
        ctx = {"path": None, "label": "the uploaded video"}
        try:
            check_auth(request)
        except Unauthorized as e:
            metrics.count(401, e.code)
            return json_error(401, e.code, e.message, rid, {"WWW-Authenticate": "Bearer"})
        info = {}
        headers = {"X-Request-ID": rid}
        try:
            if worker.state == "dead":
                await media.drain(request.stream())   # so the client reads the 503
                raise WorkerDead(f"the model worker is dead: {worker.error}")
            body, info = await impl(request, rid, arrival, ctx)
            status = 200
        except MMInferError as e:
            status = e.http_status
            msg, details = clean_message(e, ctx["path"], ctx["label"])
            code = e.code
            if isinstance(e, InputError) and "tokens" in e.details and "limit" in e.details:
                code = "context_length_exceeded"       # OpenAI's code for this case
            body = error_body(code, msg, status, request_id=rid, **details)
            info = {"code": code}
            if status == 503:
                wait = max(1, math.ceil(worker.mean_s * (worker.waiting + 1)))
                headers["Retry-After"] = str(wait)
        except ClientDisconnect:
            status, info = 499, {"code": "client_disconnected"}
            body = error_body("client_disconnected", "the client disconnected", 499)
        except Exception as e:  # noqa: BLE001 - a bug, not bad input: the service lives on
            log.exception("request %s failed", rid)
            status, info = 500, {"code": "internal"}
            body = error_body("internal", f"internal error: {type(e).__name__}: {e}", 500,
                              request_id=rid)
        metrics.count(status, info.get("code"))
        result = info.get("result")
        try:
            if result is not None:
                density = (result.sparsity or {}).get("mean_density", 1.0)
                metrics.observe_success(info["timings"], result.tokens["total"],
                                        result.tokens["generated"], density)
                store.add(id=rid, endpoint=endpoint, status=200, model=result.model,
                          attention=result.attention, tokens=result.tokens["total"],
                          visual_tokens=result.tokens["visual"],
                          generated=result.tokens["generated"], density=density,
                          timings=info["timings"])
            else:
                store.add(id=rid, endpoint=endpoint, status=status, code=info.get("code"),
                          model=model_id(), timings={
                              "total": round((time.monotonic() - arrival) * 1e3, 3)})
        except Exception:       # noqa: BLE001 - a full disk must not turn answers into errors
            log.exception("could not record request %s", rid)
        return JSONResponse(body, status_code=status, headers=headers)

    # ------------------------------------------------------------ /v1/answer
    async def answer_impl(request, rid, arrival, ctx):
        up = await media.read_multipart(request, upload_dir, s.max_upload_bytes)
        path = up.video
        ctx["path"] = path
        if up.filename:
            ctx["label"] = f"the uploaded video {up.filename!r}"
        try:
            if path is None:
                raise media.MissingField("the form has no `video` file part", field="video")
            question = media.text_field(up, "question", required=True)
            question, params = params_of(
                media.text_field(up, "fps"), media.text_field(up, "max_frames"),
                media.text_field(up, "max_new_tokens"), media.text_field(up, "attention"),
                question)
            media.check_file(path, ctx["label"])
        except BaseException:
            media.remove(path)
            raise
        upload_ms = (time.monotonic() - arrival) * 1e3
        # run_job owns the file from here: the job deletes it when done or dropped
        result, job = await run_job(request, path, question, params, owned=True)
        timings = timings_of(result, job, upload_ms, arrival)
        body = {"request_id": rid, "answer": result.answer, "model": result.model,
                "attention": result.attention,
                "attention_requested": result.attention_requested,
                "video": video_facts(result, up.filename), "tokens": result.tokens,
                "sparsity": result.sparsity, "timings_ms": timings}
        return body, {"result": result, "timings": timings}

    @app.post("/v1/answer")
    async def answer(request: Request):
        return await serve(request, "answer", answer_impl)

    # ------------------------------------------------------------ chat completions
    async def chat_impl(request, rid, arrival, ctx):
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise media.UnsupportedMedia(f"send the request as application/json, not "
                                         f"{ctype or 'a body without Content-Type'}")
        raw = await media.read_body(request, s.max_upload_bytes * 4 // 3 + 2**20)
        try:
            data = json.loads(raw)
        except UnicodeDecodeError:
            raise InputError("the request body is not valid UTF-8 JSON") from None
        except ValueError as e:
            raise InputError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise InputError("the request body must be a JSON object")
        want = data.get("model")
        if want not in (None, "", model_id(), "default") and want != s.model:
            raise ModelNotFound(f"the model {want!r} is not served here; this server serves "
                                f"{model_id()!r}", served=model_id())
        if data.get("stream"):
            raise InputError("stream=true is not supported; ask without streaming")
        if data.get("n", 1) != 1:
            raise InputError("n must be 1")
        url, question = _chat_video_and_question(data.get("messages"))
        mm = data.get("mm_processor_kwargs") or {}
        if not isinstance(mm, dict):
            raise InputError("mm_processor_kwargs must be an object")
        max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
        question, params = params_of(data.get("fps", mm.get("fps")),
                                     data.get("max_frames", mm.get("max_frames")),
                                     max_tokens, data.get("attention"), question)
        path, owned = await _chat_media(url)
        ctx["path"], ctx["label"] = path, "the video"
        try:
            media.check_file(path, "the video")
        except BaseException:
            if owned:
                media.remove(path)
            raise
        upload_ms = (time.monotonic() - arrival) * 1e3
        result, job = await run_job(request, path, question, params, owned=owned)
        timings = timings_of(result, job, upload_ms, arrival)
        gen = result.tokens["generated"]
        body = {
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": result.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.answer},
                         "logprobs": None,
                         "finish_reason": "length" if gen >= params["max_new_tokens"]
                         else "stop"}],
            "usage": {"prompt_tokens": result.tokens["total"], "completion_tokens": gen,
                      "total_tokens": result.tokens["total"] + gen,
                      "prompt_tokens_details": {"visual_tokens": result.tokens["visual"]}},
            "timings": timings,
            "mminfer": {"attention": result.attention, "sparsity": result.sparsity,
                        "video": video_facts(result, None)},
        }
        return body, {"result": result, "timings": timings}

    async def _chat_media(url: str) -> tuple[str, bool]:
        """(path, owned): a temp file we own, or an allow-listed local file we do not."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return media.save_data_url(url, upload_dir, s.max_upload_bytes), True
        if scheme in ("http", "https"):
            return await media.fetch_remote(url, upload_dir, s.max_upload_bytes,
                                            s.allowed_media_domains,
                                            s.media_fetch_timeout_s), True
        if scheme == "file" or url.startswith("/"):
            return media.local_media(url, s.allowed_local_media_path), False
        raise InputError("video_url must be a data: URL, an http(s) URL or a local path "
                         f"(file:// or absolute), not {url[:40]!r}")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, "chat", chat_impl)

    # ------------------------------------------------------------ reads
    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_auth(request)
        except Unauthorized as e:
            return json_error(401, e.code, e.message, headers={"WWW-Authenticate": "Bearer"})
        p = worker.pipeline
        ctx_len = getattr(getattr(p, "adapter", None), "max_context", None)
        return {"object": "list", "data": [{"id": model_id(), "object": "model",
                                            "owned_by": "mminfer", "max_model_len": ctx_len}]}

    def window(request):
        q = request.query_params
        try:
            return parse_time(q.get("since")), parse_time(q.get("until"))
        except ValueError as e:
            raise InputError(f"bad time window: {e}") from None

    @app.get("/v1/latency-report")
    async def latency_report(request: Request):
        try:
            check_auth(request)
            since, until = window(request)
        except MMInferError as e:
            return json_error(e.http_status, e.code, e.message)
        rep = await asyncio.to_thread(store.report, since, until)
        rep["model"] = model_id()
        return rep

    @app.get("/report", response_class=HTMLResponse)
    async def report_page(request: Request):
        from .report import render
        try:
            since, until = window(request)
        except MMInferError as e:
            return json_error(e.http_status, e.code, e.message)
        rep = await asyncio.to_thread(store.report, since, until)
        rows = await asyncio.to_thread(store.rows, since, until, 1000)
        return HTMLResponse(render(rep, rows, model_id()))

    @app.get("/health")
    async def health():
        body = {"status": worker.state, "model": model_id(), "queue": worker.waiting,
                "queue_size": worker.queue_size}
        if worker.alive:
            return JSONResponse({**body, "status": "ok"})
        if worker.state == "ready":       # the thread vanished without saying why
            body["status"] = "dead"
        if worker.error:
            body["error"] = worker.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST
        metrics.waiting.set(worker.waiting)
        metrics.worker_up.set(1 if worker.alive else 0)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def root():
        return {"service": "mminfer", "model": model_id(),
                "endpoints": ["/v1/answer", "/v1/chat/completions", "/v1/models",
                              "/v1/latency-report", "/report", "/health", "/metrics"]}

    return app


def _chat_video_and_question(messages) -> tuple[str, str]:
    """The last user message's single ``video_url`` part and its text parts."""
    if messages is None:
        raise media.MissingField("`messages` is missing", field="messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("`messages` must be a non-empty list")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise InputError("`messages` has no user message")
    content = users[-1].get("content")
    if isinstance(content, str) or not isinstance(content, list):
        raise InputError("the user message has no video: give `content` as a list with a "
                         "{\"type\": \"video_url\", \"video_url\": {\"url\": ...}} part")
    urls, texts = [], []
    for part in content:
        if not isinstance(part, dict):
            raise InputError("each content part must be an object")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InputError("a text part has no string `text`")
            texts.append(part["text"])
        elif kind == "video_url":
            v = part.get("video_url")
            url = v.get("url") if isinstance(v, dict) else v
            if not isinstance(url, str) or not url:
                raise InputError("a video_url part has no `url`")
            urls.append(url)
        elif kind in ("image_url", "input_audio", "audio_url", "image"):
            raise media.UnsupportedMedia(f"{kind} parts are not supported; send one video_url")
        else:
            raise InputError(f"unknown content part type {kind!r}")
    if len(urls) != 1:
        raise InputError(f"the user message must have exactly one video_url part "
                         f"(it has {len(urls)})")
    return urls[0], "\n".join(texts)


def _quiet(fut):
    """Collect an abandoned future's exception so asyncio does not log it as unretrieved."""
    if not fut.cancelled():
        fut.exception()


def _version() -> str:
    from mminfer import __version__
    return __version__
