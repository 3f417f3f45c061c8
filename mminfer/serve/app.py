"""The HTTP service: upload a video and a question, get the answer with where the time went.

    POST /v1/answer             multipart: video file + question (+ fps, max_frames,
                                max_new_tokens, attention)                      answer.py
    POST /v1/chat/completions   OpenAI shape; ``video_url`` parts (data: URLs, allow-listed
                                local paths, allow-listed remote hosts); stream=true
                                as server-sent events                 openai.py, stream.py
    POST/GET/DELETE /v1/videos[/{id}]   upload once, ask by id (``video_id`` form field,
                                ``mminfer://videos/{id}`` video_url)            videos.py
    GET  /v1/models                                                             openai.py
    GET  /v1/latency-report (JSON), /report (page), /health, /metrics            reads.py
    GET  /docs, /openapi.json   both POST bodies documented from their schemas; the
                                page's Swagger UI served from here, not a CDN   apidocs.py

One request's life (auth, queue slot, timed intake, budgets, the job, its record) is
service.py; errors become JSON answers in errors.py; the model thread and its queue are
worker.py. Timings (ms) of a request: ``upload`` (receiving the body, decoding a data: URL,
fetching a URL), ``queue`` (waiting for the model worker), the pipeline stages, ``ttft``
(arrival to the first answer token) and ``total`` (arrival to answer).

Bearer auth (``MMINFER_API_KEY``) guards the /v1 routes and the report page, as vLLM's
``--api-key`` does; /health and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from pydantic.json_schema import models_json_schema

from mminfer import __version__
from mminfer.engine.pipeline import Pipeline
from mminfer.engine.timing import SERVED_STAGES as STAGE_ORDER
from mminfer.errors import ConfigError
from mminfer.models.base import resolve_checkpoint
from mminfer.models.embedded import resolve_model

from . import apidocs, errors, jsonbody, media
from .metrics import Metrics
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
    # lazy: FastAPI (imported by these route modules too) takes ~1 s to import, and
    # `mminfer serve --help` imports this module
    from fastapi import FastAPI

    from . import answer, openai, reads, videos  # lazy: they import FastAPI

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
            pipe = Pipeline(model_path, attention=s.attention, device=s.device, dtype=s.dtype,
                            min_sparse_len=s.min_sparse_len, kv_cache_gb=s.kv_cache_gb,
                            kv_host_cache_gb=s.kv_host_cache_gb,
                            kv_cache_dtype=s.kv_cache_dtype, quantization=s.quantization)
            # kernels compile here, before /health says ready, not in a user's first request
            warm = pipe.warmup()
            if warm.get("ran"):
                log.info("warm-up: %s", warm)
            return pipe
        worker = ModelWorker(load, queue_size=s.queue_size, metrics=metrics)
    else:
        worker.metrics = metrics
    # the shadow-dense monitor: its rows live in the latency store's file, same retention
    shadow_store = ShadowStore(store.path, retention_days=s.report_retention_days,
                               max_rows=s.report_max_rows)
    worker.shadow = ShadowMonitor(s.shadow_rate, int(s.shadow_max_mb * 2**20),
                                  s.shadow_max_new_tokens, metrics=metrics, store=shadow_store)

    video_store = videos.VideoStore(data_dir / "videos",
                                    max_bytes=int(s.video_store_gb * 2**30),
                                    max_count=s.video_store_max, ttl_s=s.video_ttl_s)
    # the engine's video cache, read when /metrics is scraped
    metrics.watch_cache(lambda: getattr(getattr(worker.pipeline, "video_cache", None),
                                        "stats", lambda: None)())
    metrics.watch_store(video_store.stats)

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

    app = FastAPI(title="mminfer", version=_version(), lifespan=lifespan, docs_url=None,
                  redoc_url=None, description="Answers about long videos, with where the "
                                              "time went (see the README).")
    service = Service(s, worker, store, metrics, model_path, upload_dir, video_store)
    app.state.settings, app.state.worker, app.state.store = s, worker, store
    app.state.metrics, app.state.upload_dir, app.state.service = metrics, upload_dir, service
    app.state.shadow = worker.shadow
    errors.install(app)
    for module in (answer, openai, videos, reads, apidocs):
        app.include_router(module.router)
    app.openapi = lambda: _openapi(app, (answer.AnswerForm, *openai.SCHEMAS))
    return app


def model_name(model_path: str) -> str:
    """The id the pipeline will give the model, known before it loads (a local folder: its
    name, or the hub id of a cache snapshot; a hub id: itself)."""
    if not Path(model_path).expanduser().exists():
        return model_path
    try:
        return resolve_checkpoint(model_path)[1]
    except ConfigError:
        return Path(model_path).name


def _openapi(app, models) -> dict:
    """FastAPI's schema plus the request bodies the POST routes read themselves (they stream
    and limit the body, so FastAPI never sees a parameter to document)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi  # lazy: as in create_app

    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in models],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    app.openapi_schema = schema
    return schema


def _version() -> str:
    return __version__
