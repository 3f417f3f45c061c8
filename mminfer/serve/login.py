"""Signing in with an API key from a browser: ``/login`` and ``/logout``.

A browser cannot send ``Authorization: Bearer``, so with keys set the report page would be a
JSON 401. ``GET /login`` is a form for the key; ``POST /login`` checks it and sets a session
cookie (random, HttpOnly, SameSite=Lax, Secure over https, ``--session-ttl-s``), then
redirects to the page asked for (a path on this server only). The cookie is accepted by the
read-only GET routes a person looks at — ``/report``, ``/v1/latency-report`` and, for the
admin, ``/metrics`` — never by a route that changes or spends anything, so a page elsewhere
cannot act with it. Sessions live in the server's memory (the newest ``MAX_SESSIONS``): a
restart signs everyone out. A browser asking for ``/report`` without a session is sent to
``/login``; an API client still gets the JSON 401.
"""

from __future__ import annotations

import hashlib
import html
import secrets
import threading
import time
from collections import OrderedDict
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from mminfer.errors import InputError, MMInferError

from . import media
from .errors import error_response

router = APIRouter()

COOKIE = "mminfer_session"
MAX_SESSIONS = 10_000
MAX_BODY = 4096


class Sessions:
    """Session id (hashed) -> (tenant, expiry); thread-safe."""

    def __init__(self, ttl_s: float, clock=time.time):
        self.ttl_s, self.clock = float(ttl_s), clock
        self._rows: OrderedDict[str, tuple[object, float]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _h(sid: str) -> str:
        return hashlib.sha256(sid.encode()).hexdigest()

    def start(self, tenant) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._rows[self._h(sid)] = (tenant, self.clock() + self.ttl_s)
            while len(self._rows) > MAX_SESSIONS:
                self._rows.popitem(last=False)
        return sid

    def end(self, sid: str | None):
        if sid:
            with self._lock:
                self._rows.pop(self._h(sid), None)

    def tenant(self, request):
        """The tenant of the request's session cookie, None without a live one."""
        sid = request.cookies.get(COOKIE)
        if not sid or len(sid) > 128:
            return None
        with self._lock:
            row = self._rows.get(self._h(sid))
            if row is None:
                return None
            if row[1] <= self.clock():
                del self._rows[self._h(sid)]
                return None
            return row[0]


def wants_html(request) -> bool:
    """A browser's navigation (it asks for HTML); API clients get JSON."""
    return "text/html" in request.headers.get("accept", "")


def safe_next(value: str | None) -> str:
    """A path on this server to go to after signing in; anything else (another host,
    ``//host``, a scheme) is the report."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value \
            or any(ord(c) < 32 for c in value):
        return "/report"
    return value


def login_redirect(request) -> RedirectResponse:
    """To /login (a relative Location: never the client's Host), back here afterwards."""
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/login?next={quote(here, safe='')}", status_code=303)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mminfer: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:15px system-ui,sans-serif;margin:3em auto;max-width:26em}}
input{{font:inherit;width:100%;box-sizing:border-box;margin:.4em 0;padding:.4em}}
.err{{color:#b00}}</style></head>
<body><h1>mminfer</h1><p>Sign in with your API key to see the latency report.</p>{error}
<form method="post" action="/login"><input type="hidden" name="next" value="{next}">
<label>API key <input type="password" name="key" autocomplete="current-password"
autofocus required></label><input type="submit" value="Sign in"></form></body></html>
"""


def page(next_path: str, error: str = "", status: int = 200) -> HTMLResponse:
    err = f'<p class="err">{html.escape(error)}</p>' if error else ""
    return HTMLResponse(PAGE.format(error=err, next=html.escape(next_path, quote=True)),
                        status_code=status, headers={"Cache-Control": "no-store"})


@router.get("/login", include_in_schema=False)
async def login_form(request: Request):
    return page(safe_next(request.query_params.get("next")))


@router.post("/login", include_in_schema=False)
async def login(request: Request):
    svc = request.app.state.service
    try:
        raw = await media.read_body(request, svc.intake.timed(request.stream()), MAX_BODY)
        form = parse_qs(raw.decode("utf-8"), max_num_fields=8)
    except UnicodeDecodeError:
        return error_response(InputError("the form is not valid UTF-8"))
    except ValueError:
        return error_response(InputError("the form has too many fields"))
    except MMInferError as e:
        return error_response(e)
    key = (form.get("key") or [""])[0].strip()
    nxt = safe_next((form.get("next") or [""])[0])
    if not svc.keys.enabled:                 # nothing to sign in to
        return RedirectResponse(nxt, status_code=303)
    tenant = svc.keys.lookup(key) if key else None
    if tenant is None:
        svc.metrics.refuse("unauthorized")
        return page(nxt, "That key is not one of this server's.", status=401)
    resp = RedirectResponse(nxt, status_code=303)
    resp.set_cookie(COOKIE, svc.sessions.start(tenant), max_age=int(svc.sessions.ttl_s),
                    httponly=True, samesite="lax", secure=request.url.scheme == "https",
                    path="/")
    return resp


@router.api_route("/logout", methods=["GET", "POST"], include_in_schema=False)
async def logout(request: Request):
    svc = request.app.state.service
    if svc.sessions is not None:
        svc.sessions.end(request.cookies.get(COOKIE))
    resp = RedirectResponse("/login", status_code=303)
    resp.delete_cookie(COOKIE, path="/")
    return resp
