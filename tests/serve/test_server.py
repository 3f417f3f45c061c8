"""The HTTP service on a real uvicorn server (loopback, background thread) with the tiny
Qwen2.5-VL checkpoint: the answer and chat round trips, a corpus of bad inputs (each a 4xx
with a reason, the server healthy after it, no temp file left), the bounded queue under
load, timeouts, disconnects, a dead worker, metrics, and the latency store across restarts.
"""

import asyncio
import base64
import gc
import http.server
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import LiveServer, write_video
from prometheus_client.parser import text_string_to_metric_families

from mminfer.errors import ConfigError
from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.serve import app as app_module
from mminfer.serve.app import STAGE_ORDER, Settings, create_app
from mminfer.serve.store import LatencyStore, bucket_of, percentile
from mminfer.serve.worker import ModelWorker, is_fatal

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "videos"
NEEDLE = SAMPLES / "needle_0.mp4"
CONTEXT = 512          # the test checkpoint's context: small, so an over-long prompt is cheap


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("srv") / "tiny-qwen",
                                max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    shutil.copy(NEEDLE, d / "needle.mp4")
    return d


@pytest.fixture(scope="module")
def srv(ckpt, tmp_path_factory, media_dir):
    data = tmp_path_factory.mktemp("data")
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(data),
                              max_upload_mb=0.5, queue_size=8, timeout_s=120,
                              allowed_local_media_path=str(media_dir), api_key=None))
    with LiveServer(app) as s:
        s.data = data
        yield s


def uploads_left(app) -> list:
    return sorted(os.listdir(app.state.upload_dir))


def wait_no_uploads(app, timeout=20.0):
    deadline = time.monotonic() + timeout
    while uploads_left(app) and time.monotonic() < deadline:
        time.sleep(0.05)
    return uploads_left(app)


def post_answer(url, video: bytes | None, question: str | bytes | None = "what number?",
                filename="clip.mp4", ctype="video/mp4", timeout=60, headers=None, **fields):
    files = {"video": (filename, video, ctype)} if video is not None else None
    data = {k: str(v) for k, v in fields.items()}
    if question is not None:
        data["question"] = question
    if files is None:                       # force multipart even without a file part
        files = {"dummy": ("x.bin", b"", "application/octet-stream")}
    return httpx.post(f"{url}/v1/answer", files=files, data=data, timeout=timeout,
                      headers=headers)


def data_url(raw: bytes, mime="video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def chat_body(url, text="What number appears in the video?", **extra):
    return {"model": extra.pop("model", None),
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [
                             {"type": "video_url", "video_url": {"url": url}},
                             {"type": "text", "text": text}]}],
            **extra}


def metric_values(text: str, name: str, model="tiny-qwen") -> dict:
    """{labels (model_name aside): value} of one metric; every series names the model."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name:
                labels = dict(sample.labels)
                assert labels.pop("model_name") == model, sample
                out[tuple(sorted(labels.items()))] = sample.value
    return out


# ----------------------------------------------------------------------- round trips

def test_upload_round_trip(srv):
    r = post_answer(srv.url, NEEDLE.read_bytes(), "What number appears in the video?",
                    filename="../../etc/needle.mp4", fps="2", max_frames="16",
                    max_new_tokens="6", attention="dense", headers={"X-Request-ID": "abc-1"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert r.headers["x-request-id"] == d["request_id"] == "abc-1"
    assert set(d) == {"request_id", "answer", "model", "attention", "attention_requested",
                      "cache", "video", "tokens", "sparsity", "timings_ms", "finish_reason"}
    assert d["finish_reason"] == ("length" if d["tokens"]["generated"] == 6 else "stop")
    assert d["cache"] in ("miss", "hit")          # an earlier test may have asked about it
    assert isinstance(d["answer"], str) and d["model"] == "tiny-qwen"
    assert d["attention"] == "dense" and d["attention_requested"] == "dense"
    assert d["sparsity"] is None
    v = d["video"]
    assert "path" not in v and v["filename"] == "needle.mp4"   # a label, never a path
    assert (v["fps"], v["duration"], v["width"], v["height"]) == (2.0, 10.0, 224, 224)
    assert v["frames"] == 16                                    # max_frames was honoured
    t = d["tokens"]
    assert t["total"] == t["visual"] + t["text"] and t["visual"] > 0
    assert 1 <= t["generated"] <= 6
    ms = d["timings_ms"]
    assert list(ms) == list(STAGE_ORDER)
    assert all(isinstance(x, float) and x >= 0 for x in ms.values())
    for k in ("upload", "decode", "preprocess", "vision", "attention", "llm_other", "ttft"):
        assert ms[k] > 0, k
    assert ms["ttft"] <= ms["total"]
    assert ms["ttft"] >= ms["decode"] + ms["preprocess"] + ms["vision"] + ms["queue"]
    assert uploads_left(srv.app) == []


def test_chat_completions_with_data_url(srv):
    body = chat_body(data_url(NEEDLE.read_bytes()), max_tokens=5, temperature=0.7, top_p=0.9,
                     model="tiny-qwen", mm_processor_kwargs={"fps": 1.0})
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-")
    assert d["model"] == "tiny-qwen" and isinstance(d["created"], int)
    (choice,) = d["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    u = d["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 1 <= u["completion_tokens"] <= 5
    # fewer than 5: an end token came; 5: the limit, or an end token sampled as the 5th (it
    # counts, as in vLLM; temperature 0.7 draws it now and then: a busy-machine run did)
    assert choice["finish_reason"] == "stop" if u["completion_tokens"] < 5 else \
        choice["finish_reason"] in ("length", "stop")
    assert list(d["timings"]) == list(STAGE_ORDER) and d["timings"]["vision"] > 0
    assert d["mminfer"]["video"]["frames"] == 10                # fps 1 of a 10 s video
    # the same video at 2 fps: twice the frames, more prompt tokens
    r2 = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                    json=chat_body(data_url(NEEDLE.read_bytes()), max_completion_tokens=2))
    assert r2.status_code == 200 and r2.json()["usage"]["prompt_tokens"] > u["prompt_tokens"]
    models = httpx.get(f"{srv.url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny-qwen"
    assert models["data"][0]["max_model_len"] == CONTEXT
    assert uploads_left(srv.app) == []


def test_chat_local_path_inside_allowed_folder(srv, media_dir):
    for url in (str(media_dir / "needle.mp4"), (media_dir / "needle.mp4").as_uri()):
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                       json=chat_body(url, max_tokens=2))
        assert r.status_code == 200, r.text
    assert (media_dir / "needle.mp4").exists()          # never deleted: not ours


def test_remote_url_from_allowed_host(ckpt, tmp_path, live_server):
    """With --allowed-media-domains the server fetches (no redirects, size-checked)."""
    (tmp_path / "www").mkdir()
    shutil.copy(NEEDLE, tmp_path / "www" / "v.mp4")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(tmp_path / "www"), **k)
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path / "d"),
                                  allowed_media_domains=("127.0.0.1",), api_key=None))
        s = live_server(app)
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                       json=chat_body(f"{base}/v.mp4", max_tokens=2))
        assert r.status_code == 200, r.text
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                       json=chat_body(f"{base}/missing.mp4", max_tokens=2))
        assert r.status_code == 400 and "404" in r.json()["error"]["message"]
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                       json=chat_body("http://localhost:1/v.mp4", max_tokens=2))
        assert r.status_code == 400 and "localhost" in r.json()["error"]["message"]
        assert wait_no_uploads(app) == []
    finally:
        httpd.shutdown()


# ----------------------------------------------------------------------- bad inputs

def _mp4(tmp, **kw) -> bytes:
    return write_video(tmp / f"v{len(os.listdir(tmp))}.mp4", **kw).read_bytes()


def _zero_frame_mp4(tmp) -> bytes:
    """An MP4 with a video track that holds no frame."""
    import av
    path = tmp / "zero.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        c.start_encoding()
    return path.read_bytes()


def _raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send bytes as they are (a lying Content-Length, a cut-off body) and read the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                _header(data, b"content-length") or 0):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def _header(data: bytes, name: bytes):
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip()
    return None


def _multipart(boundary: bytes, parts: list[tuple[str, bytes]], close=True) -> bytes:
    out = b""
    for name, value in parts:
        fn = b'; filename="v.mp4"' if name == "video" else b""
        out += (b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"" +
                name.encode() + b"\"" + fn + b"\r\n\r\n" + value + b"\r\n")
    return out + (b"--" + boundary + b"--\r\n" if close else b"")


def _case_huge_declared(srv, tmp):
    head = (b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
            b"boundary=BB\r\nContent-Length: 99999999999\r\n\r\n")
    return _raw_request(srv.port, head, b"--BB\r\n")


def _case_cut_off_body(srv, tmp):
    body = _multipart(b"BB", [("question", b"what?"), ("video", NEEDLE.read_bytes()[:5000])],
                      close=False)
    head = (b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
            b"boundary=BB\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    return _raw_request(srv.port, head, body)


def _case_chunked_over_limit(srv, tmp):
    boundary = b"CC"

    def gen():        # no Content-Length: only the streaming check can stop it
        yield (b"--CC\r\nContent-Disposition: form-data; name=\"question\"\r\n\r\nwhat?\r\n"
               b"--CC\r\nContent-Disposition: form-data; name=\"video\"; filename=\"a.mp4\"\r\n"
               b"Content-Type: video/mp4\r\n\r\n\x00\x00\x00\x18ftypmp42")
        for _ in range(40):
            yield os.urandom(32 * 1024)
        yield b"\r\n--CC--\r\n"

    return httpx.post(f"{srv.url}/v1/answer", content=gen(), timeout=60,
                      headers={"Content-Type": "multipart/form-data; boundary=" +
                               boundary.decode()})


def _local_path_escape(srv, media_dir, tmp):
    outside = tmp / "secret.mp4"
    shutil.copy(NEEDLE, outside)
    return [httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json=chat_body(u))
            for u in (str(media_dir / ".." / outside.parent.name / "secret.mp4"),
                      f"file://{media_dir}/../../{outside}", str(outside))]


def _symlink_escape(srv, media_dir, tmp):
    link = media_dir / "link.mp4"
    if not link.exists():
        link.symlink_to(tmp / "secret2.mp4")
        shutil.copy(NEEDLE, tmp / "secret2.mp4")
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=30,
                      json=chat_body(str(link)))


png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 200
long_question = "what " * (CONTEXT + 50)

# name -> (expected status, error code, what the message must mention, request maker)
BAD = {
    "corrupt": (400, "bad_video", "", lambda s, t: post_answer(
        s.url, os.urandom(4096))),
    "truncated": (400, "bad_video", "truncated", lambda s, t: post_answer(
        s.url, _mp4(t, n_frames=60, noise=True)[:3000])),
    "empty": (400, "bad_video", "empty", lambda s, t: post_answer(s.url, b"")),
    "zero_frame": (400, "bad_video", "no video", lambda s, t: post_answer(
        s.url, _zero_frame_mp4(t))),
    "audio_only": (400, "bad_video", "audio only", lambda s, t: post_answer(
        s.url, _mp4(t, n_frames=0, audio=True))),
    "image_declared": (415, "unsupported_media_type", "image/png", lambda s, t: post_answer(
        s.url, png, filename="a.png", ctype="image/png")),
    "image_renamed": (415, "unsupported_media_type", "PNG", lambda s, t: post_answer(
        s.url, png, ctype="application/octet-stream")),
    "text_renamed_mp4": (415, "unsupported_media_type", "text", lambda s, t: post_answer(
        s.url, b"this is not a video, just some words\n" * 10)),
    "over_upload_limit": (413, "too_large", "limit", lambda s, t: post_answer(
        s.url, b"\x00\x00\x00\x18ftypmp42" + os.urandom(700 * 1024))),
    "chunked_over_limit": (413, "too_large", "limit", lambda s, t: _case_chunked_over_limit(
        s, t)),
    "huge_declared_size": (413, "too_large", "declared", _case_huge_declared),
    "cut_off_body": (400, "bad_input", "ended early", _case_cut_off_body),
    "missing_question": (422, "missing_field", "question", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), question=None)),
    "missing_video": (422, "missing_field", "video", lambda s, t: post_answer(s.url, None)),
    "non_utf8_question": (400, "bad_input", "UTF-8", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), question=b"what \xff\xfe color?")),
    "over_long_prompt": (400, "context_length_exceeded", str(CONTEXT),
                         lambda s, t: post_answer(s.url, NEEDLE.read_bytes(), long_question)),
    "fps_zero": (400, "bad_input", "fps", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), fps="0")),
    "fps_negative": (400, "bad_input", "fps", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), fps="-1")),
    "fps_nan": (400, "bad_input", "fps", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), fps="nan")),
    "fps_text": (400, "bad_input", "fps", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), fps="abc")),
    "max_frames_zero": (400, "bad_input", "max_frames", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), max_frames="0")),
    "max_frames_fraction": (400, "bad_input", "max_frames", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), max_frames="2.5")),
    "bad_attention": (400, "bad_input", "attention", lambda s, t: post_answer(
        s.url, NEEDLE.read_bytes(), attention="fast")),
    "json_to_upload_route": (415, "unsupported_media_type", "multipart", lambda s, t: httpx.post(
        f"{s.url}/v1/answer", json={"question": "x"})),
    "chat_not_json": (400, "bad_input", "JSON", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", content=b"{not json",
        headers={"Content-Type": "application/json"})),
    "chat_no_video": (400, "bad_input", "video_url", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user",
                                                              "content": "hi"}]})),
    "chat_missing_messages": (422, "missing_field", "messages", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", json={"model": "tiny-qwen"})),
    "chat_image_part": (415, "unsupported_media_type", "image_url", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}]}]})),
    "chat_image_data_url": (415, "unsupported_media_type", "image", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", json=chat_body(data_url(png, "image/png")))),
    "chat_corrupt": (400, "bad_video", "", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", json=chat_body(data_url(os.urandom(4096))))),
    "chat_bad_base64": (400, "bad_input", "base64", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", json=chat_body("data:video/mp4;base64,@@@!"))),
    "chat_unknown_model": (404, "model_not_found", "tiny-qwen", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions",
        json=chat_body(data_url(NEEDLE.read_bytes()), model="gpt-4o"))),
    "chat_bad_fps": (400, "bad_input", "fps", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", json=chat_body(data_url(NEEDLE.read_bytes()),
                                                       fps="abc"))),
    "remote_url_refused": (400, "remote_media_refused", "disabled", lambda s, t: httpx.post(
        f"{s.url}/v1/chat/completions", json=chat_body("https://example.com/v.mp4"))),
    "symlink_out_of_folder": (403, "forbidden", "outside", None),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_gets_a_4xx_with_a_reason(srv, name, tmp_path, media_dir):
    status, code, mention, make = BAD[name]
    if name == "symlink_out_of_folder":
        make = lambda s, t: _symlink_escape(s, media_dir, t)  # noqa: E731
    r = make(srv, tmp_path)
    got_status, body = (r.status_code, r.json()) if isinstance(r, httpx.Response) else r
    assert got_status == status, body
    err = body["error"]
    assert err["code"] == code and mention.lower() in err["message"].lower(), err
    assert str(srv.data) not in json.dumps(body)            # no server path leaks
    if code == "context_length_exceeded":
        assert err["tokens"] > CONTEXT and err["limit"] == CONTEXT
    if code == "bad_video":          # one status and shape on every route (docs/serving.md)
        assert err["reason"] == "invalid", err
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert wait_no_uploads(srv.app) == []


def test_path_traversal_in_local_paths_is_refused(srv, media_dir, tmp_path):
    for r in _local_path_escape(srv, media_dir, tmp_path):
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "forbidden"
        assert str(tmp_path) not in r.text
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_bearer_auth(ckpt, tmp_path, live_server, monkeypatch):
    monkeypatch.setenv("MMINFER_API_KEY", "s3cret")
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path)))
    s = live_server(app)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = post_answer(s.url, NEEDLE.read_bytes(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{s.url}/v1/latency-report").status_code == 401
    assert httpx.get(f"{s.url}/v1/models").status_code == 401
    assert httpx.get(f"{s.url}/health").status_code == 200     # probes need no key
    ok = post_answer(s.url, NEEDLE.read_bytes(), max_new_tokens=2,
                     headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200, ok.text
    assert uploads_left(app) == []


# ----------------------------------------------------------------------- load and failure

def test_concurrent_uploads_against_a_small_queue(ckpt, tmp_path, live_server):
    # one client fills the queue here: its address's share (test_robust.py) is lifted
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              queue_size=2, timeout_s=120, max_uploads_per_client=0))
    s = live_server(app)
    video = NEEDLE.read_bytes()

    async def one(client, i):
        r = await client.post(f"{s.url}/v1/answer", files={"video": ("v.mp4", video)},
                              data={"question": f"request {i}", "max_new_tokens": "8"})
        return r

    async def burst():
        async with httpx.AsyncClient(timeout=90,
                                     limits=httpx.Limits(max_connections=30)) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(30))), 120)

    rs = asyncio.run(burst())
    assert len(rs) == 30
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 1 and codes.count(503) >= 1, codes
    for r in rs:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert r.json()["answer"] is not None
    assert app.state.worker.served == codes.count(200)       # nothing lost, nothing extra
    m = httpx.get(f"{s.url}/metrics").text
    reqs = metric_values(m, "mminfer:requests_total")
    assert reqs[(("status", "200"),)] == codes.count(200)
    assert reqs[(("status", "503"),)] == codes.count(503)
    assert httpx.get(f"{s.url}/health").status_code == 200
    assert wait_no_uploads(app) == []


def test_timeout_answers_504_and_cleans_up(ckpt, tmp_path, live_server):
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              timeout_s=0.001))
    s = live_server(app)                 # loaded: the 504 is the request's own timeout
    assert app.state.worker.state == "ready"
    r = post_answer(s.url, NEEDLE.read_bytes())
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert "loading" not in r.json()["error"]["message"], r.text
    assert wait_no_uploads(app) == []
    assert httpx.get(f"{s.url}/health").status_code == 200


def test_disconnected_client_is_dropped_from_the_queue(ckpt, tmp_path, live_server):
    # The model is held at a gate, so the requests ahead stay queued for as long as the test
    # needs, however slow the machine (racing a real prefill against uploads was flaky).
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              queue_size=16, timeout_s=120, max_uploads_per_client=0,
                              max_num_seqs=1))      # one held at the gate, the rest queued
    s = live_server(app)
    worker = app.state.worker
    assert worker.wait_ready(120)
    gate = threading.Event()
    answer = worker.pipeline.answer

    def gated(*a, **kw):
        assert gate.wait(120), "the test never opened the gate"
        return answer(*a, **kw)

    worker.pipeline.answer = gated
    video = NEEDLE.read_bytes()
    ahead = 3

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            busy = [asyncio.create_task(c.post(
                f"{s.url}/v1/answer", files={"video": ("v.mp4", video)},
                data={"question": f"q {i}", "max_new_tokens": "4"}))
                for i in range(ahead)]
            # one running (held at the gate), the others queued behind it
            deadline = time.monotonic() + 300
            while len(worker._queue) < ahead - 1:
                assert time.monotonic() < deadline, "the requests ahead never queued"
                assert not any(t.done() for t in busy), [t.result().text for t in busy if t.done()]
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(timeout=120) as impatient:
                task = asyncio.create_task(impatient.post(
                    f"{s.url}/v1/answer", files={"video": ("v.mp4", video)},
                    data={"question": "never mind"}))
                deadline = time.monotonic() + 300
                while not any(j.question == "never mind" for j in worker._queue):
                    assert time.monotonic() < deadline and not task.done()
                    await asyncio.sleep(0.01)
                task.cancel()                  # closes the connection
            # the server notices the closed connection and takes the job off the queue
            deadline = time.monotonic() + 60
            while any(j.question == "never mind" for j in worker._queue):
                assert time.monotonic() < deadline, "the disconnected request stayed queued"
                await asyncio.sleep(0.02)
            gate.set()
            return await asyncio.gather(*busy)

    try:
        rs = asyncio.run(run())
    finally:
        gate.set()
    assert [r.status_code for r in rs] == [200] * ahead, [r.text for r in rs]
    # the impatient request was cancelled while queued: the model never ran it
    assert worker.served == ahead
    m = httpx.get(f"{s.url}/metrics").text
    assert metric_values(m, "mminfer:errors_total")[(("code", "client_disconnected"),)] == 1
    assert wait_no_uploads(app) == []


def test_dead_worker_makes_health_503(tmp_path, live_server):
    not_a_model = tmp_path / "empty-model"
    not_a_model.mkdir()
    app = create_app(Settings(model=str(not_a_model), device="cpu", data_dir=str(tmp_path)))
    s = live_server(app)
    assert not app.state.worker.wait_ready(30)
    h = httpx.get(f"{s.url}/health")
    assert h.status_code == 503 and h.json()["status"] == "dead"
    assert "not a checkpoint" in h.json()["error"]
    r = post_answer(s.url, NEEDLE.read_bytes())
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_dead"
    up = metric_values(httpx.get(f"{s.url}/metrics").text, "mminfer:worker_up", "empty-model")
    assert up == {(): 0.0}
    assert uploads_left(app) == []


def test_worker_killed_by_a_cuda_error_makes_health_503(ckpt, tmp_path, live_server):
    class PoisonedGPU:
        """A CUDA context poisoned mid-request cannot be produced on a CPU machine: this
        stands in for the model and fails the way torch does then."""
        model_id = "tiny-qwen"

        def answer(self, *args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    app = create_app(Settings(model=str(ckpt), data_dir=str(tmp_path)),
                     worker=ModelWorker(PoisonedGPU, queue_size=4))
    s = live_server(app)
    assert httpx.get(f"{s.url}/health").status_code == 200
    r = post_answer(s.url, NEEDLE.read_bytes())
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_dead"
    h = httpx.get(f"{s.url}/health")
    assert h.status_code == 503 and "illegal memory access" in h.json()["error"]
    assert post_answer(s.url, NEEDLE.read_bytes()).status_code == 503
    assert uploads_left(app) == []
    assert is_fatal(KeyboardInterrupt()) and not is_fatal(ValueError("bad fps"))


def test_a_cublas_allocation_failure_fails_the_request_not_the_worker(ckpt, tmp_path,
                                                                      live_server):
    """A request thread's first GEMM creates its cuBLAS handle and workspace; with the device
    full that fails as CUBLAS_STATUS_ALLOC_FAILED (seen on an H100 under load): out of memory
    for that request, and the next one is served."""
    class FullGPU:
        model_id = "tiny-qwen"
        calls = 0

        def answer(self, *args, **kwargs):
            FullGPU.calls += 1
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                               "`cublasCreate(handle)`")

    app = create_app(Settings(model=str(ckpt), data_dir=str(tmp_path)),
                     worker=ModelWorker(FullGPU, queue_size=4))
    s = live_server(app)
    for _ in range(2):
        r = post_answer(s.url, NEEDLE.read_bytes())
        assert r.status_code == 500 and r.json()["error"]["code"] == "out_of_memory"
    assert FullGPU.calls == 2
    assert httpx.get(f"{s.url}/health").status_code == 200


def test_out_of_memory_runs_again_once_idle_prefixes_left_the_device(ckpt, tmp_path,
                                                                     live_server, caplog):
    """A prefill that runs out of memory although the room check passed (free memory in pieces
    too small for its tensors) runs once more after every idle cached prefix has left the
    device: the request is answered, its answer the one asked again from the cache, the failed
    attempt's time its ``retry`` stage (inside its ttft: the stages add up). With nothing idle
    to move the error stands (500 out_of_memory) and it is not run again."""
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              api_key=None))
    s = live_server(app)
    pipe = app.state.worker.pipeline
    real, calls, fail = pipe.adapter.prefill_prefix, [], []

    def prefill_prefix(*args, **kwargs):
        calls.append(1)
        if fail:
            fail.pop()
            time.sleep(0.5)                # the failed attempt's work
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.85 GiB")
        return real(*args, **kwargs)

    pipe.adapter.prefill_prefix = prefill_prefix
    other = (SAMPLES / "colour_0.mp4").read_bytes()
    fail.append(1)                         # nothing cached yet: nothing to move
    r = post_answer(s.url, other)
    assert r.status_code == 500 and r.json()["error"]["code"] == "out_of_memory"
    assert len(calls) == 1 and pipe.video_cache.stats()["idle_spills"] == 0
    first = post_answer(s.url, NEEDLE.read_bytes())                    # cached, idle
    assert first.status_code == 200 and first.json()["timings_ms"]["retry"] == 0
    assert pipe.video_cache.stats()["gpu_entries"] == 1
    fail.append(1)
    with caplog.at_level("WARNING", logger="mminfer.serve"):
        r = post_answer(s.url, other)
    assert r.status_code == 200, r.text
    assert len(calls) == 4                 # the failed attempt and the one after it
    st = pipe.video_cache.stats()
    assert st["idle_spills"] == 1 and st["evictions_gpu"] >= 1
    assert any("runs again" in m for m in caplog.messages)
    t = r.json()["timings_ms"]
    assert t["retry"] >= 500 and list(t)[:4] == ["upload", "queue", "retry", "wait"]
    assert t["ttft"] >= t["retry"] + t["vision"] + t["index"] + t["suffix"]
    assert t["total"] >= t["ttft"] + t["generate"] - 5.0
    again = post_answer(s.url, other)
    assert again.status_code == 200 and again.json()["cache"] in ("hit", "host")
    assert again.json()["answer"] == r.json()["answer"]
    assert len(calls) == 4
    metrics = httpx.get(f"{s.url}/metrics").text
    assert "mminfer:prefix_cache_idle_spills_total" in metrics


def test_out_of_memory_runs_again_when_a_garbage_collection_freed_device_memory(
        ckpt, tmp_path, live_server, monkeypatch):
    """With no idle cached prefix to move, a request out of memory still runs again when the
    garbage collection before the retry freed device memory that reference cycles held (an
    H100 had 52 GB held that way); when it freed less than RECLAIMED_BYTES the error stands.
    No GPU here: the allocator's count is a stand-in that drops by what the collection
    reclaims."""
    from mminfer.serve import worker as W

    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              api_key=None))
    s = live_server(app)
    pipe = app.state.worker.pipeline
    real, calls, fail = pipe.adapter.prefill_prefix, [], []
    held = {"bytes": 0}

    def prefill_prefix(*args, **kwargs):
        calls.append(1)
        if fail:
            fail.pop()
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 788 MiB")
        return real(*args, **kwargs)

    collect = W.gc.collect

    def collected(*args):
        held["bytes"] = 0                   # what only cycles held is gone
        return collect(*args)

    pipe.adapter.prefill_prefix = prefill_prefix
    monkeypatch.setattr(W, "_device_allocated", lambda: held["bytes"])
    monkeypatch.setattr(W.gc, "collect", collected)
    for garbage, status, clip in ((W.RECLAIMED_BYTES // 2, 500, "colour_1"),
                                  (52 << 30, 200, "colour_2")):
        held["bytes"] = garbage
        fail.append(1)
        n = len(calls)
        r = post_answer(s.url, (SAMPLES / f"{clip}.mp4").read_bytes())
        assert r.status_code == status, r.text
        assert len(calls) - n == (1 if status == 500 else 2)
        assert pipe.video_cache.stats()["gpu_entries"] == (0 if status == 500 else 1)


def test_the_loaded_model_is_kept_out_of_garbage_collections():
    """A full collection walks every tracked object holding the interpreter lock, and the
    event loop waits with it: the embedded model's 370,000 objects made 0.3 s /health stalls
    in make loadtest's base phase (a collection falling due in the model thread's sparse
    prefill). Once loaded, the model is frozen out of collections; stopping the worker gives
    it back. Before: the model's objects stayed tracked, every full collection walked them."""
    class Model:
        model_id = "many-objects"

        def __init__(self):
            self.graph = [{"layer": i} for i in range(100_000)]

        def answer(self, *args, **kwargs):
            raise AssertionError("not asked")

    w = ModelWorker(Model, queue_size=1)
    w.start()
    try:
        assert w.wait_ready(30)
        graph = w.pipeline.graph
        assert gc.get_freeze_count() >= len(graph)
        assert not any(o is graph for o in gc.get_objects())
    finally:
        w.stop()
    assert gc.get_freeze_count() == 0 and any(o is graph for o in gc.get_objects())


def test_the_event_loop_waits_at_most_half_a_ms_for_the_model_thread_to_let_go():
    """The model thread runs Python for long stretches (the Triton interpreter's sparse
    prefill on a CPU); CPython hands the interpreter lock on after the switch interval, to
    whichever waiting thread runs first. At the default 5 ms the event loop, beside two more
    waiting threads, waited over 100 ms at a time (make loadtest's base phase: /health
    stalls); a worker runs at 0.5 ms and puts the previous interval back when it stops."""
    import sys
    was = sys.getswitchinterval()
    w = ModelWorker(lambda: object(), queue_size=1)
    w.start()
    try:
        assert w.wait_ready(30)
        assert sys.getswitchinterval() <= 0.0005
    finally:
        w.stop()
    assert sys.getswitchinterval() == was


# ----------------------------------------------------------------------- metrics, report, store

def test_metrics_and_latency_report(srv):
    assert post_answer(srv.url, b"", "q").status_code == 400
    for _ in range(2):
        assert post_answer(srv.url, NEEDLE.read_bytes(), max_new_tokens="3").status_code == 200
    m = httpx.get(f"{srv.url}/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in ("mminfer:time_to_first_token_seconds_count",
                 "mminfer:request_prefill_time_seconds_count",
                 "mminfer:request_queue_time_seconds_count"):
        (count,) = metric_values(text, name).values()
        assert count >= 2, name
    stages = metric_values(text, "mminfer:stage_seconds_count")
    for stage in ("decode", "preprocess", "vision", "attention", "generate", "queue"):
        assert stages[(("stage", stage),)] >= 2, stage
    assert (("stage", "ttft"),) not in stages and (("stage", "total"),) not in stages
    (decode_n,) = metric_values(text, "mminfer:request_decode_time_seconds_count").values()
    assert decode_n == stages[(("stage", "generate"),)]
    (gaps,) = metric_values(text, "mminfer:time_per_output_token_seconds_count").values()
    assert 1 <= gaps <= decode_n        # requests that generated two tokens or more
    ok = metric_values(text, "mminfer:requests_total")[(("status", "200"),)]
    (ttft_count,) = metric_values(text, "mminfer:time_to_first_token_seconds_count").values()
    assert ttft_count == ok
    assert metric_values(text, "mminfer:errors_total")     # the corpus ran errors before

    rep = httpx.get(f"{srv.url}/v1/latency-report").json()
    rows = {(r["stage"], r["bucket"]): r for r in rep["rows"]}
    ttft = rows[("ttft", "<1K")]
    assert ttft["count"] == ok and 0 < ttft["p50_ms"] <= ttft["p95_ms"] <= ttft["p99_ms"]
    assert ttft["mean_density"] == 1.0                    # dense prefills
    assert rep["errors"] and rep["succeeded"] == ok
    future = httpx.get(f"{srv.url}/v1/latency-report",
                       params={"since": time.time() + 3600}).json()
    assert future["rows"] == [] and future["requests"] == 0
    past = httpx.get(f"{srv.url}/v1/latency-report",
                     params={"until": "2001-01-01T00:00:00"}).json()
    assert past["rows"] == []
    bad = httpx.get(f"{srv.url}/v1/latency-report", params={"since": "yesterday"})
    assert bad.status_code == 400 and "yesterday" in bad.json()["error"]["message"]


def test_latency_records_survive_a_restart(ckpt, tmp_path, live_server):
    settings = Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path))
    first = live_server(create_app(settings))
    ids = [post_answer(first.url, NEEDLE.read_bytes(), max_new_tokens="2").json()["request_id"]
           for _ in range(2)]
    first.__exit__(None, None, None)                    # the first server is gone
    again = live_server(create_app(settings))
    rep = httpx.get(f"{again.url}/v1/latency-report").json()
    assert rep["succeeded"] == 2
    assert {(r["stage"], r["count"]) for r in rep["rows"] if r["stage"] == "total"} == {
        ("total", 2)}
    stored = LatencyStore(tmp_path / "latency.sqlite3").rows()
    assert [r["id"] for r in stored] == ids


def test_store_report_math(tmp_path):
    st = LatencyStore(tmp_path / "x.sqlite3")
    for i in range(1, 101):
        st.add(id=f"a{i}", endpoint="answer", status=200, tokens=500, density=1.0,
               timings={"ttft": float(i)}, ts=1000.0 + i)
        st.add(id=f"b{i}", endpoint="answer", status=200, tokens=20000, density=0.25,
               timings={"ttft": 10.0 * i}, ts=1000.0 + i)
    st.add(id="e", endpoint="answer", status=400, code="bad_video", ts=1050.5)
    rep = st.report()
    rows = {(r["stage"], r["bucket"]): r for r in rep["rows"]}
    assert rep["buckets"] == ["<1K", "16K-64K"]
    a, b = rows[("ttft", "<1K")], rows[("ttft", "16K-64K")]
    assert (a["count"], a["p50_ms"], a["p99_ms"], a["mean_density"]) == (100, 50.5, 99.01, 1.0)
    assert (b["p50_ms"], b["p95_ms"], b["mean_density"]) == (505.0, 950.5, 0.25)
    assert rep["errors"] == {"bad_video": 1}
    win = st.report(since=1051, until=1061)           # ts 1051..1060: ten of each
    assert {r["count"] for r in win["rows"]} == {10} and win["errors"] == {}
    assert bucket_of(1023) == "<1K" and bucket_of(1024) == "1K-4K"
    assert bucket_of(2_000_000) == ">=1M"
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    st.close()


# ----------------------------------------------------------------------- CLI and default model

def test_default_model(tmp_path, monkeypatch):
    """No --model: MMINFER_MODEL, else the embedded model; missing, a ConfigError that says
    how to build it and what to pass instead."""
    from mminfer.models import embedded
    monkeypatch.delenv("MMINFER_MODEL", raising=False)
    monkeypatch.setattr(embedded, "DEFAULT_MODEL_DIR", tmp_path / "model")
    with pytest.raises(ConfigError, match="--model.*|build_embedded"):
        embedded.resolve_model(None)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    assert embedded.resolve_model(None) == str(tmp_path / "model")
    monkeypatch.setenv("MMINFER_MODEL", "/some/where")
    assert embedded.resolve_model(None) == "/some/where"
    assert embedded.resolve_model("/given") == "/given"


def test_serve_command_starts_and_prints_a_curl_line(ckpt, tmp_path):
    import signal
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MMINFER_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "mminfer.cli", "serve", "--model", str(ckpt),
                          "--port", "0", "--data-dir", str(tmp_path), "--device", "cpu",
                          "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.strip().startswith("curl"):
                break
        out = "".join(lines)
        assert "mminfer serving tiny-qwen at http://127.0.0.1:" in out, out
        url = out.split(" at ", 1)[1].split()[0]
        assert "-F video=@" in lines[-1] and f"{url}/v1/answer" in lines[-1]
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
    bad = subprocess.run([sys.executable, "-m", "mminfer.cli", "serve", "--model",
                          str(tmp_path / "nope"), "--port", "0", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "nope" in bad.stderr


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_serve_stops_without_leaks_or_tracebacks(ckpt, tmp_path, how):
    """A process manager's SIGTERM, or Ctrl-C in a terminal (SIGINT to the whole process
    group: the server and its JSON-parsing and decoding children): the server shuts down
    and nothing reports a leaked semaphore or prints a traceback."""
    import signal
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MMINFER_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "mminfer.cli", "serve", "--model", str(ckpt),
                          "--port", "0", "--data-dir", str(tmp_path), "--device", "cpu"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    out = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            out.append(line)
            if not line or line.strip().startswith("curl"):
                break
        url = "".join(out).split(" at ", 1)[1].split()[0]
        # a body big enough to be parsed by the parsing processes (its answer does not matter)
        big = chat_body(data_url(NEEDLE.read_bytes()), text="what? " + " " * 300_000)
        r = httpx.post(f"{url}/v1/chat/completions", json=big, timeout=120)
        assert r.status_code < 500, r.text
        if how == "sigterm":
            p.send_signal(signal.SIGTERM)
        else:
            os.killpg(p.pid, signal.SIGINT)
        rest, _ = p.communicate(timeout=120)      # until every child has let go of the pipe
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    log = "".join(out) + rest
    assert "Application shutdown complete" in log, log[-3000:]
    assert "leaked" not in log and "Traceback" not in log, log[-3000:]


def test_openapi_documents_both_post_bodies(srv):
    spec = httpx.get(f"{srv.url}/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def body(path):
        (ctype, media), = spec["paths"][path]["post"]["requestBody"]["content"].items()
        name = media["schema"]["$ref"].rsplit("/", 1)[1]
        return ctype, schemas[name]

    ctype, form = body("/v1/answer")
    assert ctype == "multipart/form-data"
    assert set(form["required"]) == {"question"}       # a video file or a video_id
    assert form["properties"]["video"]["format"] == "binary"
    assert "video_id" in form["properties"]
    assert "/v1/videos" in spec["paths"] and "/v1/videos/{video_id}" in spec["paths"]
    assert {"fps", "max_frames", "max_new_tokens", "attention"} <= set(form["properties"])
    ctype, chat = body("/v1/chat/completions")
    assert ctype == "application/json" and chat["required"] == ["messages"]
    parts = schemas["Message"]["properties"]["content"]["anyOf"][1]["items"]
    assert set(parts["discriminator"]["mapping"]) >= {"text", "video_url", "image_url"}
    assert "url" in schemas["VideoURL"]["properties"]


def test_the_docs_page_needs_no_other_host(srv):
    """/docs works on a machine without internet access: every script, style sheet and icon
    it names is served by this server, and Swagger UI's online validator is off."""
    import re
    docs = httpx.get(f"{srv.url}/docs")
    assert docs.status_code == 200 and "SwaggerUIBundle" in docs.text
    assert not re.search(r"https?://", docs.text), docs.text
    assert '"validatorUrl": null' in docs.text
    refs = re.findall(r'(?:src|href)="([^"]+)"', docs.text) + re.findall(r"url: '([^']+)'",
                                                                        docs.text)
    assert len(refs) == 4, refs                  # script, style sheet, icon, the schema
    for ref in refs:
        r = httpx.get(f"{srv.url}{ref}")
        assert r.status_code == 200 and len(r.content) > 100, ref
    assert "SwaggerUIBundle" in httpx.get(f"{srv.url}/docs/assets/swagger-ui-bundle.js").text
    nope = httpx.get(f"{srv.url}/docs/assets/..%2Fcore.py")
    assert nope.status_code == 404 and nope.json()["error"]["code"] == "not_found"


def test_served_model_names_and_aliases(ckpt, tmp_path, live_server):
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              served_model_names=("video-qa", "vqa"), api_key=None))
    s = live_server(app)
    ids = [m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]]
    assert ids == ["video-qa", "vqa", "default"]      # every listed name is answered
    for name in ("video-qa", "vqa", "default", "tiny-qwen"):   # and the checkpoint's own
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60, json=chat_body(
            data_url(NEEDLE.read_bytes()), model=name, max_tokens=2))
        assert r.status_code == 200 and r.json()["model"] == "video-qa", r.text
    r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                   json=chat_body(data_url(NEEDLE.read_bytes()), model="gpt-4o"))
    assert r.status_code == 404 and "video-qa" in r.json()["error"]["message"]
    assert post_answer(s.url, NEEDLE.read_bytes(), max_new_tokens=2).json()["model"] == "video-qa"
    m = httpx.get(f"{s.url}/metrics").text
    assert metric_values(m, "mminfer:requests_total", "video-qa")[(("status", "200"),)] == 5


def test_an_uncalibrated_config_is_said_in_models_and_report(srv):
    """The tiny checkpoint's head patterns are the uncalibrated defaults: /v1/models, the JSON
    report and the page say so, and what "auto" does with them (dense until calibrated)."""
    assert srv.app.state.worker.wait_ready(60)
    (m,) = httpx.get(f"{srv.url}/v1/models").json()["data"][:1]
    assert m["mminfer"]["head_patterns"] == "uncalibrated"
    assert m["mminfer"]["auto_attention"].startswith("dense until calibrated")
    rep = httpx.get(f"{srv.url}/v1/latency-report").json()
    assert rep["policy"] == m["mminfer"]
    page = httpx.get(f"{srv.url}/report").text
    assert 'id="policy"' in page and "uncalibrated" in page and "mminfer calibrate" in page
