"""The GET routes: ``/health`` (probes), ``/metrics`` (Prometheus), ``/v1/latency-report``
(JSON) and ``/report`` (the page).

With API keys set (serve/tenants.py), the latency report and its page need a key as the /v1
routes do, or a /login session's cookie (login.py; a browser without one is sent to
/login): a tenant reads its own requests' history, the admin every tenant's (``?tenant=``:
one of them) and the shadow monitor's figures. The report's ``streams`` (the page's Live
streams section) are the live streams' figures, with the tenant's own streams (the admin's:
every tenant's). ``/metrics`` is the whole server's: it takes the admin's key (or session) or
``--metrics-token`` as a bearer token, for a scraper (``--metrics-token`` alone, without keys,
guards it too). /health stays open for probes."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mminfer.errors import Forbidden, InputError, Unauthorized

from . import live
from .login import login_redirect, wants_html
from .report import render
from .service import bearer
from .store import parse_time

router = APIRouter()


def _window(request):
    q = request.query_params
    try:
        return parse_time(q.get("since")), parse_time(q.get("until"))
    except ValueError as e:
        raise InputError(f"bad time window: {e}") from None


def _scope(request, tenant) -> str | None:
    """Whose history a report reads: a tenant's own; the admin's, every tenant's (None) or
    the one ``?tenant=`` names."""
    asked = request.query_params.get("tenant") or None
    if not tenant.admin:
        if asked not in (None, tenant.name):
            raise Forbidden("a tenant's key reads its own history only")
        return tenant.name
    return asked


@router.get("/v1/latency-report", summary="Latency per stage and prompt length (JSON)")
async def latency_report(request: Request):
    svc = request.app.state.service
    tenant = svc.check_auth(request, cookie=True)
    since, until = _window(request)
    scope = _scope(request, tenant)
    rep = await asyncio.to_thread(svc.store.report, since, until, scope)
    rep["model"] = svc.model_id()
    rep["tenant"] = scope
    rep["policy"] = _policy(svc)
    rep["device"] = _device(svc)
    rep["now"] = _now(svc)
    rep["shadow"] = (await asyncio.to_thread(_shadow_report, request, since, until)
                     if tenant.admin else None)
    rep["streams"] = live.summary(svc, scope, every=scope is None and tenant.admin)
    return rep


@router.get("/report", response_class=HTMLResponse, summary="The latency report page")
async def report_page(request: Request):
    svc = request.app.state.service
    try:
        tenant = svc.check_auth(request, cookie=True)
    except Unauthorized:
        if wants_html(request):       # a browser: sign in first, then come back
            return login_redirect(request)
        raise
    since, until = _window(request)
    scope = _scope(request, tenant)
    rep = await asyncio.to_thread(svc.store.report, since, until, scope)
    rep["shadow"] = (await asyncio.to_thread(_shadow_report, request, since, until)
                     if tenant.admin else None)
    rows = await asyncio.to_thread(svc.store.rows, since, until, 1000, scope)
    rep["policy"] = _policy(svc)
    rep["tenant"] = scope
    rep["device"] = _device(svc)
    rep["now"] = _now(svc)
    rep["streams"] = live.summary(svc, scope, every=scope is None and tenant.admin)
    return HTMLResponse(render(rep, rows, svc.model_id()))


def _policy(svc) -> dict | None:
    """The served model's head-pattern state and what "auto" attention does with it."""
    p = getattr(svc.worker, "pipeline", None)
    return p.attention_policy() if hasattr(p, "attention_policy") else None


def _now(svc) -> dict:
    """The requests in the server right now: queued, in progress, and what those do (building a
    prefix, paused at a layer boundary for short work, decoding)."""
    w = svc.worker
    p = w.progress() if hasattr(w, "progress") else {}
    return {"queued": w.waiting, "running": w.running, "prefilling": p.get("prefilling", 0),
            "waiting_admission": p.get("waiting_admission", 0), "paused": p.get("paused", 0),
            "decoding": p.get("decoding", 0)}


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
    progress = w.progress()
    body = {"status": w.state, "model": svc.model_id(), "queue": w.waiting,
            "reserved": w.reserved, "running": w.running, "queue_size": w.queue_size,
            "max_active": w.max_active, "prefilling": progress["prefilling"],
            "waiting_admission": progress["waiting_admission"],
            "paused": progress["paused"], "decoding": progress["decoding"],
            "uploads": svc.intake.active}
    engines = getattr(w, "engines_health", None)    # --data-parallel: each engine process
    if engines is not None:
        body["engines"] = engines(ids=not svc.keys.enabled)
    if not svc.keys.enabled:    # /health is open: with keys set, no client's request id
        body["running_request_id"] = job.request_id if job is not None else None
        body["running_request_ids"] = [j.request_id for j in w.active_jobs()]
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


def check_metrics_access(svc, request):
    """The admin's key or session, or the metrics token; 401 without, 403 for a tenant's."""
    token = svc.s.metrics_token
    if token is not None:
        got = bearer(request)
        if got is not None and hmac.compare_digest(got.encode(), token.encode()):
            return
        if not svc.keys.enabled:
            raise Unauthorized("the metrics need this server's metrics token: send "
                               "`Authorization: Bearer <token>`")
    if not svc.keys.enabled:
        return
    tenant = svc.check_auth(request, cookie=True)
    if not tenant.admin:
        raise Forbidden("the metrics are the whole server's: scrape them with the admin's key "
                        "or the server's --metrics-token")


@router.get("/metrics", summary="Prometheus metrics")
async def prometheus(request: Request):
    svc = request.app.state.service
    check_metrics_access(svc, request)
    svc.metrics.waiting.set(svc.worker.waiting)
    svc.metrics.running.set(svc.worker.running)
    svc.metrics.progress(svc.worker.progress())
    svc.metrics.worker_up.set(1 if svc.worker.alive else 0)
    return Response(svc.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", include_in_schema=False)
async def root(request: Request):
    return {"service": "mminfer", "model": request.app.state.service.model_id(),
            "endpoints": ["/v1/answer", "/v1/chat/completions", "/v1/videos", "/v1/streams",
                          "/v1/models",
                          "/v1/latency-report", "/report", "/login", "/health", "/metrics",
                          "/docs"]}
