"""Errors -> HTTP answers, in one place.

Every error is JSON ``{"error": {"code", "message", "type", ...details}}`` (OpenAI's shape,
so OpenAI clients show the message) with the status of its kind: ``http_status`` of the
mminfer.errors class, 422 for a body FastAPI itself rejects, 499 for a client that left,
500 for a bug. Messages never carry a server path: the temp file's path is replaced by what
the client calls the video.
"""

from __future__ import annotations

import json
import logging
import math
import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from mminfer.errors import InputError, MMInferError, MissingField

log = logging.getLogger("mminfer.serve")

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error"}


class ErrorDetail(BaseModel):
    """What went wrong; details of the error (``field``, ``limit``, ``reason``, ...) beside."""
    model_config = ConfigDict(extra="allow")

    code: str = Field(description="machine-readable: bad_input, missing_field, too_large, "
                                  "over_limit, bad_video, queue_full, timeout, ...")
    message: str = Field(description="what was wrong, for a person")
    type: str = Field(description="OpenAI's error type: invalid_request_error, "
                                  "authentication_error, not_found_error, rate_limit_error, "
                                  "server_error, ...")


class ErrorResponse(BaseModel):
    """Every error the service answers, whatever the route and status."""
    error: ErrorDetail


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(code: str, message: str, status: int, **details) -> dict:
    return {"error": {"code": code, "message": message, "type": error_type(status),
                      **details}}


def plain(v):
    """Details must be JSON: numbers that are not finite become their repr."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)


def code_of(e: MMInferError) -> str:
    if isinstance(e, InputError) and "tokens" in e.details and "limit" in e.details:
        return "context_length_exceeded"       # OpenAI's code for this case
    return e.code


def describe(e: MMInferError, path: str | None = None, label: str = "the video"):
    """(status, code, body) of an error; ``path`` (a server file) is replaced by ``label``."""
    msg = e.message.replace(path, label) if path else e.message
    details = {k: plain(v) for k, v in e.details.items() if k != "path"}
    code = code_of(e)
    return e.http_status, code, error_body(code, msg, e.http_status, **details)


def json_response(status: int, body: dict, headers: dict | None = None):
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(e: MMInferError, headers: dict | None = None):
    status, _, body = describe(e)
    h = dict(headers or {})
    if status == 401:
        h["WWW-Authenticate"] = "Bearer"
    return json_response(status, body, h)


def install(app):
    """Handlers for what escapes a route: FastAPI's own 404/405/422, our errors, bugs."""
    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # every method the path has (Starlette names only the first route that matched)
            methods = allowed_methods(app, request.url.path)
            if methods:
                headers["Allow"] = ", ".join(methods)
        return json_response(exc.status_code, error_body(code, str(exc.detail),
                                                         exc.status_code), headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return json_response(422, error_body(
            "invalid_request", "the request is malformed",
            422, detail=json.loads(json.dumps(exc.errors(), default=str))))

    @app.exception_handler(MMInferError)
    async def mminfer_error(request, exc):
        return error_response(exc)

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        log.exception("unhandled error")
        return json_response(500, error_body("internal",
                                             f"internal error: {type(exc).__name__}", 500))


def allowed_methods(app, path: str) -> list[str]:
    """The methods /openapi.json documents at ``path`` (HEAD too where GET is: Starlette
    answers it), sorted; empty for a path it does not document."""
    methods: set[str] = set()
    for template, ops in app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)), path):
            methods |= {m.upper() for m in ops}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def _loc(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the body"


def from_validation(exc, missing=lambda field: f"`{field}` is missing") -> MMInferError:
    """A pydantic ValidationError of a request schema as the error a client reads: a missing
    field is 422 ``missing_field``, anything else 400 ``bad_input`` naming the field, what it
    must be and what it was."""
    e = exc.errors()[0]
    field = _loc(e["loc"])
    if e["type"] == "missing":
        return MissingField(missing(field), field=field)
    msg = e["msg"].removeprefix("Value error, ")
    msg = msg.replace("Input should be", "must be").replace("Input tag", "the tag")
    shown = repr(e.get("input"))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return InputError(f"{field} {msg[0].lower() + msg[1:]}, not {shown}", field=field)


def validate(model, data, **how):
    """``model.model_validate(data)``, its errors as ``from_validation`` says."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, **how) from None
