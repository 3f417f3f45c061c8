"""Pull mode on a real server with the embedded model: the server reads a live MPEG-TS source on
loopback itself and appends its pieces as they arrive; the stream's status says the source's
state and lag; a question after the source ended sees every frame (the dense one-shot answer
of the decoded frames); a source that stalls fails with the reason and keeps what came before
answerable; sources the operator did not allow are refused. The source is a test HTTP server
that sends the TS bytes slowly, and (where ffmpeg is installed: `make system-deps`) ``ffmpeg
-re`` serving the sample in real time."""

import http.server
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from mminfer.models.base import Conversation
from mminfer.serve.app import Settings, create_app
from mminfer.serve.live_ops import live_of

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "videos"
NEEDLE = SAMPLES / "needle_0.mp4"
Q = "What number appears in the video?"


def ts_bytes(tmp_path) -> bytes:
    """needle_0's 20 frames (2 fps) as one MPEG-TS."""
    path = tmp_path / "needle.ts"
    with av.open(str(NEEDLE)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    with av.open(str(path), "w", format="mpegts") as c:
        s = c.add_stream("libx264", rate=2)
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path.read_bytes()


def noise_ts(tmp_path, n=60) -> bytes:
    """``n`` frames of noise (2 fps) as one MPEG-TS: every frame a large packet."""
    path = tmp_path / "noise.ts"
    rng = np.random.default_rng(0)
    with av.open(str(path), "w", format="mpegts") as c:
        s = c.add_stream("libx264", rate=2)
        s.width, s.height, s.pix_fmt = 224, 224, "yuv420p"
        for _ in range(n):
            f = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path.read_bytes()


def decoded(data: bytes, tmp_path) -> np.ndarray:
    path = tmp_path / "check.ts"
    path.write_bytes(data)
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


class SlowSource:
    """An HTTP server on loopback sending ``data`` in ``pieces`` chunks ``gap_s`` apart (a
    live source); ``stall_after``: chunks sent before it stops sending and holds the
    connection open. ``dropped`` is set when a reader closes its connection before all was
    sent."""

    def __init__(self, data: bytes, pieces: int = 10, gap_s: float = 0.3,
                 stall_after: int | None = None):
        outer = self
        self.release = threading.Event()
        self.dropped = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "video/mp2t")
                self.end_headers()
                step = -(-len(data) // pieces)
                for i in range(pieces):
                    if stall_after is not None and i == stall_after:
                        outer.release.wait(60)
                        return
                    try:
                        self.wfile.write(data[i * step:(i + 1) * step])
                        self.wfile.flush()
                    except OSError:
                        outer.dropped.set()
                        return
                    time.sleep(gap_s)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/live.ts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def follow(url, sid, until=("ended", "failed", "full", "stopped"), timeout=120):
    """The stream's statuses, polled until its source reaches a state in ``until``."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = httpx.get(f"{url}/v1/streams/{sid}", timeout=30).json()
        seen.append(st)
        if st["source"]["state"] in until:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"the source did not end: {seen[-1]}")


def assert_grew_as_one_server(seen, want, engine):
    """A pulled stream of the needle's 20 frames (10 s at 2 fps, sent in ten chunks) on a
    server of several engines or replicas, as ``follow`` saw it: ended cleanly on ``engine``;
    its GET grew with the pieces as they came (of the four counts between none and all, 4,
    8, 12 and 16 frames, one about every 0.6 s, polled every 0.2 s, two at least seen: a poll
    on a loaded machine can pass a piece); the same pieces as one server's last status
    ``want`` (the source sends faster than real time, so each piece is cut at 2 s of media,
    never by the wall clock)."""
    last = seen[-1]
    assert last["engine"] == engine
    assert last["source"]["state"] == "ended" and last["source"]["error"] is None, last
    assert last["source"]["frames_read"] == 20 and last["frames"] == 20
    assert last["seen_until"] == 10.0 and last["pieces"] == last["source"]["pieces"] >= 2
    growing = [(s["frames"], s["tokens"], s["seen_until"]) for s in seen]
    assert growing == sorted(growing), growing
    between = {s["frames"] for s in seen if s["source"]["state"] == "reading"} - {0, 20}
    assert len(between) >= 2, growing
    assert 0 < min(s["tokens"] for s in seen if s["frames"]) < last["tokens"]
    for k in ("frames", "tokens", "seen_until"):
        assert last[k] == want[k], (k, last, want)


def pull(url, source) -> str:
    """A stream reading ``source`` (2 fps): its id."""
    r = httpx.post(f"{url}/v1/streams", json={"fps": 2, "source": source}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["source"]["url"] == source
    return r.json()["id"]


def ask(url, sid):
    return httpx.post(f"{url}/v1/answer", data={"question": Q, "stream_id": sid,
                                                "max_new_tokens": "4"},
                      files={"dummy": ("x.bin", b"", "application/octet-stream")}, timeout=120)


def settings(tmp_path, **kw):
    return Settings(device="cpu", data_dir=str(tmp_path), timeout_s=120,
                    allowed_media_domains=("127.0.0.1",), **kw)


def check_whole(srv, sid, frames):
    """The stream holds every frame: its answer is the dense one-shot answer of them."""
    st = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
    assert st["frames"] == len(frames) and st["seen_until"] == len(frames) / 2
    got = ask(srv.url, sid).json()
    ad = srv.app.state.worker.pipeline.adapter

    class V:
        sampled_fps = 2.0
    V.frames = frames
    want = ad.generate(ad.prepare(V, Conversation.single(Q)), max_new_tokens=4)
    assert got["answer"] == want.text and got["video"]["seen_until"] == len(frames) / 2


def test_pull_a_slow_live_source_then_a_stalled_one(tmp_path, live_server):
    data = ts_bytes(tmp_path)
    frames = decoded(data, tmp_path)
    assert len(frames) == 20
    srv = live_server(create_app(settings(tmp_path, media_fetch_timeout_s=3.0)))

    src = SlowSource(data, pieces=10, gap_s=0.3)
    try:
        r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "source": src.url}, timeout=30)
        assert r.status_code == 200, r.text
        sid = r.json()["id"]
        assert r.json()["source"]["url"] == src.url
        seen = follow(srv.url, sid)
    finally:
        src.close()
    last = seen[-1]
    assert last["source"]["state"] == "ended", last
    assert last["source"]["error"] is None and last["source"]["frames_read"] == 20
    assert last["pieces"] >= 2 and last["source"]["pieces"] == last["pieces"]
    assert any(s["source"]["state"] == "reading" and s["frames"] < 20 for s in seen), \
        "the stream grew while the source was still sending"
    check_whole(srv, sid, frames)
    m = httpx.get(f"{srv.url}/metrics").text
    assert "mminfer:stream_pieces_total" in m

    # a source that stops sending halfway: failed with the reason, the first half answerable
    stalled = SlowSource(data, pieces=10, gap_s=0.05, stall_after=5)
    try:
        r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "source": stalled.url},
                       timeout=30)
        sid2 = r.json()["id"]
        last = follow(srv.url, sid2)[-1]
    finally:
        stalled.close()
    assert last["source"]["state"] == "failed", last
    assert "the source stalled: nothing arrived for 3 s" in last["source"]["error"]["message"]
    assert last["last_error"]["reason"] == "source"
    assert 0 < last["frames"] < 20
    a = ask(srv.url, sid2)
    assert a.status_code == 200 and a.json()["video"]["seen_until"] == last["seen_until"]
    # the first stream is untouched, and pushing to a pulled stream is refused
    assert httpx.get(f"{srv.url}/v1/streams/{sid}").json()["frames"] == 20
    r = httpx.post(f"{srv.url}/v1/streams/{sid}/segments",
                   files={"file": ("p.ts", data, "video/mp2t")}, timeout=60)
    assert r.status_code == 400 and "fed by its source" in r.json()["error"]["message"]
    assert httpx.delete(f"{srv.url}/v1/streams/{sid2}").json()["deleted"] is True


def test_sources_the_operator_did_not_allow_are_refused(tmp_path, live_server):
    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path))))
    for source, status, code in (
            ("http://127.0.0.1:9/live.ts", 400, "remote_media_refused"),
            (str(NEEDLE), 403, "forbidden"),
            ("ftp://example.com/x.ts", 400, "bad_input")):
        r = httpx.post(f"{srv.url}/v1/streams", json={"source": source}, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert httpx.get(f"{srv.url}/v1/streams").json()["data"] == []


def test_a_source_that_cannot_be_opened_fails_with_the_reason(tmp_path, live_server):
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = live_server(create_app(settings(tmp_path, media_fetch_timeout_s=2.0)))
    r = httpx.post(f"{srv.url}/v1/streams",
                   json={"source": f"http://127.0.0.1:{port}/live.ts"}, timeout=30)
    assert r.status_code == 200, r.text
    last = follow(srv.url, r.json()["id"])[-1]
    assert last["source"]["state"] == "failed"
    assert "could not be opened" in last["source"]["error"]["message"]
    assert ask(srv.url, last["id"]).json()["error"]["message"].endswith("append a piece first")


@pytest.mark.skipif(shutil.which("ffmpeg") is None,
                    reason="ffmpeg is not installed (make system-deps installs it as root)")
def test_pull_from_ffmpeg_serving_the_sample_in_real_time(tmp_path, live_server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/live.ts"
    # a live encoder's settings: each frame sent as it comes (x264's default lookahead would
    # hold the whole 10-s sample back to its end)
    ff = subprocess.Popen(["ffmpeg", "-loglevel", "error", "-re", "-i", str(NEEDLE),
                           "-c:v", "libx264", "-tune", "zerolatency", "-f", "mpegts",
                           "-listen", "1", url])
    try:
        srv = live_server(create_app(settings(tmp_path)))
        time.sleep(0.5)                 # ffmpeg listening
        r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "source": url}, timeout=30)
        assert r.status_code == 200, r.text
        seen = follow(srv.url, r.json()["id"])
    finally:
        ff.kill()
        ff.wait()
    last = seen[-1]
    assert last["source"]["state"] == "ended", last
    assert last["frames"] == 20 and last["seen_until"] == 10.0
    # read in real time: the stream grew over the sample's 10 s, and kept up with it
    assert any(0 < s["frames"] < 20 for s in seen)
    assert max(s["source"]["lag_seconds"] or 0 for s in seen) < 8


def test_the_source_reader_process_dying_fails_the_source_not_the_server(tmp_path,
                                                                          live_server):
    """The source is read in a process of its own. Killed mid-read (as a crafted source that
    crashes the demuxer or decoder would end it): the source is ``failed`` with the reason,
    what came before stays answerable, and the server serves on. Stopped mid-read (as one
    that hangs the decoder would leave it): after ``2 * timeout + 2`` s without a word it is
    killed and the source fails as hung. A new pull then reads to its end in a fresh
    process, which ends with the read."""
    data = ts_bytes(tmp_path)
    frames = decoded(data, tmp_path)
    noise = noise_ts(tmp_path)          # 30 s of noise: past the demuxer's buffers
    srv = live_server(create_app(settings(tmp_path, media_fetch_timeout_s=2.0)))
    lasts = []
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        src = SlowSource(noise, pieces=60, gap_s=0.25)         # 15 s of sending
        try:
            r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "source": src.url},
                           timeout=30)
            assert r.status_code == 200, r.text
            sid = r.json()["id"]
            follow_until(srv.url, sid, lambda st: st["frames"] > 0)
            pid = live_of(srv.app.state.worker.pipeline).pulls[sid].reader.pid
            assert pid is not None and pid != os.getpid()
            os.kill(pid, sig)
            lasts.append(follow(srv.url, sid)[-1])
        finally:
            src.close()
        last = lasts[-1]
        assert last["source"]["state"] == "failed", last
        assert last["last_error"]["reason"] == "source"
        assert 0 < last["frames"] < 60
        a = ask(srv.url, sid)
        assert a.status_code == 200 and a.json()["video"]["seen_until"] == last["seen_until"]
    assert "SIGKILL" in lasts[0]["source"]["error"]["message"]
    assert "hung (nothing from it for 6 s)" in lasts[1]["source"]["error"]["message"]
    assert httpx.get(f"{srv.url}/health").status_code == 200

    src = SlowSource(data, pieces=4, gap_s=0.1)
    try:
        r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "source": src.url}, timeout=30)
        sid2 = r.json()["id"]
        last = follow(srv.url, sid2)[-1]
    finally:
        src.close()
    assert last["source"]["state"] == "ended", last
    assert live_of(srv.app.state.worker.pipeline).pulls[sid2].reader.pid is None
    check_whole(srv, sid2, frames)


def follow_until(url, sid, pred, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = httpx.get(f"{url}/v1/streams/{sid}", timeout=30).json()
        if pred(st):
            return st
        assert st["source"]["state"] in ("connecting", "reading"), st
        time.sleep(0.1)
    raise AssertionError("timed out")
