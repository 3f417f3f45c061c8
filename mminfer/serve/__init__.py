"""The HTTP service (installed as ``mminfer.serve``): ``create_app`` builds the FastAPI app,
``mminfer serve`` runs it under uvicorn. See app.py for the routes.

Nothing is imported until asked for: ``mminfer --help`` looks this package up, and must not
pay for numpy, FastAPI and the video decoders."""

__all__ = ["Settings", "create_app"]


# lazy: `mminfer --help` finds the serve subcommand's module (importlib.util.find_spec), which
# runs this file; plain imports here would load the app's numpy, pydantic and decoders into it
# (tests/test_cli.py test_help_is_light), so the two names load on first use
def __getattr__(name):
    if name == "Settings":
        from .settings import Settings  # lazy: see above
        return Settings
    if name == "create_app":
        from .app import create_app  # lazy: see above
        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
