"""GET /docs: Swagger UI over /openapi.json, from assets this server serves itself.

FastAPI's own page loads Swagger UI from a CDN, which leaves it blank on a machine without
internet access, where mminfer is meant to run too. The assets come from the
``fastapi-offline`` package (a maintained copy of Swagger UI 5's bundle, CSS and a favicon,
a dependency of mminfer); only those files are served, under /docs/assets/.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from . import errors

ASSETS = files("fastapi_offline") / "static"
_TYPES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "favicon.png": "image/png"}

router = APIRouter()


@router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}", title=f"{request.app.title} API",
        swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
        swagger_favicon_url=f"{root}/docs/assets/favicon.png",
        # the online validator badge would fetch from swagger.io
        swagger_ui_parameters={"validatorUrl": None})


@router.get("/docs/assets/{name}", include_in_schema=False)
async def asset(name: str):
    if name not in _TYPES:
        return errors.json_response(404, errors.error_body(
            "not_found", f"no such documentation asset: {name}", 404))
    return FileResponse(str(ASSETS / name), media_type=_TYPES[name],
                        headers={"Cache-Control": "public, max-age=86400"})
