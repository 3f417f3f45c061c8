"""The GET routes: ``/health`` (probes), ``/metrics`` (Prometheus), ``/v1/latency-report``
(JSON) and ``/report`` (the page). With ``MMINFER_API_KEY`` set, the latency report and
its page need the key as the /v1 routes do; /health and /metrics stay open for probes and
scrapers."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mminfer.errors import InputError

from .report import render
from .store import parse_time

router = APIRouter()


def _window(request):
    q = request.query_params
    try:
        return parse_time(q.get("since")), parse_time(q.get("until"))
    except ValueError as e:
        raise InputError(f"bad time window: {e}") from None


@router.get("/v1/latency-report", summary="Latency per stage and prompt length (JSON)")
async def latency_report(request: Request):
    svc = request.app.state.service
    svc.check_auth(request)
    since, until = _window(request)
    rep = await asyncio.to_thread(svc.store.report, since, until)
    rep["model"] = svc.model_id()
    rep["policy"] = _policy(svc)
    rep["device"] = _device(svc)
    rep["shadow"] = await asyncio.to_thread(_shadow_report, request, since, until)
    return rep


@router.get("/report", response_class=HTMLResponse, summary="The latency report page")
async def report_page(request: Request):
    svc = request.app.state.service
    svc.check_auth(request)
    since, until = _window(request)
    rep = await asyncio.to_thread(svc.store.report, since, until)
    rep["shadow"] = await asyncio.to_thread(_shadow_report, request, since, until)
    rows = await asyncio.to_thread(svc.store.rows, since, until, 1000)
    rep["policy"] = _policy(svc)
    rep["device"] = _device(svc)
    return HTMLResponse(render(rep, rows, svc.model_id()))


def _policy(svc) -> dict | None:
    """The served model's head-pattern state and what "auto" attention does with it."""
    p = getattr(svc.worker, "pipeline", None)
    return p.attention_policy() if hasattr(p, "attention_policy") else None


def _device(svc) -> str | None:
    """The served model's device type ("cuda", "cpu"): where a cache hit's prefix is kept."""
    device = getattr(getattr(svc.worker, "pipeline", None), "device", None)
    return getattr(device, "type", None)


def _shadow_report(request, since, until) -> dict | None:
    """The shadow-dense monitor's figures (serve/shadow.py) for the window."""
    monitor = getattr(request.app.state, "shadow", None)
    if monitor is None or monitor.store is None:
        return None
    return {"settings": monitor.settings(), **monitor.store.report(since, until)}


@router.get("/health", summary="Liveness and queue (503 while the model is not serving)")
async def health(request: Request):
    svc = request.app.state.service
    w = svc.worker
    job = w.running_job()
    body = {"status": w.state, "model": svc.model_id(), "queue": w.waiting,
            "reserved": w.reserved, "running": w.running, "queue_size": w.queue_size,
            "uploads": svc.intake.active}
    if not svc.s.api_key:       # /health is open: with a key set, no client's request id
        body["running_request_id"] = job.request_id if job is not None else None
    if w.alive and svc.storage.full():
        free = svc.storage.free_bytes()
        return JSONResponse({**body, "status": "storage_full", "error": "no space left under "
                             "the data folder: uploads are answered 507",
                             "free_bytes": free}, status_code=503)
    if w.alive:
        return JSONResponse({**body, "status": "ok"})
    if w.state == "ready":       # the thread vanished without saying why
        body["status"] = "dead"
    if w.error:
        body["error"] = w.error
    return JSONResponse(body, status_code=503)


@router.get("/metrics", summary="Prometheus metrics")
async def prometheus(request: Request):
    svc = request.app.state.service
    svc.metrics.waiting.set(svc.worker.waiting)
    svc.metrics.worker_up.set(1 if svc.worker.alive else 0)
    return Response(svc.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", include_in_schema=False)
async def root(request: Request):
    return {"service": "mminfer", "model": request.app.state.service.model_id(),
            "endpoints": ["/v1/answer", "/v1/chat/completions", "/v1/videos", "/v1/models",
                          "/v1/latency-report", "/report", "/health", "/metrics", "/docs"]}
