"""The HTTP service (installed as ``mminfer.serve``): ``create_app`` builds the FastAPI app,
``mminfer serve`` runs it under uvicorn. See app.py for the routes.

Nothing is imported until asked for: ``mminfer --help`` looks this package up, and must not
pay for numpy, FastAPI and the video decoders."""

__all__ = ["Settings", "create_app"]


def __getattr__(name):
    if name == "Settings":
        from .settings import Settings
        return Settings
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
