"""Every limit of the service, exactly, against a real uvicorn server with the tiny Qwen2.5-VL
checkpoint: a request at a limit is served, one over it is refused with the limit's status
and no temp file left; the queue bound counted to the request; intake (concurrent uploads,
slow bodies, a full queue answering before the body is read); stopping running jobs on
disconnect, deadline and shutdown; Retry-After; the data: URL, remote download and chunked
body size checks (each test fails if its check is removed); JSON the parser rejects; the
report in SQL with retention and behind the key.
"""

import asyncio
import base64
import http.server
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, read_response

from mminfer.serve.app import Settings, create_app
from mminfer.serve.store import LatencyStore, percentile
from mminfer.serve.worker import ModelWorker
from lab.toy.tiny import save_tiny_qwen2_5_vl

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "videos"
NEEDLE = SAMPLES / "needle_0.mp4"           # 10 s, 2 fps, 224x224


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("lim") / "tiny-qwen",
                                max_position_embeddings=4096)


@pytest.fixture(scope="module")
def slow_ckpt(tmp_path_factory):
    """Bigger frames: a sparse prefill of hundreds of tokens, which the Triton interpreter
    runs for minutes, one kernel launch lasting many seconds."""
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("slow") / "tiny-qwen",
                                max_pixels=28 * 28 * 64)


def uploads_left(app) -> list:
    return sorted(os.listdir(app.state.upload_dir))


def wait_until(cond, timeout=30.0, step=0.02):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(step)


def post_answer(url, video: bytes, question="what number?", timeout=60, **fields):
    data = {"question": question, **{k: str(v) for k, v in fields.items()}}
    return httpx.post(f"{url}/v1/answer", files={"video": ("clip.mp4", video, "video/mp4")},
                      data=data, timeout=timeout)


def chat_json(url_of_video, text="What number appears?", **extra):
    return {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url_of_video}},
        {"type": "text", "text": text}]}], **extra}


def data_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def error_of(r) -> dict:
    return r.json()["error"]


class Gated:
    """The real pipeline behind a gate the test opens, so the worker can be held on one job
    while the queue is filled to the request."""

    def __init__(self, ckpt):
        from mminfer.engine.pipeline import Pipeline
        self.inner = Pipeline(str(ckpt), device="cpu")
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def answer(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(120)
        return self.inner.answer(*args, **kwargs)


def gated_server(ckpt, tmp_path, live_server, **settings):
    holder = {}
    settings.setdefault("max_uploads_per_client", 0)   # these tests fill every slot from one

    def load():
        holder["p"] = Gated(ckpt)
        return holder["p"]

    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              api_key=None, **settings),
                     # one job held at the gate, the rest queued behind it: one at a time
                     worker=ModelWorker(load, queue_size=settings.get("queue_size", 8),
                                        max_active=1))
    s = live_server(app)
    assert app.state.worker.wait_ready(60)
    return s, app, holder["p"]


def raw_connect(port, head: bytes, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + body)
    return sock


def multipart_head(length: int, boundary=b"BB", extra=b"") -> bytes:
    return (b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
            b"boundary=" + boundary + b"\r\nContent-Length: " + str(length).encode() +
            b"\r\n" + extra + b"\r\n")


def video_part_start(boundary=b"BB") -> bytes:
    return (b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"question\"\r\n\r\n"
            b"what?\r\n--" + boundary + b"\r\nContent-Disposition: form-data; name=\"video\"; "
            b"filename=\"v.mp4\"\r\nContent-Type: video/mp4\r\n\r\n")


# ----------------------------------------------------------------------- budgets

def test_each_budget_exactly(ckpt, tmp_path, live_server):
    """For each budget: a request exactly at it is answered, one over it gets 413 (403 for
    sparse where clients may not ask for it), before the model runs, no temp file left."""
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              api_key=None))
    s = live_server(app)
    cfg = app.state.service.s          # the live settings: each case moves one limit
    video = NEEDLE.read_bytes()
    base = post_answer(s.url, video, fps=2, max_new_tokens=2)
    assert base.status_code == 200, base.text
    frames, visual = base.json()["video"]["frames"], base.json()["tokens"]["visual"]
    assert frames == 20
    served = app.state.worker.served

    def over(field, at, **req):
        """Set the limit to ``at`` (the request's cost): served; to ``at - 1``: refused."""
        setattr(cfg, field, at)
        ok = post_answer(s.url, video, max_new_tokens=2, **req)
        assert ok.status_code == 200, (field, ok.text)
        setattr(cfg, field, at - 1 if isinstance(at, int) else at * (1 - 1e-6))
        r = post_answer(s.url, video, max_new_tokens=2, **req)
        setattr(cfg, field, Settings.__dataclass_fields__[field].default)
        assert uploads_left(app) == []
        return r

    question = "what number?"
    cases = {
        "max_fps": dict(at=2.0, fps=2),
        "max_frame_pixels": dict(at=224 * 224, fps=2),
        "max_decode_mb": dict(at=frames * 224 * 224 * 3 / 2**20, fps=2),
        "max_visual_tokens": dict(at=visual, fps=2),
        "max_question_chars": dict(at=len(question), fps=2),
        "max_frames_limit": dict(at=frames, fps=2, max_frames=frames),
    }
    for field, case in cases.items():
        r = over(field, **case)
        assert r.status_code == 413, (field, r.text)
        err = error_of(r)
        assert err["code"] == "over_limit" and "limit" in err["message"], (field, err)
    # question tokens: the tokenizer decides the count; a long question is over a small limit
    cfg.max_question_tokens = 4
    r = post_answer(s.url, video, question="what " * 20, max_new_tokens=2)
    cfg.max_question_tokens = Settings.max_question_tokens
    assert r.status_code == 413 and "tokens" in error_of(r)["message"]
    # max_frames past the limit is refused, naming the field and the limit, not capped
    r = post_answer(s.url, video, fps=2, max_frames=10**8, max_new_tokens=2)
    err = error_of(r)
    assert r.status_code == 413 and (err["field"], err["limit"]) == ("max_frames", 1024), err
    assert "1024" in err["message"] and "max_frames" in err["message"]
    cfg.allow_client_sparse = False
    r = post_answer(s.url, video, attention="sparse")
    cfg.allow_client_sparse = True
    assert r.status_code == 403 and "sparse" in error_of(r)["message"]
    # the refusals never reached the model: the at-limit requests did
    assert app.state.worker.served == served + len(cases)
    assert uploads_left(app) == []


# ----------------------------------------------------------------------- the queue bound

def test_exactly_queue_size_waiting_then_503(ckpt, tmp_path, live_server):
    s, app, pipe = gated_server(ckpt, tmp_path, live_server, queue_size=3)
    w = app.state.worker
    video = NEEDLE.read_bytes()

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            def send(i):
                return asyncio.create_task(c.post(
                    f"{s.url}/v1/answer", files={"video": ("v.mp4", video)},
                    data={"question": f"q{i}", "max_new_tokens": "2"}))
            first = send(0)
            while not pipe.entered.is_set():
                await asyncio.sleep(0.01)
            waiting = [send(i) for i in range(1, 4)]            # exactly queue_size
            while w.waiting < 3:
                assert not any(t.done() for t in waiting), [t.result().text for t in waiting
                                                            if t.done()]
                await asyncio.sleep(0.01)
            files_before = uploads_left(app)
            try:        # answered at once; a queued one would wait for the gate
                one_more = await c.post(f"{s.url}/v1/answer", timeout=10,
                                        files={"video": ("v.mp4", video)},
                                        data={"question": "one too many"})
            finally:
                pipe.gate.set()
            files_after = uploads_left(app)
            return await asyncio.gather(first, *waiting), one_more, files_before, files_after

    done, refused, before, after = asyncio.run(run())
    assert [r.status_code for r in done] == [200] * 4
    assert refused.status_code == 503 and error_of(refused)["code"] == "queue_full"
    # 1 running + 3 waiting ahead, no job time measured yet: 1 s each
    assert int(refused.headers["retry-after"]) == 4
    assert before == after                 # the refused body was never written
    assert w.served == 4
    wait_until(lambda: uploads_left(app) == [])


def test_full_queue_answers_503_before_the_body_is_read(ckpt, tmp_path, live_server):
    """A slow upload holds the only slot; a 200 MB upload then gets its 503 after sending
    only its headers (with or without Expect: 100-continue), no byte of it on disk."""
    s, app, pipe = gated_server(ckpt, tmp_path, live_server, queue_size=1,
                                upload_grace_s=60, min_upload_kbps=0)
    holder = raw_connect(s.port, multipart_head(10**6), video_part_start() + b"\x00" * 100)
    wait_until(lambda: app.state.worker.reserved == 1)
    for extra in (b"Expect: 100-continue\r\n", b""):
        t0 = time.monotonic()
        sock = raw_connect(s.port, multipart_head(200 * 2**20, extra=extra))
        status, headers, body = read_response(sock, timeout=10)
        assert status == 503 and body["error"]["code"] == "queue_full", body
        assert time.monotonic() - t0 < 2 and int(headers["retry-after"]) >= 1
        sock.close()
    assert len(uploads_left(app)) == 1          # the holder's file only
    holder.close()
    wait_until(lambda: app.state.worker.reserved == 0 and uploads_left(app) == [])


def test_retry_after_is_the_recent_median_times_the_jobs_ahead():
    w = ModelWorker(lambda: None, queue_size=8)
    w.recent_s.extend([1.5] * 20 + [1400.0] * 5)     # a few old long jobs
    slots = [w.reserve() for _ in range(3)]
    assert w.retry_after() == math.ceil(1.5 * 3)     # a mean would say ~840 s
    w.recent_s.clear()
    w.recent_s.extend([100.0] * 9)
    assert w.retry_after(cap=120) == 120
    for slot in slots:
        slot.release()
    assert w.reserved == 0


# ----------------------------------------------------------------------- intake

def test_concurrent_uploads_are_capped(ckpt, tmp_path, live_server):
    s, app, pipe = gated_server(ckpt, tmp_path, live_server, max_concurrent_uploads=2,
                                upload_grace_s=60, min_upload_kbps=0)
    slow = [raw_connect(s.port, multipart_head(10**6), video_part_start() + b"\x00" * 10)
            for _ in range(2)]
    wait_until(lambda: app.state.service.intake.active == 2)
    r = post_answer(s.url, NEEDLE.read_bytes())
    assert r.status_code == 503 and error_of(r)["code"] == "too_many_uploads"
    assert int(r.headers["retry-after"]) >= 1
    for sock in slow:
        sock.close()
    wait_until(lambda: app.state.service.intake.active == 0 and uploads_left(app) == [])
    pipe.gate.set()
    assert post_answer(s.url, NEEDLE.read_bytes(), max_new_tokens=2).status_code == 200


def test_slow_uploads_get_408_and_leave_no_file(ckpt, tmp_path, live_server):
    s, app, pipe = gated_server(ckpt, tmp_path, live_server, upload_grace_s=1.0,
                                min_upload_kbps=4.0, upload_deadline_s=3.0)
    # a trickle: 10 bytes every 0.2 s, far under 4 KiB/s
    sock = raw_connect(s.port, multipart_head(10**6), video_part_start())
    t0 = time.monotonic()
    got = []

    def trickle():
        try:
            while not got:
                sock.sendall(b"\x00" * 10)
                time.sleep(0.2)
        except OSError:
            pass

    threading.Thread(target=trickle, daemon=True).start()
    status, _, body = read_response(sock, timeout=10)
    got.append(status)
    took = time.monotonic() - t0
    assert status == 408 and body["error"]["code"] == "upload_too_slow", body
    assert "KiB/s" in body["error"]["message"] and 0.9 < took < 2.5, took
    sock.close()
    # fast enough, but the whole body not within the deadline
    sock = raw_connect(s.port, multipart_head(10**7), video_part_start())
    t0 = time.monotonic()
    got.clear()

    def steady():
        try:
            while not got:
                sock.sendall(b"\x00" * 2048)        # 20 KiB/s
                time.sleep(0.1)
        except OSError:
            pass

    threading.Thread(target=steady, daemon=True).start()
    status, _, body = read_response(sock, timeout=10)
    got.append(status)
    took = time.monotonic() - t0
    assert status == 408 and "deadline of 3 s" in body["error"]["message"], body
    assert 2.9 < took < 4.5, took
    sock.close()
    wait_until(lambda: uploads_left(app) == [])
    assert app.state.service.intake.active == 0 and app.state.worker.reserved == 0


# ----------------------------------------------------------------------- stopping jobs

def _full_request(fields: dict, video: bytes, boundary=b"RR") -> bytes:
    body = b""
    for k, v in fields.items():
        body += (b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"" +
                 k.encode() + b"\"\r\n\r\n" + str(v).encode() + b"\r\n")
    body += (b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"video\"; "
             b"filename=\"v.mp4\"\r\nContent-Type: video/mp4\r\n\r\n" + video + b"\r\n--" +
             boundary + b"--\r\n")
    return multipart_head(len(body), boundary) + body


def test_an_abandoned_running_job_frees_the_worker_within_2_s(slow_ckpt, tmp_path,
                                                              live_server):
    app = create_app(Settings(model=str(slow_ckpt), device="cpu", data_dir=str(tmp_path),
                              api_key=None))
    s = live_server(app)
    w = app.state.worker
    assert w.wait_ready(60)
    before = post_answer(s.url, NEEDLE.read_bytes(), attention="dense", max_new_tokens=4)
    assert before.status_code == 200
    sock = raw_connect(s.port, _full_request(
        {"question": "what?", "attention": "sparse", "max_new_tokens": 2}, NEEDLE.read_bytes()))
    wait_until(lambda: w.running == 1, timeout=60)
    time.sleep(1.5)                     # well into the prefill: one launch takes seconds here
    assert w.running == 1
    t0 = time.monotonic()
    sock.close()                        # the client leaves
    wait_until(lambda: w.running == 0, timeout=10, step=0.01)
    freed = time.monotonic() - t0
    assert freed < 2.0, freed
    assert w.stopped == 1
    wait_until(lambda: uploads_left(app) == [])
    m = httpx.get(f"{s.url}/metrics").text
    assert 'mminfer:errors_total{code="client_disconnected",model_name="tiny-qwen"} 1.0' in m
    assert 'mminfer:request_stop_seconds_count{model_name="tiny-qwen"} 1.0' in m
    # the model is intact: the same question gets the same (greedy) answer as before
    after = post_answer(s.url, NEEDLE.read_bytes(), attention="dense", max_new_tokens=4)
    assert after.status_code == 200 and after.json()["answer"] == before.json()["answer"]


def test_the_deadline_stops_a_running_job(slow_ckpt, tmp_path, live_server):
    app = create_app(Settings(model=str(slow_ckpt), device="cpu", data_dir=str(tmp_path),
                              api_key=None, timeout_s=2.0))
    s = live_server(app)
    assert app.state.worker.wait_ready(60)
    t0 = time.monotonic()
    r = post_answer(s.url, NEEDLE.read_bytes(), attention="sparse", max_new_tokens=2)
    assert r.status_code == 504 and "while running" in error_of(r)["message"], r.text
    wait_until(lambda: app.state.worker.running == 0, timeout=10, step=0.01)
    assert time.monotonic() - t0 < 2.0 + 2.0 + 1.0     # deadline + stop + slack
    assert app.state.worker.stopped == 1
    wait_until(lambda: uploads_left(app) == [])


def test_sigterm_answers_queued_and_running_requests_with_json_503(slow_ckpt, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "1"}
    env.pop("MMINFER_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "mminfer.cli", "serve", "--model",
                          str(slow_ckpt), "--port", "0", "--data-dir", str(tmp_path),
                          "--device", "cpu", "--log-level", "warning",
                          "--graceful-shutdown-s", "10", "--max-num-seqs", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if " at http://" in line:
                url = line.split(" at ", 1)[1].split()[0]
        assert url, "the server did not start"
        results = [None] * 4

        def ask(i):
            try:
                results[i] = httpx.post(f"{url}/v1/answer", timeout=120, files={"video": (
                    "v.mp4", NEEDLE.read_bytes())}, data={"question": f"q{i}",
                                                          "attention": "sparse"})
            except Exception as e:      # noqa: BLE001
                results[i] = e

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        wait_until(lambda: httpx.get(f"{url}/health").json()["queue"] == 3, timeout=60)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        for th in threads:
            th.join(30)
        # uvicorn re-raises the signal once shut down, so managers see how it ended
        assert p.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 5
    finally:
        if p.poll() is None:
            p.kill()
    for r in results:
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "shutting_down"


# ----------------------------------------------------------------------- bodies and media

@pytest.fixture(scope="module")
def srv(ckpt, tmp_path_factory):
    data = tmp_path_factory.mktemp("limdata")
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(data),
                              max_upload_mb=2.0, max_data_url_mb=0.5, api_key=None))
    with LiveServer(app) as s:
        yield s


def test_data_url_over_its_own_limit(srv):
    # 0.6 MiB of video-looking bytes: under the upload limit (2 MiB) and the JSON body limit,
    # over the data: URL limit (0.5 MiB)
    raw = NEEDLE.read_bytes()[:64] + os.urandom(int(0.6 * 2**20))
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_json(data_url(raw)), timeout=60)
    assert r.status_code == 413, r.text
    assert "data: URL limit" in error_of(r)["message"]
    assert uploads_left(srv.app) == []
    ok = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                    json=chat_json(data_url(NEEDLE.read_bytes()), max_tokens=2))
    assert ok.status_code == 200, ok.text


def test_chunked_json_body_over_the_limit(srv):
    limit = srv.app.state.settings.max_json_bytes

    def gen():                  # no Content-Length: only the streaming check can stop it
        yield b'{"messages": [], "pad": "'
        for _ in range(limit // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(f"{srv.url}/v1/chat/completions", content=gen(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "request body" in error_of(r)["message"], r.text


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,                                  # the parser's recursion
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": ' + b"[" * 900 + b"]" * 900 + b"}]}",
    b'{"max_tokens": 1' + b"0" * 5000 + b', "messages": []}',         # int over 4300 digits
    b"\xff\xfe{}",
])
def test_json_the_parser_rejects_is_a_400(srv, body):
    r = httpx.post(f"{srv.url}/v1/chat/completions", content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "bad_input"
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_health_stays_fast_while_a_big_data_url_is_decoded(ckpt, tmp_path, live_server):
    """/health within its budget while a 64 MB chat body is parsed and its 48 MB data: URL
    decoded. The bound is 0.5 s plus the worst probe of an idle baseline taken first in
    this run (health_probe.py): on a loaded 2-core machine a fixed 0.5 s failed at 0.959 s
    with nothing held (issue 32, item 9)."""
    from health_probe import Prober, health_bound
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              max_upload_mb=64, max_data_url_mb=64, api_key=None))
    s = live_server(app)
    assert app.state.worker.wait_ready(60)
    raw = NEEDLE.read_bytes()[:64] + os.urandom(48 * 2**20)    # decodes, then fails as video
    body = json.dumps(chat_json(data_url(raw))).encode()
    p = Prober(s.url)
    baseline = p.measure(1.0)
    with p:
        r = httpx.post(f"{s.url}/v1/chat/completions", content=body, timeout=120,
                       headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert len(p.times) > 5
    print(f"/health: worst {max(p.times):.3f} s while decoding ({max(p.excess):.3f} s beyond "
          f"the control), idle baseline worst {max(baseline):.3f} s, bound "
          f"{health_bound(baseline):.3f} s")
    assert max(p.excess) < health_bound(baseline), (max(p.excess), max(p.times), max(baseline))
    wait_until(lambda: uploads_left(app) == [])


class _Media(http.server.BaseHTTPRequestHandler):
    """/big (a 1 MiB file, with Content-Length), /big-chunked (the same, without), /slow (a
    byte every 0.2 s)."""
    payload = NEEDLE.read_bytes()[:64] + b"\x00" * 2**20

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/big":
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(self.payload)))
            self.end_headers()
            self.wfile.write(self.payload)
        elif self.path == "/big-chunked":
            self.protocol_version = "HTTP/1.1"
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(self.payload), 65536):
                part = self.payload[i:i + 65536]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.end_headers()
            try:
                for _ in range(200):
                    self.wfile.write(b"\x00")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def media_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.server_address[1]
    httpd.shutdown()


def test_remote_download_limits(ckpt, tmp_path, live_server, media_host):
    base, port = media_host
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              max_upload_mb=0.5, allowed_media_domains=("127.0.0.1", "localhost"),
                              media_fetch_deadline_s=1.0, api_key=None))
    s = live_server(app)

    def ask(url):
        return httpx.post(f"{s.url}/v1/chat/completions", json=chat_json(url), timeout=60)

    for path in ("/big", "/big-chunked"):          # declared, then only counted
        r = ask(base + path)
        assert r.status_code == 413 and error_of(r)["code"] == "too_large", (path, r.text)
    t0 = time.monotonic()
    r = ask(base + "/slow")
    assert r.status_code == 504 and error_of(r)["code"] == "remote_media_timeout", r.text
    assert time.monotonic() - t0 < 3
    # a name that resolves to loopback is refused, though allow-listed
    r = ask(f"http://localhost:{port}/big")
    assert r.status_code == 400 and "loopback" in error_of(r)["message"], r.text
    wait_until(lambda: uploads_left(app) == [])


# ----------------------------------------------------------------------- report

def test_report_page_needs_the_key_when_one_is_set(ckpt, tmp_path, live_server, monkeypatch):
    monkeypatch.setenv("MMINFER_API_KEY", "k3y")
    s = live_server(create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path))))
    r = httpx.get(f"{s.url}/report")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    ok = httpx.get(f"{s.url}/report", headers={"Authorization": "Bearer k3y"})
    assert ok.status_code == 200 and "latency" in ok.text.lower()
    assert httpx.get(f"{s.url}/health").status_code == 200


def test_sql_report_matches_the_python_percentiles_and_retention(tmp_path):
    rng = random.Random(0)
    st = LatencyStore(tmp_path / "r.sqlite3", retention_days=1.0, max_rows=None)
    now = time.time()
    want: dict = {}
    for i in range(400):
        tokens = rng.choice((100, 2000, 20000))
        t = {"ttft": rng.uniform(1, 500), "queue": float(rng.randint(0, 9)), "custom": 1.0}
        dens = rng.choice((None, rng.random()))
        st.add(id=str(i), endpoint="answer", status=200, tokens=tokens, density=dens,
               timings=t, ts=now - rng.uniform(0, 3600))
        for k, v in t.items():
            want.setdefault((k, tokens), []).append((v, dens))
    st.add(id="old", endpoint="answer", status=200, tokens=100, timings={"ttft": 1e9},
           ts=now - 3 * 86400)
    st.add(id="bad", endpoint="chat", status=413, code="too_large", ts=now)
    rep = st.report()
    assert rep["requests"] == 402 and rep["succeeded"] == 401 and rep["errors"] == {
        "too_large": 1}
    assert st.prune(now) == 1                      # the 3-day-old row goes
    rep = st.report()
    assert rep["requests"] == 401 and rep["stages"] == ["queue", "ttft", "custom"]
    label = {100: "<1K", 2000: "1K-4K", 20000: "16K-64K"}
    rows = {(r["stage"], r["bucket"]): r for r in rep["rows"]}
    for (stage, tokens), vals in want.items():
        xs = sorted(v for v, _ in vals)
        r = rows[(stage, label[tokens])]
        assert r["count"] == len(xs)
        for name, q in (("p50_ms", .5), ("p95_ms", .95), ("p99_ms", .99)):
            assert r[name] == pytest.approx(round(percentile(xs, q), 3), abs=1e-3), (stage, name)
        dens = [d for _, d in vals if d is not None]
        assert r["mean_density"] == (pytest.approx(sum(dens) / len(dens), abs=1e-6)
                                     if dens else None)
    capped = LatencyStore(tmp_path / "r.sqlite3", retention_days=None, max_rows=100)
    assert capped.report()["requests"] == 100     # the newest 100 kept
    assert [r["id"] for r in capped.rows()][-1] == "bad"
    capped.close()
    st.close()


def test_a_store_from_before_stage_times_is_migrated(tmp_path):
    import sqlite3
    db = sqlite3.connect(tmp_path / "old.sqlite3")
    db.executescript("CREATE TABLE requests (id TEXT NOT NULL, ts REAL NOT NULL, endpoint TEXT "
                     "NOT NULL, status INTEGER NOT NULL, code TEXT, model TEXT, attention TEXT, "
                     "tokens INTEGER, visual_tokens INTEGER, generated INTEGER, density REAL, "
                     "timings TEXT NOT NULL)")
    for i in range(1, 11):
        db.execute("INSERT INTO requests VALUES (?, ?, 'answer', 200, NULL, 'm', 'dense', 500, "
                   "400, 2, 1.0, ?)", (f"r{i}", time.time(), json.dumps({"ttft": float(i)})))
    db.commit()
    db.close()
    st = LatencyStore(tmp_path / "old.sqlite3")
    (row,) = st.report()["rows"]
    assert (row["stage"], row["count"], row["p50_ms"], row["mean_ms"]) == ("ttft", 10, 5.5, 5.5)
    st.close()


def test_report_charts_have_numeric_axes(tmp_path):
    """Each chart's ticks are round numbers from 0 past the largest bar, and a bar's size
    is its milliseconds on that axis (the TTFT bars had no axis at all)."""
    import re

    from mminfer.serve.report import nice_ticks, render
    st = LatencyStore(tmp_path / "a.sqlite3")
    for i, ttft in enumerate((120.0, 180.0, 260.0, 900.0)):
        st.add(id=str(i), endpoint="answer", status=200, tokens=500, density=1.0,
               timings={"decode": ttft / 4, "attention": ttft / 2, "ttft": ttft,
                        "total": ttft + 5})
    page = render(st.report(), st.rows(), "m")
    st.close()
    assert nice_ticks(837.0) == [0, 500, 1000] and nice_ticks(3.2) == [0, 1, 2, 3, 4]
    assert nice_ticks(160.0) == [0, 50, 100, 150, 200]
    pct = page[page.index('id="pct-ttft"'):]
    pct = pct[:pct.index("</svg>")]
    ticks = [(float(ms), float(y)) for ms, y in re.findall(
        r'class="tick" data-ms="([0-9.e+]+)" x="[0-9.]+" y="([0-9.]+)"', pct)]
    assert [t for t, _ in ticks] == [0, 500, 1000]      # the p99 is 874 ms
    px_per_ms = (ticks[0][1] - ticks[-1][1]) / 1000
    (p99,) = re.findall(r'data-pct="p99" data-ms="([0-9.]+)" x="[0-9.]+" y="[0-9.]+" '
                        r'width="[0-9.]+" height="([0-9.]+)"', pct)
    assert float(p99[1]) == pytest.approx(float(p99[0]) * px_per_ms, abs=0.02)
    stage = page[page.index('id="stage-chart"'):]
    assert 'data-axis="x"' in stage[:stage.index("</svg>")]
