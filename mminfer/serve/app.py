"""The HTTP service: upload a video and a question, get the answer with where the time went.

    POST /v1/answer             multipart: video file + question (+ fps, max_frames,
                                max_new_tokens, attention)                      answer.py
    POST /v1/chat/completions   OpenAI shape; ``video_url`` parts (data: URLs, allow-listed
                                local paths, allow-listed remote hosts); stream=true
                                as server-sent events                 openai.py, stream.py
    POST/GET/DELETE /v1/videos[/{id}]   upload once, ask by id (``video_id`` form field,
                                ``mminfer://videos/{id}`` video_url)            videos.py
    POST/GET/DELETE /v1/streams[/{id}[/segments]]   live video: pushed pieces or a pulled
                                source; ask with ``stream_id``, ``mminfer://streams/{id}``
                                                                      live.py, live_ops.py
    GET  /v1/models                                                             openai.py
    GET  /v1/latency-report (JSON), /report (page), /health, /metrics            reads.py
    GET/POST /login, /logout    a session cookie from an API key, for the report page  login.py
    GET  /docs, /openapi.json   both POST bodies documented from their schemas; the
                                page's Swagger UI served from here, not a CDN   apidocs.py

One request's life (auth, queue slot, timed intake, budgets, the job, its record) is
service.py; errors become JSON answers in errors.py; the model thread and its queue are
worker.py. Timings (ms) of a request: ``upload`` (receiving the body, decoding a data: URL,
fetching a URL), ``queue`` (waiting for the model worker), the pipeline stages, ``ttft``
(arrival to the first answer token) and ``total`` (arrival to answer).

Bearer auth (``MMINFER_API_KEY``, as vLLM's ``--api-key``; more keys, each naming a tenant,
in tenants.py) guards the /v1 routes, the report page (or a /login session) and /metrics
(the admin's key or ``--metrics-token``); /health stays open for probes.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from mminfer import __version__
from mminfer.engine.pipeline import Pipeline
from mminfer.engine.timing import SERVED_STAGES as STAGE_ORDER
from mminfer.errors import ConfigError
from mminfer.kernels import compiles
from mminfer.models.base import resolve_checkpoint
from mminfer.models.embedded import resolve_model

from . import answer, apidocs, errors, jsonbody, live, login, media, openai, reads, videos
from .metrics import Metrics
from .selfcal import SelfCalibration, SelfCalibrationCollector
from .service import Service
from .settings import Settings
from .shadow import ShadowMonitor, ShadowStore
from .store import LatencyStore
from .worker import ModelWorker

__all__ = ["STAGE_ORDER", "Settings", "create_app"]

log = logging.getLogger("mminfer.serve")


def create_app(settings: Settings | None = None, worker: ModelWorker | None = None):
    """The FastAPI app; the model loads on the worker thread when the app starts (or pass a
    ``worker`` already started, as the CLI does to fail fast on a bad model)."""

    s = settings or Settings()
    model_path = resolve_model(s.model)
    data_dir = Path(s.data_dir)
    upload_dir = data_dir / "uploads"
    upload_dir.mkdir(parents=True, exist_ok=True)
    store = LatencyStore(data_dir / "latency.sqlite3", retention_days=s.report_retention_days,
                         max_rows=s.report_max_rows)
    metrics = Metrics(s.served_model_names[0] if s.served_model_names else
                      model_name(model_path))
    if worker is None:
        def load():
            pipe = load_pipeline(s, model_path)
            if worker.selfcal is not None:     # a stored config serves from the first request
                worker.selfcal.attach(pipe)
            return pipe
        worker = ModelWorker(load, queue_size=s.queue_size, metrics=metrics,
                             max_active=s.max_num_seqs, decode_share=s.decode_share)
    else:
        worker.metrics = metrics
    # the shadow-dense monitor: its rows live in the latency store's file, same retention
    shadow_store = ShadowStore(store.path, retention_days=s.report_retention_days,
                               max_rows=s.report_max_rows)
    worker.shadow = ShadowMonitor(s.shadow_rate, int(s.shadow_max_mb * 2**20),
                                  s.shadow_max_new_tokens, metrics=metrics, store=shadow_store)
    if s.self_calibrate:             # measured configs for new weights, in idle time
        worker.selfcal = SelfCalibration(
            model_path=model_path, cache_dir=s.calibration_dir or data_dir / "calibration",
            from_requests=s.calibrate_from_requests,
            capture_bytes=int(s.calibration_capture_mb * 2**20),
            min_agreement=s.calibration_min_agreement, max_kl=s.calibration_max_kl,
            max_density=s.calibration_max_density,
            requests=s.calibration_requests, gate_requests=s.calibration_gate_requests,
            window=s.calibration_window, synthetic=s.calibration_synthetic,
            synthetic_frames=s.calibration_synthetic_frames)
        worker.shadow.on_compare = worker.selfcal.on_comparison
        metrics.registry.register(SelfCalibrationCollector(worker.selfcal, metrics.model))

    video_store = videos.VideoStore(data_dir / "videos",
                                    max_bytes=int(s.video_store_gb * 2**30),
                                    max_count=s.video_store_max, ttl_s=s.video_ttl_s)
    # the engine's video cache, read when /metrics is scraped
    metrics.watch_cache(lambda: getattr(getattr(worker.pipeline, "video_cache", None),
                                        "stats", lambda: None)())
    metrics.watch_store(video_store.stats)
    # Triton's compilations: this process's, or the engines' under --data-parallel
    metrics.watch_compiles(getattr(worker, "compile_stats", compiles.stats))

    @asynccontextmanager
    async def lifespan(app):
        for stale in upload_dir.glob(media.TEMP_PREFIX + "*"):   # left by a killed server
            media.remove(str(stale))
        worker.start()
        jsonbody.start()          # the JSON parsing processes, before the first chat body
        sweep = asyncio.create_task(videos.sweeper(
            video_store, min(max(s.video_ttl_s / 4, 1.0), 60.0) if s.video_ttl_s else 3600.0))
        yield
        sweep.cancel()
        await asyncio.to_thread(worker.stop)
        await asyncio.to_thread(jsonbody.stop)
        store.close()
        shadow_store.close()

    # redirect_slashes off: Starlette's redirect of "/v1/videos/{id}/" names the Host the
    # client sent (an open redirect); such a path is a 404
    app = FastAPI(title="mminfer", version=_version(), lifespan=lifespan, docs_url=None,
                  redoc_url=None, redirect_slashes=False, description="Answers about long videos, with where the "
                                              "time went (see the README).")
    service = Service(s, worker, store, metrics, model_path, upload_dir, video_store)
    service.sessions = login.Sessions(s.session_ttl_s)
    metrics.watch_streams(lambda: live.stats(service))
    app.state.settings, app.state.worker, app.state.store = s, worker, store
    app.state.metrics, app.state.upload_dir, app.state.service = metrics, upload_dir, service
    app.state.shadow = worker.shadow
    app.state.selfcal = getattr(worker, "selfcal", None)
    errors.install(app)
    for module in (answer, openai, videos, live, reads, login, apidocs):
        app.include_router(module.router)
    app.openapi = lambda: _openapi(app, (answer.AnswerForm, live.StreamCreate,
                                         *openai.SCHEMAS))
    return app


def load_pipeline(s: Settings, model_path: str) -> Pipeline:
    """The served Pipeline, loaded and warmed up (the model worker's ``load``; each engine
    process's under --data-parallel)."""
    pipe = Pipeline(model_path, attention=s.attention, device=s.device, dtype=s.dtype,
                    min_sparse_len=s.min_sparse_len, kv_cache_gb=s.kv_cache_gb,
                    kv_host_cache_gb=s.kv_host_cache_gb,
                    kv_cache_dtype=s.kv_cache_dtype, quantization=s.quantization)
    # kernels compile here, before /health says ready, not in a user's first request
    warm = pipe.warmup(batch=s.max_num_seqs)
    if warm.get("ran"):
        log.info("warm-up: %s", warm)
    return pipe


def model_name(model_path: str) -> str:
    """The id the pipeline will give the model, known before it loads (a local folder: its
    name, or the hub id of a cache snapshot; a hub id: itself)."""
    if not Path(model_path).expanduser().exists():
        return model_path
    try:
        return resolve_checkpoint(model_path)[1]
    except ConfigError:
        return Path(model_path).name


# What each route answers besides its 200, every one in the one error shape
# (errors.ErrorResponse). The connection layer's refusals (protocol.py: 400 bad_http, 408
# header_timeout, 431, 503 too_many_connections) can come before any route, and are not listed.
_ASK = (400, 401, 403, 404, 408, 413, 415, 422, 429, 500, 503, 504, 507)
ERROR_RESPONSES = {
    ("post", "/v1/answer"): _ASK + (409,),
    ("post", "/v1/chat/completions"): _ASK + (409,),
    ("post", "/v1/videos"): (400, 401, 408, 413, 415, 422, 500, 503, 507),
    ("get", "/v1/videos"): (401,),
    ("get", "/v1/videos/{video_id}"): (401, 404),
    ("delete", "/v1/videos/{video_id}"): (401, 404),
    ("post", "/v1/streams"): (400, 401, 403, 404, 409, 413, 422, 503),
    ("get", "/v1/streams"): (401, 503),
    ("get", "/v1/streams/{stream_id}"): (401, 404, 503),
    ("delete", "/v1/streams/{stream_id}"): (401, 404, 503),
    ("post", "/v1/streams/{stream_id}/segments"): (400, 401, 404, 408, 409, 413, 415, 422, 429,
                                                   499, 500, 503, 504, 507),
    ("get", "/v1/models"): (401,),
    ("get", "/v1/latency-report"): (400, 401),
    ("get", "/report"): (400, 401),
    ("get", "/health"): (),
    ("get", "/metrics"): (),
}
STATUS_DOCS = {
    400: "a wrong value (`field` names it) or a malformed body",
    401: "no or a wrong API key (`Authorization: Bearer`, when the server has one)",
    403: "not allowed here (attention=sparse where the server decides, a local path outside "
         "the allowed folder)",
    404: "an unknown model name, video id or stream id",
    409: "the live stream is full (its budget or the model's context) or deleted",
    499: "the client left before the piece was taken in",
    408: "the body arrived too slowly",
    413: "over a size or budget limit (`limit` says it)",
    415: "not a video, or not the body type the route reads",
    422: "a missing field or file part, or a video its decoder cannot read (`reason`)",
    429: "this client's share of upload slots is taken (Retry-After)",
    500: "a bug: the log has it under the answer's request id",
    503: "full, loading, the model worker gone, or shutting down (Retry-After)",
    504: "not answered within the server's --timeout-s",
    507: "the server's disk or its video store is full",
}
# 200s that are not JSON
CONTENT = {
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}}},
    ("post", "/v1/chat/completions"): {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {"schema": {"type": "string"},
                              "description": "with stream=true: chat.completion.chunk events"}},
}


def _openapi(app, models) -> dict:
    """FastAPI's schema plus the request bodies the POST routes read themselves (they stream
    and limit the body, so FastAPI never sees a parameter to document), and every error each
    route answers (ERROR_RESPONSES) in the one error shape: a contract clients are generated
    from, checked by a schema-driven fuzz run (tests/serve/test_openapi_contract.py)."""
    if app.openapi_schema:
        return app.openapi_schema

    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in (*models, errors.ErrorResponse)],
                                 ref_template="#/components/schemas/{model}")
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs["$defs"])
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            out = op["responses"]
            out.pop("422", None)            # FastAPI's own shape: ours answers instead
            for status in ERROR_RESPONSES.get((method, path), (401,)):
                out[str(status)] = {"description": STATUS_DOCS[status],
                                    "content": {"application/json": {"schema": ref}}}
            if (method, path) in CONTENT:
                out["200"]["content"] = CONTENT[(method, path)]
    health = schema["paths"]["/health"]["get"]["responses"]
    health["503"] = {"description": "loading, the model worker gone, or the data folder full "
                                    "(`status` says which)",
                     "content": {"application/json": {"schema": {"type": "object"}}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    app.openapi_schema = schema
    return schema


def _version() -> str:
    return __version__
