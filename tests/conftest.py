"""Shared fixtures: small videos written with PyAV into the test's tmp_path."""
from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest


REPO = Path(__file__).resolve().parents[1]


def load_script(relpath: str, name: str | None = None):
    """A script of the repo (``benchmarks/…``, ``scripts/…``: not a package) as a module.
    Registered in ``sys.modules`` (dataclasses and FlexAttention's tracer look their module up
    by name); its folder is on ``sys.path`` while it loads (scripts import their neighbours)."""
    import importlib.util
    import sys
    path = REPO / relpath
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


def embedded_without_config(where: Path) -> Path:
    """The embedded model's files, copied, without its head-pattern config (the folder keeps
    the model's name: its identity): weights no calibration has measured."""
    from mminfer.models.embedded import DEFAULT_MODEL_DIR
    d = where / "mminfer-embedded"
    d.mkdir(parents=True)
    for f in Path(DEFAULT_MODEL_DIR).iterdir():
        if not f.name.startswith("mminfer_patterns"):
            shutil.copy(f, d / f.name)
    return d


def gray_level(i: int, n_frames: int) -> int:
    """Frame i of a ``make_video`` clip is flat gray at this level (16..236), so a decoded
    frame tells which source frame it came from."""
    return int(round(16 + i * 220 / max(n_frames - 1, 1)))


def write_video(path, n_frames=30, fps=10.0, width=64, height=48, *, codec="libx264",
                container=None, faststart=False, noise=False, audio=False, gop=None) -> Path:
    """Write a clip whose frame i is flat ``gray_level(i, n_frames)``; ``noise`` adds
    per-pixel noise (big packets: useful for truncation tests); ``audio`` adds an AAC
    track; ``n_frames=0`` with ``audio`` gives an audio-only file."""
    import av

    path = Path(path)
    opts = {"movflags": "faststart"} if faststart else {}
    rng = np.random.default_rng(0)
    with av.open(str(path), "w", format=container, options=opts) as c:
        vs = None
        if n_frames:
            vs = c.add_stream(codec, rate=Fraction(fps).limit_denominator(1001),
                              options={"g": str(gop)} if gop else {})
            vs.width, vs.height, vs.pix_fmt = width, height, "yuv420p"
        if audio:
            a = c.add_stream("aac", rate=16000)
            fr = av.AudioFrame.from_ndarray(np.zeros((1, 16000), np.float32), format="fltp",
                                            layout="mono")
            fr.sample_rate, fr.pts = 16000, 0
            for p in [*a.encode(fr), *a.encode()]:
                c.mux(p)
        for i in range(n_frames):
            f = np.full((height, width, 3), gray_level(i, n_frames), np.int16)
            if noise:
                f = f + rng.integers(-16, 17, f.shape)
            frame = av.VideoFrame.from_ndarray(np.clip(f, 0, 255).astype(np.uint8), "rgb24")
            for p in vs.encode(frame):
                c.mux(p)
        if vs is not None:
            for p in vs.encode():
                c.mux(p)
    return path


@pytest.fixture
def make_video(tmp_path):
    """``make_video(name="clip.mp4", **write_video options) -> Path`` in tmp_path."""

    def make(name="clip.mp4", **kw):
        return write_video(tmp_path / name, **kw)

    return make


@pytest.fixture
def frame_index():
    """``frame_index(frame, n_frames) -> int``: which source frame of a ``make_video``
    clip a decoded RGB frame is (inverse of gray_level)."""

    def index(frame, n_frames):
        return int(round((float(np.mean(frame)) - 16) * max(n_frames - 1, 1) / 220))

    return index


def read_response(sock, timeout=30.0) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one HTTP/1.1 response read from a raw socket."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.strip().lower().decode(): v.strip().decode()
               for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    n = int(headers.get("content-length", 0))
    while len(rest) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(lines[0].split(b" ")[1]), headers, json.loads(rest[:n] or b"{}")


LOAD_TIMEOUT_S = 300      # the tiny test models load in seconds; a loaded 2-core machine


class LiveServer:
    """A real uvicorn server for an app, on a free loopback port, in a background thread,
    returned once its model worker has finished loading (or failed to): the model loads in
    the background after uvicorn starts, and until then /health and /v1/models answer 503,
    so a test that asked them at once would race the load on a busy machine."""

    def __init__(self, app):
        import threading

        import uvicorn

        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        import time

        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        worker = getattr(self.app.state, "worker", None)
        loaded = worker is None or worker.wait_ready(LOAD_TIMEOUT_S)
        if not loaded and worker.state == "loading":
            raise RuntimeError(f"the model did not load within {LOAD_TIMEOUT_S} s")
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def live_server():
    """``live_server(app) -> LiveServer`` (started; ``.url``); stopped at teardown."""
    started = []

    def start(app):
        s = LiveServer(app).__enter__()
        started.append(s)
        return s

    yield start
    for s in reversed(started):
        s.__exit__(None, None, None)
