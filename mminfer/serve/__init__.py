"""The HTTP service (installed as ``mminfer.serve``): ``create_app`` builds the FastAPI app,
``mminfer serve`` runs it under uvicorn. See app.py for the routes."""

from .app import Settings, create_app

__all__ = ["Settings", "create_app"]
