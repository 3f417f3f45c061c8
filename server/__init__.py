"""The HTTP service (installed as ``mminfer.server``): ``create_app`` builds the FastAPI app,
``mminfer serve`` runs it under uvicorn. See app.py for the routes."""

from .app import Settings, create_app, default_model, resolve_model

__all__ = ["Settings", "create_app", "default_model", "resolve_model"]
