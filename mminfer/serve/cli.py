"""``mminfer serve``: load the model, then serve HTTP with uvicorn.

The model loads before the socket opens, so a bad ``--model`` fails at once with a message
instead of a server whose /health stays 503; once it listens, the URL and a curl line that
uploads a sample video are printed.

The module itself is light (argparse, uvicorn, the settings' defaults): ``mminfer serve
--help`` imports it, and ``run`` imports the app and the engine under it.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import faulthandler
import logging
import shlex
import signal
import socket
from pathlib import Path

import uvicorn

from mminfer.cli_options import add_model_arguments, pipeline_options
from mminfer.errors import ConfigError
from mminfer.models.embedded import resolve_model
from mminfer.offline.thresholds import add_threshold_arguments

from .settings import DEFAULT_MAX_IMBALANCE, Settings

SAMPLE = Path("samples") / "videos" / "needle_0.mp4"


def add_arguments(p: argparse.ArgumentParser):
    d = Settings                     # its defaults are the flags' defaults
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    add_model_arguments(p, "$MMINFER_MODEL, else the embedded default model")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", default=[],
                   help="the model's id in answers and /v1/models (the first), and aliases a "
                        "request may name it by (default: the checkpoint's name)")
    p.add_argument("--data-dir", default=d.data_dir,
                   help="latency database, stored videos (/v1/videos) and upload temp files")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="server log verbosity (uvicorn's and mminfer's); debug also logs "
                        "every request")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N processes started by `torchrun "
                        "--nproc-per-node N -m mminfer serve ...`: rank 0 serves HTTP, the "
                        "others follow its requests (default: 1)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N engine processes, one per GPU (CUDA_VISIBLE_DEVICES), each with its "
                        "own model copy, video cache and scheduler, behind this one HTTP "
                        "server; each video's questions go to the engine that holds its "
                        "prefix (default: 1, the model in this process)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run the engines as Ray Serve replicas on the Ray cluster at ADDRESS "
                        "(auto: the one this machine joined with `ray start`; local: start one "
                        "here), one per GPU of the cluster, behind this HTTP server; each "
                        "video's questions go to the replica that holds its prefix "
                        "(docs/deployment.md)")
    p.add_argument("--ray-replicas", type=int, metavar="N",
                   help="with --ray: N replicas (default: one per GPU of the cluster; without "
                        "GPUs, 1)")
    p.add_argument("--dp-routing", choices=("affinity", "round_robin"), default="affinity",
                   help="with --data-parallel or --ray: affinity sends a question to the "
                        "engine whose cache holds its video (a new video to the least loaded); "
                        "round_robin ignores the caches (for comparison)")
    p.add_argument("--affinity-max-imbalance", type=int, default=DEFAULT_MAX_IMBALANCE,
                   metavar="K",
                   help="with --data-parallel or --ray: a question goes to its video's "
                        "engine unless that engine has more than K requests in flight beyond "
                        "the least loaded one (then the least loaded rebuilds the prefix)")

    g = p.add_argument_group("request defaults")
    g.add_argument("--fps", type=float, default=d.fps, help="frames sampled per second")
    g.add_argument("--max-frames", type=int, default=d.max_frames,
                   help="at most this many frames (at most --max-frames-limit)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="answer length cap")

    g = p.add_argument_group("queue and time")
    g.add_argument("--queue-size", type=int, default=d.queue_size,
                   help="requests waiting for the model (or still uploading) at most; more "
                        "get 503 before their body is read")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="requests in progress at once, taking turns on the model: a cache "
                        "hit's question and decode steps pass a long prefill between its "
                        "layers (one long prefill computes at a time); 1 answers one request "
                        "after the other")
    g.add_argument("--decode-share", type=float, default=d.decode_share,
                   help="while a long prefill waits to resume, the share of the model's time "
                        "that decode steps (answers' tokens after the first) get (questions' "
                        "first tokens always pass first)")
    g.add_argument("--timeout-s", type=float, default=d.timeout_s,
                   help="a request not answered this long after queueing gets 504 and is "
                        "stopped")
    g.add_argument("--graceful-shutdown-s", type=float, default=10.0,
                   help="on SIGTERM/SIGINT: queued requests get 503 at once; in-flight answers "
                        "are written for at most this long")

    g = p.add_argument_group("intake limits")
    g.add_argument("--max-upload-mb", type=float, default=d.max_upload_mb,
                   help="largest video accepted")
    g.add_argument("--max-data-url-mb", type=float, default=d.max_data_url_mb,
                   help="largest video inside a chat request's data: URL")
    g.add_argument("--max-concurrent-uploads", type=int, default=d.max_concurrent_uploads,
                   help="request bodies received at once; more get 503 (default: the "
                        "queue size)")
    g.add_argument("--upload-deadline-s", type=float, default=d.upload_deadline_s,
                   help="a body must arrive within this (else 408)")
    g.add_argument("--min-upload-kbps", type=float, default=d.min_upload_kbps,
                   help="a body must average at least this many KiB/s after the grace period")
    g.add_argument("--upload-grace-s", type=float, default=d.upload_grace_s,
                   help="seconds before the minimum upload rate applies")
    g.add_argument("--max-uploads-per-client", type=int, default=d.max_uploads_per_client,
                   help="request bodies one client address sends at once; more get 429 "
                        "(default: half of --max-concurrent-uploads; 0: no limit)")
    g.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s,
                   help="a request's headers must arrive within this (else 408, closed)")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections at most; more are answered 503 and closed")
    g.add_argument("--max-connections-per-client", type=int,
                   default=d.max_connections_per_client,
                   help="open connections from one client address at most")
    g.add_argument("--max-json-items", type=int, default=d.max_json_items,
                   help="values (messages, parts, fields...) in a chat JSON body at most "
                        "(else 413, counted before the body is validated)")

    g = p.add_argument_group("budgets (per request, checked before queueing; over: 413)")
    g.add_argument("--max-fps", type=float, default=d.max_fps, help="highest fps a request may ask")
    g.add_argument("--max-frames-limit", type=int, default=d.max_frames_limit,
                   help="highest max_frames a request may ask")
    g.add_argument("--max-frame-pixels", type=int, default=d.max_frame_pixels,
                   help="largest frame (width x height) accepted")
    g.add_argument("--max-decode-mb", type=float, default=d.max_decode_mb,
                   help="sampled frames as RGB (frames x width x height x 3) at most")
    g.add_argument("--max-visual-tokens", type=int, default=d.max_visual_tokens,
                   help="visual tokens per request at most (default: the model's context)")
    g.add_argument("--max-question-chars", type=int, default=d.max_question_chars,
                   help="longest question (characters)")
    g.add_argument("--max-question-tokens", type=int, default=d.max_question_tokens,
                   help="longest question (tokens)")
    g.add_argument("--decode-memory-mb", type=float, default=d.decode_memory_mb,
                   help="memory a decode worker may take beyond its own footprint and the "
                        "frames it is decoding (over: the video is refused, 400 bad_video)")
    g.add_argument("--decode-timeout-s", type=float, default=d.decode_timeout_s,
                   help="a decode worker must open a video, and decode each batch of its "
                        "frames, within this (else the video is refused, 400 bad_video)")
    g.add_argument("--decode-workers", type=int, default=d.decode_workers,
                   help="decode worker processes kept started")
    g.add_argument("--no-client-sparse", action="store_true",
                   help="refuse requests that ask for attention=sparse (the server's "
                        "--attention still applies)")

    g = p.add_argument_group("media URLs in chat requests")
    g.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="chat requests may name local video files under DIR")
    g.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="HOST",
                   help="chat requests may name http(s) video URLs on these hosts "
                        "(remote URLs are refused without it)")
    g.add_argument("--allow-private-media-addresses", action="store_true",
                   help="fetch from names that resolve to loopback/private addresses "
                        "(refused by default; IP literals in the allow-list always pass)")
    g.add_argument("--media-fetch-deadline-s", type=float, default=d.media_fetch_deadline_s,
                   help="a remote video must download within this (else 504)")

    g = p.add_argument_group("video cache (a video's prefix is prefilled once, then reused by "
                             "every question about it)")
    g.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb,
                   help="GPU memory for cached video prefixes (KV caches), GiB (default: the "
                        "engine's share of the device's memory; on the CPU 2 GiB)")
    g.add_argument("--kv-host-cache-gb", type=float, default=d.kv_host_cache_gb,
                   help="pinned host memory the least recently used prefixes move to when "
                        "the GPU budget is spent, GiB (0: they are dropped)")
    g.add_argument("--no-video-cache", action="store_true",
                   help="keep nothing between requests: every question prefills its whole "
                        "prompt")
    g.add_argument("--stream-kv-gb", type=float, default=d.stream_kv_gb,
                   help="memory the live streams' KV caches share (/v1/streams), GiB; a "
                        "stream that would pass it becomes full: it takes no more video and "
                        "still answers (default: --kv-cache-gb's budget)")
    g.add_argument("--stream-host-kv-gb", type=float, default=d.stream_host_kv_gb,
                   help="pinned host memory the least recently used idle streams move to "
                        "when --stream-kv-gb is spent, GiB; a stream comes back on its next "
                        "piece or question (0: none, a stream past --stream-kv-gb is full)")

    g = p.add_argument_group("video store (POST /v1/videos: upload once, ask by id)")
    g.add_argument("--video-store-gb", type=float, default=d.video_store_gb,
                   help="disk for stored videos under --data-dir, GiB (the same bytes are "
                        "stored once); an upload over it gets 507")
    g.add_argument("--video-store-max", type=int, default=d.video_store_max,
                   help="stored videos at most; an upload over it gets 507")
    g.add_argument("--video-ttl-s", type=float, default=d.video_ttl_s,
                   help="a stored video is deleted this long after its upload (0: never)")

    g = p.add_argument_group("API keys and tenants (each key names a tenant: its videos, history "
                             "and cached prefixes are its own)")
    g.add_argument("--api-key", help="the operator's key: tenant `default`, admin (default: "
                                     "$MMINFER_API_KEY; more keys: $MMINFER_API_KEY_<TENANT>)")
    g.add_argument("--api-keys-file", metavar="FILE",
                   help="lines `<key> <tenant> [admin] [quota=value ...]` (quotas: max_videos, "
                        "max_video_gb, max_uploads, max_queue), or a JSON list of {key, "
                        "tenant, admin, quotas}")
    g.add_argument("--share-cache-across-tenants", action="store_true",
                   help="let a tenant's request reuse a video prefix another tenant's built "
                        "(off: each tenant's cache entries are its own)")
    g.add_argument("--tenant-max-videos", type=int, default=d.tenant_max_videos,
                   help="stored videos per tenant (default: an equal share of "
                        "--video-store-max)")
    g.add_argument("--tenant-max-video-gb", type=float, default=d.tenant_max_video_gb,
                   help="stored bytes per tenant, GiB (default: an equal share of "
                        "--video-store-gb)")
    g.add_argument("--tenant-max-uploads", type=int, default=d.tenant_max_uploads,
                   help="request bodies one tenant sends at once; more get 429 (default: half "
                        "the upload places with two tenants or more; 0: no limit)")
    g.add_argument("--tenant-max-queue", type=int, default=d.tenant_max_queue,
                   help="requests one tenant has waiting, uploading or running at once; more "
                        "get 429 (default: half the queue with two tenants or more; 0: no "
                        "limit)")
    g.add_argument("--metrics-token",
                   help="a bearer token for /metrics alone, for a scraper (default: "
                        "$MMINFER_METRICS_TOKEN; with keys, the admin's key works too)")
    g.add_argument("--session-ttl-s", type=float, default=d.session_ttl_s,
                   help="a /login session (the report page in a browser) lasts this long")

    g = p.add_argument_group("latency store")
    g.add_argument("--report-retention-days", type=float, default=d.report_retention_days,
                   help="latency records older than this are deleted")
    g.add_argument("--report-max-rows", type=int, default=d.report_max_rows,
                   help="latency records kept at most (the newest)")

    g = p.add_argument_group("shadow-dense monitor (sparse quality on live traffic)")
    g.add_argument("--shadow-rate", type=float, default=d.shadow_rate,
                   help="fraction of requests sampled: one whose prefill ran sparse is re-run "
                        "dense while the worker is idle and compared (0: off)")
    g.add_argument("--shadow-max-mb", type=float, default=d.shadow_max_mb,
                   help="a sampled request's kept inputs (prompt embeddings and positions, CPU "
                        "memory) at most; larger ones are not compared")
    g.add_argument("--shadow-max-new-tokens", type=int, default=d.shadow_max_new_tokens,
                   help="answer tokens the dense re-run generates to compare answers (1: the "
                        "first token only)")

    g = p.add_argument_group("self-calibration (weights without a measured head-pattern config: "
                             "measured in idle time, gated, then served sparse; "
                             "docs/calibration.md)")
    g.add_argument("--no-self-calibrate", action="store_true",
                   help="never calibrate here: an uncalibrated config stays dense")
    g.add_argument("--calibration-dir", default=d.calibration_dir,
                   help="measured configs by weights digest, reused on the next start "
                        "(default: DATA_DIR/calibration)")
    g.add_argument("--no-calibrate-from-requests", action="store_true",
                   help="calibrate and gate on synthetic videos only: no user's prompt is kept")
    g.add_argument("--calibration-capture-mb", type=float, default=d.calibration_capture_mb,
                   help="prompts kept for calibration (embeddings after the vision tower, host "
                        "memory) at most")
    add_threshold_arguments(g, min_agreement=d.calibration_min_agreement,
                            max_kl=d.calibration_max_kl,
                            max_density=d.calibration_max_density,
                            what="calibration, gate, and the drift check")
    g.add_argument("--calibration-requests", type=int, default=d.calibration_requests,
                   help="requests calibrated on (besides the synthetic videos)")
    g.add_argument("--calibration-gate-requests", type=int,
                   default=d.calibration_gate_requests,
                   help="later requests (not calibrated on) a new config must hold the "
                        "thresholds on before it serves")
    g.add_argument("--calibration-window", type=int, default=d.calibration_window,
                   help="shadow comparisons of the serving config judged together: past the "
                        "thresholds, back to dense and recalibrate")
    g.add_argument("--calibration-synthetic", type=int, default=d.calibration_synthetic,
                   help="synthetic videos calibrated on, rendered in-process before any "
                        "request arrives")
    g.add_argument("--calibration-synthetic-frames", type=int,
                   default=d.calibration_synthetic_frames,
                   help="their frames (0: the most, up to 768, whose visual tokens fit 16K)")


def settings_from(args):
    if args.queue_size < 1 or (args.max_concurrent_uploads or 1) < 1 or args.max_num_seqs < 1:
        raise ConfigError("--queue-size, --max-num-seqs and --max-concurrent-uploads must be "
                          "at least 1")
    if not 0 <= args.decode_share < 1:
        raise ConfigError(f"--decode-share must be in [0, 1), not {args.decode_share}")
    for name in ("max_upload_mb", "max_data_url_mb", "timeout_s", "upload_deadline_s",
                 "max_fps", "max_decode_mb", "media_fetch_deadline_s", "decode_memory_mb",
                 "decode_timeout_s"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if not (0 <= args.shadow_rate <= 1 and args.shadow_max_mb >= 0
            and args.shadow_max_new_tokens >= 1):
        raise ConfigError("--shadow-rate must be in [0, 1], --shadow-max-mb >= 0 and "
                          "--shadow-max-new-tokens >= 1")
    if args.kv_cache_gb is not None and args.kv_cache_gb < 0 or args.kv_host_cache_gb < 0:
        raise ConfigError("--kv-cache-gb and --kv-host-cache-gb must be >= 0")
    if args.stream_kv_gb is not None and not args.stream_kv_gb > 0:
        raise ConfigError("--stream-kv-gb must be positive")
    if not args.stream_host_kv_gb >= 0:
        raise ConfigError("--stream-host-kv-gb must be >= 0")
    if not 1 <= args.max_frames <= args.max_frames_limit:
        raise ConfigError(f"--max-frames ({args.max_frames}) must be in [1, --max-frames-limit "
                          f"({args.max_frames_limit})]: requests without max_frames ask for it")
    if not 0 < args.fps <= args.max_fps:
        raise ConfigError(f"--fps ({args.fps:g}) must be in (0, --max-fps ({args.max_fps:g})]: "
                          "requests without fps ask for it")
    if not (args.video_store_gb > 0 and args.video_store_max >= 1 and args.video_ttl_s >= 0):
        raise ConfigError("--video-store-gb must be positive, --video-store-max at least 1 "
                          "and --video-ttl-s >= 0")
    for name in ("tenant_max_videos", "tenant_max_video_gb", "tenant_max_uploads",
                 "tenant_max_queue"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if not (0 <= args.calibration_min_agreement <= 1 and args.calibration_max_kl >= 0
            and 0 < args.calibration_max_density <= 1
            and args.calibration_capture_mb >= 0 and args.calibration_requests >= 0
            and args.calibration_gate_requests >= 1 and args.calibration_window >= 1
            and args.calibration_synthetic >= 1 and args.calibration_synthetic_frames >= 0):
        raise ConfigError("--calibration-min-agreement must be in [0, 1], "
                          "--calibration-max-density in (0, 1], --calibration-max-kl "
                          "and --calibration-capture-mb >= 0, --calibration-requests >= 0, "
                          "--calibration-gate-requests, --calibration-window and "
                          "--calibration-synthetic >= 1, --calibration-synthetic-frames >= 0")
    keys = {"api_key": args.api_key} if args.api_key else {}
    if args.metrics_token:
        keys["metrics_token"] = args.metrics_token
    return Settings(
        **keys, api_keys_file=args.api_keys_file,
        share_cache_across_tenants=args.share_cache_across_tenants,
        tenant_max_videos=args.tenant_max_videos, tenant_max_video_gb=args.tenant_max_video_gb,
        tenant_max_uploads=args.tenant_max_uploads, tenant_max_queue=args.tenant_max_queue,
        session_ttl_s=args.session_ttl_s,
        model=args.model, **pipeline_options(args), data_dir=args.data_dir,
        served_model_names=tuple(args.served_model_name), fps=args.fps,
        max_frames=args.max_frames, max_new_tokens=args.max_new_tokens,
        queue_size=args.queue_size, max_num_seqs=args.max_num_seqs,
        decode_share=args.decode_share, timeout_s=args.timeout_s,
        max_upload_mb=args.max_upload_mb, max_data_url_mb=args.max_data_url_mb,
        max_concurrent_uploads=args.max_concurrent_uploads,
        upload_deadline_s=args.upload_deadline_s, min_upload_kbps=args.min_upload_kbps,
        upload_grace_s=args.upload_grace_s, max_fps=args.max_fps,
        max_uploads_per_client=args.max_uploads_per_client,
        header_timeout_s=args.header_timeout_s, max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        max_json_items=args.max_json_items,
        max_frames_limit=args.max_frames_limit, max_frame_pixels=args.max_frame_pixels,
        max_decode_mb=args.max_decode_mb, max_visual_tokens=args.max_visual_tokens,
        max_question_chars=args.max_question_chars,
        max_question_tokens=args.max_question_tokens,
        allow_client_sparse=not args.no_client_sparse,
        decode_memory_mb=args.decode_memory_mb, decode_timeout_s=args.decode_timeout_s,
        decode_workers=max(args.decode_workers, 1),
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(h.lower() for h in args.allowed_media_domains),
        allow_private_media_addresses=args.allow_private_media_addresses,
        media_fetch_deadline_s=args.media_fetch_deadline_s,
        report_retention_days=args.report_retention_days,
        kv_cache_gb=args.kv_cache_gb, kv_host_cache_gb=args.kv_host_cache_gb,
        stream_kv_gb=args.stream_kv_gb, stream_host_kv_gb=args.stream_host_kv_gb,
        video_cache=not args.no_video_cache, video_store_gb=args.video_store_gb,
        video_store_max=args.video_store_max, video_ttl_s=args.video_ttl_s,
        report_max_rows=args.report_max_rows, shadow_rate=args.shadow_rate,
        shadow_max_mb=args.shadow_max_mb, shadow_max_new_tokens=args.shadow_max_new_tokens,
        self_calibrate=not args.no_self_calibrate, calibration_dir=args.calibration_dir,
        calibrate_from_requests=not args.no_calibrate_from_requests,
        calibration_capture_mb=args.calibration_capture_mb,
        calibration_min_agreement=args.calibration_min_agreement,
        calibration_max_kl=args.calibration_max_kl,
        calibration_max_density=args.calibration_max_density,
        calibration_requests=args.calibration_requests,
        calibration_gate_requests=args.calibration_gate_requests,
        calibration_window=args.calibration_window,
        calibration_synthetic=args.calibration_synthetic,
        calibration_synthetic_frames=args.calibration_synthetic_frames)


def check_port(host: str, port: int):
    """ConfigError when ``host:port`` cannot be listened on (in use, not an address here),
    found by binding it as uvicorn will (SO_REUSEADDR), then letting it go."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            why = ("is already in use (another server?); choose another with --port"
                   if e.errno == errno.EADDRINUSE else f"cannot be used: {e.strerror or e}")
            raise ConfigError(f"port {port} on {host} {why}") from None


def banner(host: str, port: int, model: str, api_key: bool, *,
           kv_cache_dtype: str = "auto", quantization: str | None = None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    # the source tree's sample, or the current folder's (the Docker image's /app)
    video = next((p for p in (Path(__file__).resolve().parent.parent / SAMPLE, Path.cwd() / SAMPLE)
                  if p.is_file()), Path("video.mp4"))
    auth = ' -H "Authorization: Bearer $MMINFER_API_KEY"' if api_key else ""
    return "\n".join([
        f"mminfer serving {model} at {url} (kv cache: {kv_cache_dtype})"
        + (f" (quantization {quantization})" if quantization else ""),
        f"  report page  {url}/report",
        f"  health       {url}/health    metrics {url}/metrics",
        "try:",
        f"  curl{auth} -F video=@{shlex.quote(str(video))} "
        f"-F question='What number appears in the video?' {url}/v1/answer",
    ])


def graceful_server(uvicorn, config, worker):
    """A uvicorn server that, when told to stop, first answers every queued request with a
    JSON 503 and stops the running one, so that its graceful wait sees them all answered
    (uvicorn alone would wait, then cut them off with a plain-text 500)."""

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            worker.begin_shutdown()
            await super().shutdown(sockets)

    return Server(config)


def data_parallel_worker(settings, args, DataParallelWorker):
    """The front end's worker over ``--data-parallel`` engine processes (data_parallel.py).
    The shadow-dense monitor and self-calibration run on an idle model of their own
    process: not under --data-parallel, where they are off."""
    settings.shadow_rate = 0.0
    settings.self_calibrate = False       # idle-time work of one process's model, as above
    return DataParallelWorker(settings, settings.model, args.data_parallel,
                              routing=args.dp_routing,
                              max_imbalance=args.affinity_max_imbalance,
                              log_level=args.log_level.upper())


def ray_serve_worker(settings, args, RayServeWorker):
    """The front end's worker over ``--ray`` Ray Serve replicas (ray_serve.py); the
    shadow-dense monitor and self-calibration are off, as under --data-parallel."""
    settings.shadow_rate = 0.0
    settings.self_calibrate = False
    return RayServeWorker(settings, settings.model, args.ray_replicas, address=args.ray,
                          routing=args.dp_routing, max_imbalance=args.affinity_max_imbalance)


def run(args) -> int:
    # `kill -USR1 <pid>` prints every thread's stack to stderr: where a request is stuck,
    # without stopping the server (not where stderr is no file, e.g. captured in-process)
    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, OSError, ValueError):    # io.UnsupportedOperation: no fileno
            pass
    settings = settings_from(args)
    settings.model = resolve_model(settings.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # lazy: the CLI's edge: the app and the engine under it (torch, transformers, FastAPI:
    # seconds) load when the server starts, never for `mminfer serve --help`
    from transformers.utils import logging as hf_logging
    from . import app as app_module, data_parallel, tensor_parallel
    from .protocol import config as guarded_config
    hf_logging.disable_progress_bar()
    tp = None
    if args.data_parallel < 1:
        raise ConfigError("--data-parallel must be at least 1")
    if args.data_parallel > 1 and args.tensor_parallel > 1:
        raise ConfigError("--data-parallel and --tensor-parallel do not combine (yet): "
                          "choose one")
    if args.ray and (args.data_parallel > 1 or args.tensor_parallel > 1):
        raise ConfigError("--ray runs one engine per Ray Serve replica: leave out "
                          "--data-parallel and --tensor-parallel")
    if args.tensor_parallel > 1:         # rank 0 serves, the others follow its requests
        tp = tensor_parallel
        if not tp.is_leader(args.tensor_parallel):
            return tp.follow(settings, args.tensor_parallel)
    check_port(args.host, args.port)      # before the model loads, not after
    worker = tp.leader_worker(settings, args.tensor_parallel) if tp else None
    if args.data_parallel > 1:
        worker = data_parallel_worker(settings, args, data_parallel.DataParallelWorker)
    if args.ray:
        try:
            from . import ray_serve  # lazy: an optional dependency (the ray extra)
        except ImportError as e:
            raise ConfigError(f"--ray needs Ray Serve ({e}): pip install 'mminfer[ray]'") \
                from None
        worker = ray_serve_worker(settings, args, ray_serve.RayServeWorker)
    app = app_module.create_app(settings, worker=worker)
    worker = app.state.worker
    print(f"loading {settings.model} ...", flush=True)
    worker.start()
    if not worker.wait_ready():
        raise ConfigError(worker.error or "the model did not load")
    policy = getattr(worker.pipeline, "attention_policy", lambda: None)()
    if policy and policy["head_patterns"] == "uncalibrated":
        print(f"warning: head patterns uncalibrated for this model; attention auto is "
              f"{policy['auto_attention']}", flush=True)
    if policy and policy.get("self_calibration"):
        print(f"self-calibration: {policy['self_calibration']['summary']}", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not app.state.service.keys.enabled:
        print("warning: listening beyond loopback without MMINFER_API_KEY: anyone who can "
              "reach this port can use the model", flush=True)

    config = guarded_config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_shutdown_s)
    server = graceful_server(uvicorn, config, worker)
    if tp is not None:
        tp.exit_quietly(server)

    async def main():
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            model = getattr(worker.pipeline, "model_id", settings.model)
            kv = getattr(worker.pipeline, "kv_cache_dtype", settings.kv_cache_dtype)
            print(banner(args.host, port, model, app.state.service.keys.enabled,
                         kv_cache_dtype=kv,
                         quantization=getattr(worker.pipeline, "quantization", None)),
                  flush=True)
        await task

    try:
        asyncio.run(main())
    finally:
        code = 0 if server.started else 1
        if tp is not None:
            code = tp.finish(worker, code)
    return code
