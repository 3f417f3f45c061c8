"""The HTTP service: ``app.create_app(settings)`` builds the FastAPI app (see app.py for the
routes), ``mminfer serve`` (cli.py) runs it under uvicorn.

Nothing is imported here: ``mminfer serve --help`` imports this package on its way to the
light cli.py, and must not pay for the app, numpy and the engine."""
