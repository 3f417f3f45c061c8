"""``mminfer serve``: load the model, then serve HTTP with uvicorn.

The model loads before the socket opens, so a bad ``--model`` fails at once with a message
instead of a server whose /health stays 503; once it listens, the URL and a curl line that
uploads a sample video are printed.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from mminfer.engine.options import add_model_arguments
from mminfer.errors import ConfigError

SAMPLE = Path("samples") / "videos" / "needle_0.mp4"


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    add_model_arguments(p, "$MMINFER_MODEL, else the embedded default model")
    p.add_argument("--data-dir", default="./mminfer-data",
                   help="latency database and upload temp files")
    p.add_argument("--max-upload-mb", type=float, default=512.0, help="largest video accepted")
    p.add_argument("--queue-size", type=int, default=8,
                   help="requests waiting for the model at most (more get 503)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="a request not answered this long after queueing gets 504")
    p.add_argument("--max-new-tokens", type=int, default=32, help="default answer length cap")
    p.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="chat requests may name local video files under DIR")
    p.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="HOST",
                   help="chat requests may name http(s) video URLs on these hosts "
                        "(remote URLs are refused without it)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))


def settings_from(args):
    from .app import Settings
    if args.queue_size < 1:
        raise ConfigError("--queue-size must be at least 1")
    if not args.max_upload_mb > 0 or not args.timeout_s > 0:
        raise ConfigError("--max-upload-mb and --timeout-s must be positive")
    return Settings(model=args.model, attention=args.attention, device=args.device,
                    dtype=args.dtype, min_sparse_len=args.min_sparse_len,
                    data_dir=args.data_dir, max_upload_mb=args.max_upload_mb,
                    queue_size=args.queue_size, timeout_s=args.timeout_s,
                    max_new_tokens=args.max_new_tokens,
                    allowed_local_media_path=args.allowed_local_media_path,
                    allowed_media_domains=tuple(h.lower() for h in args.allowed_media_domains))


def banner(host: str, port: int, model: str, api_key: bool) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    # the source tree's sample, or the current folder's (the Docker image's /app)
    video = next((p for p in (Path(__file__).resolve().parent.parent / SAMPLE, Path.cwd() / SAMPLE)
                  if p.is_file()), Path("video.mp4"))
    auth = ' -H "Authorization: Bearer $MMINFER_API_KEY"' if api_key else ""
    return "\n".join([
        f"mminfer serving {model} at {url}",
        f"  report page  {url}/report",
        f"  health       {url}/health    metrics {url}/metrics",
        "try:",
        f"  curl{auth} -F video=@{shlex.quote(str(video))} "
        f"-F question='What number appears in the video?' {url}/v1/answer",
    ])


def run(args) -> int:
    import asyncio
    import logging

    import uvicorn

    from mminfer.models.embedded import resolve_model
    from .app import create_app

    settings = settings_from(args)
    settings.model = resolve_model(settings.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    app = create_app(settings)
    worker = app.state.worker
    print(f"loading {settings.model} ...", flush=True)
    worker.start()
    if not worker.wait_ready():
        raise ConfigError(worker.error or "the model did not load")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        print("warning: listening beyond loopback without MMINFER_API_KEY: anyone who can "
              "reach this port can use the model", flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def main():
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            model = getattr(worker.pipeline, "model_id", settings.model)
            print(banner(args.host, port, model, bool(settings.api_key)), flush=True)
        await task

    asyncio.run(main())
    return 0 if server.started else 1
