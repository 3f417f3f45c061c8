"""Issue 32, items 2-5, 7 and 10, against a real uvicorn server running the guarded protocol
(serve/protocol.py) with the tiny Qwen2.5-VL checkpoint: legal but huge JSON bodies do not
hold /health; slow clients from one address cannot take every slot; slow headers and
connection floods are cut off; refusals before authentication are not stored; bad input is a
JSON 4xx (507 for a full disk), never a 500 with exception text; the chat schema is strict;
the CLI checks what it can before loading a model. Each test fails without its fix.
"""

import base64
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.serve import media
from mminfer.serve.app import Settings, create_app
from mminfer.serve.protocol import config as guarded_config

from conftest import read_response
from health_probe import Prober, health_bound

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "videos"
NEEDLE = SAMPLES / "needle_0.mp4"


class GuardedServer:
    """``mminfer serve``'s uvicorn set-up (the guarded protocol) in a background thread."""

    def __init__(self, app):
        import uvicorn
        self.app = app
        self.server = uvicorn.Server(guarded_config(app, host="127.0.0.1", port=0,
                                                    log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        assert app.state.worker.wait_ready(60)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("rob") / "tiny-qwen",
                                max_position_embeddings=4096)


@pytest.fixture
def serve(ckpt, tmp_path):
    started = []

    def start(**settings):
        settings.setdefault("api_key", None)
        s = GuardedServer(create_app(Settings(model=str(ckpt), device="cpu",
                                              data_dir=str(tmp_path / f"d{len(started)}"),
                                              **settings)))
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def chat(url_of_video, text="What number appears?", **extra):
    return {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url_of_video}},
        {"type": "text", "text": text}]}], **extra}


def data_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def connect(port, source="127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30,
                                    source_address=(source, 0))


# ----------------------------------------------------------------------- item 2

@pytest.mark.parametrize("shape", ["parts", "messages"])
def test_a_huge_legal_json_body_does_not_hold_health(serve, shape):
    """2M text parts (64 MB) or 1M messages: legal JSON under the body limit. Before: /health
    held 7.0 s / 3.25 s while the body was parsed and validated. Now: refused with 413 (over
    the item count) and /health stays within its bound."""
    s = serve(max_upload_mb=64, max_data_url_mb=64)
    if shape == "parts":
        body = {"messages": [{"role": "user", "content":
                              [{"type": "text", "text": "ab"}] * 2_000_000}]}
    else:
        body = {"messages": [{"role": "user", "content": "hello"}] * 1_000_000}
    raw = json.dumps(body).encode()
    del body
    assert len(raw) <= s.app.state.settings.max_json_bytes
    # Two tries, the better one judged: once in a fresh-clone run of the whole suite on the
    # 2-core machine one probe took 0.69 s over its control (the server here shares the test
    # process with what earlier tests left running; alone it stays under 0.02 s). A parse on
    # the event loop holds /health for seconds on every try (7.0 s before the fix).
    seen = []
    for _ in range(2):
        p = Prober(s.url)
        base = p.measure(1.0)
        with p:
            r = httpx.post(f"{s.url}/v1/chat/completions", content=raw, timeout=120,
                           headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "JSON values" in r.json()["error"]["message"], r.text
        assert len(p.times) > 5
        seen.append((max(p.excess), max(p.times), max(base)))
        if max(p.excess) < health_bound(base):
            break
    else:
        raise AssertionError(f"/health held on both tries (excess, worst, baseline): {seen}")


def test_the_item_bound_is_exact(serve):
    s = serve(max_json_items=40)

    def body(n_parts):
        return chat("data:video/mp4;base64,AAAA", text="x") | {
            "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                *[{"type": "text", "text": "x"}] * n_parts]}]}

    # values: body 1, messages 1, message 1 + role + content 1, video part 1 + type +
    # video_url 1 + url, each text part 1 + type + text = 3: 10 + 3n
    ok = httpx.post(f"{s.url}/v1/chat/completions", json=body(10), timeout=60)
    assert ok.status_code != 413, ok.text            # 40 values: at the bound
    over = httpx.post(f"{s.url}/v1/chat/completions", json=body(11), timeout=60)
    assert over.status_code == 413, over.text


# ----------------------------------------------------------------------- item 3

def _slow_upload(port, source, rid):
    sock = connect(port, source)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 1000000\r\nX-Request-ID: " +
                 rid.encode() + b"\r\n\r\n{")
    return sock


def test_slow_clients_from_one_address_leave_slots_for_others(serve):
    """Eight slow bodies from one address (127.0.0.2): only its share (half the upload
    places) holds a slot, the rest get 429 with Retry-After; a client at another address is
    answered. Before: the eight held every slot and the legitimate client got 503."""
    s = serve(queue_size=8, upload_grace_s=60, min_upload_kbps=0)
    svc = s.app.state.service
    held, refused = [], []
    for i in range(8):
        sock = _slow_upload(s.port, "127.0.0.2", f"slow-{i}")
        held.append(sock)
    deadline = time.monotonic() + 10
    while svc.intake.active < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    for sock in held[4:]:
        status, headers, body = read_response(sock, timeout=10)
        refused.append((status, body["error"]["code"], int(headers["retry-after"])))
    assert svc.intake.active == 4, svc.intake.active
    assert [r[:2] for r in refused] == [(429, "too_many_requests")] * 4 and \
        all(r[2] >= 1 for r in refused)
    r = httpx.post(f"{s.url}/v1/chat/completions", timeout=120,
                   json=chat(data_url(NEEDLE.read_bytes()), max_tokens=2))
    assert r.status_code == 200, r.text
    for sock in held:
        sock.close()


def test_headers_must_arrive_within_the_deadline(serve):
    """Headers sent a byte at a time: 408 JSON at the deadline and the connection closed.
    Before: held as long as the client liked (400 such connections: 40 s, fds 14 -> 415)."""
    s = serve(header_timeout_s=1.0)
    sock = connect(s.port)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/answer HTTP/1.1\r\nHo")
    status, _, body = read_response(sock, timeout=10)
    took = time.monotonic() - t0
    assert status == 408 and body["error"]["code"] == "header_timeout", body
    assert 0.9 < took < 3, took
    assert sock.recv(10) == b""             # closed
    sock.close()
    idle = connect(s.port)                  # nothing at all: the same deadline
    status, _, body = read_response(idle, timeout=10)
    assert status == 408
    idle.close()
    # a kept-alive connection serves several requests; the deadline is per request
    with httpx.Client(timeout=10) as c:
        for _ in range(3):
            assert c.get(f"{s.url}/health").status_code == 200
            time.sleep(0.5)


def test_connections_are_capped_per_address_and_in_all(serve):
    s = serve(max_connections_per_client=5, max_connections=8, header_timeout_s=30)
    flood = [connect(s.port, "127.0.0.3") for _ in range(5)]
    time.sleep(0.3)
    extra = connect(s.port, "127.0.0.3")
    status, headers, body = read_response(extra, timeout=10)
    assert status == 503 and body["error"]["code"] == "too_many_connections"
    assert "retry-after" in headers
    extra.close()
    assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200   # another address
    more = [connect(s.port, "127.0.0.4") for _ in range(3)]               # 8 in all
    time.sleep(0.3)
    one_over = connect(s.port, "127.0.0.5")
    status, _, body = read_response(one_over, timeout=10)
    assert status == 503
    one_over.close()
    for sock in flood + more:
        sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{s.url}/metrics").text
    refused = {x.labels["reason"]: x.value
               for fam in text_string_to_metric_families(metrics) for x in fam.samples
               if x.name == "mminfer:refused_connections_total"}
    assert refused.get("connections_per_client") == 1 and refused.get("connections") == 1


# ----------------------------------------------------------------------- item 4

def test_refusals_before_authentication_are_counted_not_stored(serve):
    """2,100 keyless POSTs at --report-max-rows 1000 evicted every real record. Now a 401 is
    a metric only: the real record survives any number of them."""
    s = serve(api_key="k3y", report_max_rows=5)
    auth = {"Authorization": "Bearer k3y"}
    ok = httpx.post(f"{s.url}/v1/chat/completions", headers=auth, timeout=120,
                    json=chat(data_url(NEEDLE.read_bytes()), max_tokens=2))
    assert ok.status_code == 200, ok.text
    with httpx.Client(timeout=10) as c:
        for _ in range(30):
            assert c.post(f"{s.url}/v1/chat/completions", json={}).status_code == 401
    rows = s.app.state.store.rows()
    assert [r["status"] for r in rows] == [200], rows
    metrics = httpx.get(f"{s.url}/metrics", headers=auth).text    # the admin's key
    samples = [x for fam in text_string_to_metric_families(metrics) for x in fam.samples]
    assert any(x.name == "mminfer:refused_connections_total" and
               x.labels["reason"] == "unauthorized" and x.value == 30 for x in samples)
    assert any(x.name == "mminfer:requests_total" and x.labels["status"] == "401" and
               x.value == 30 for x in samples)


# ----------------------------------------------------------------------- item 5

@pytest.fixture
def media_srv(serve, tmp_path):
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "needle.mp4").write_bytes(NEEDLE.read_bytes())
    s = serve(allowed_local_media_path=str(folder), allowed_media_domains=("example.com",))
    s.folder = folder
    return s


@pytest.mark.parametrize("url", ["http://[::1/v.mp4", "http://[zz]:8099/", "file://[::1/x",
                                 "https://example.com:99999/v.mp4"])
def test_malformed_urls_are_a_400(media_srv, url):
    r = httpx.post(f"{media_srv.url}/v1/chat/completions", json=chat(url), timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "bad_input"


def test_a_lone_surrogate_in_the_question_is_a_400(media_srv):
    body = json.dumps(chat(data_url(NEEDLE.read_bytes()), text="\ud800"))   # \ud800 escaped
    assert "\\ud800" in body
    r = httpx.post(f"{media_srv.url}/v1/chat/completions", content=body.encode(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full to fill a disk")
def test_a_full_disk_is_507_and_health_says_so(serve, monkeypatch):
    """Uploads written where every write fails with ENOSPC (/dev/full, behind the temp
    file's name). Before: a 500 with ``OSError: [Errno 28]`` echoed and /health "ok"."""
    s = serve()
    real_new_temp = media.new_temp

    def full_temp(folder):
        path = real_new_temp(folder)
        os.unlink(path)
        os.symlink("/dev/full", path)
        return path

    monkeypatch.setattr(media, "new_temp", full_temp)
    for send in (lambda: httpx.post(f"{s.url}/v1/answer", data={"question": "q"}, timeout=60,
                                    files={"video": ("v.mp4", NEEDLE.read_bytes(),
                                                     "video/mp4")}),
                 lambda: httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                                    json=chat(data_url(NEEDLE.read_bytes())))):
        r = send()
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["code"] == "insufficient_storage" and "Errno" not in err["message"]
    h = httpx.get(f"{s.url}/health")
    assert h.status_code == 503 and h.json()["status"] == "storage_full", h.text
    monkeypatch.setattr(media, "new_temp", real_new_temp)
    ok = httpx.post(f"{s.url}/v1/chat/completions", timeout=120,
                    json=chat(data_url(NEEDLE.read_bytes()), max_tokens=2))
    assert ok.status_code == 200
    # the disk of the test machine has room: health is ok again
    assert httpx.get(f"{s.url}/health").json()["status"] == "ok"
    assert os.listdir(s.app.state.upload_dir) == []


def test_a_500_carries_no_exception_text(serve):
    s = serve()
    pipe = s.app.state.worker.pipeline

    class Broken:
        def __getattr__(self, name):
            return getattr(pipe, name)

        def answer(self, *a, **k):
            raise RuntimeError("secret detail /srv/private/path")

    s.app.state.worker.pipeline = Broken()
    r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                   json=chat(data_url(NEEDLE.read_bytes()), max_tokens=2))
    assert r.status_code == 500
    assert "secret" not in r.text and "/srv" not in r.text, r.text
    assert r.json()["error"]["request_id"] in r.json()["error"]["message"]


@pytest.mark.parametrize("raw, status", [
    (b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n", 431),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
])
def test_protocol_errors_are_json(serve, raw, status):
    s = serve()
    sock = connect(s.port)
    sock.sendall(raw)
    got, headers, body = read_response(sock, timeout=10)
    sock.close()
    assert got == status and headers["content-type"] == "application/json", (got, headers)
    assert body["error"]["code"] in ("bad_http", "headers_too_large")
    assert httpx.get(f"{s.url}/health").status_code == 200


# ----------------------------------------------------------------------- item 7

@pytest.mark.parametrize("extra, field", [({"stream": "yes"}, "stream"),
                                          ({"fps": "2"}, "fps"),
                                          ({"max_tokens": "2"}, "max_tokens"),
                                          ({"stream": 1}, "stream"),
                                          ({"mm_processor_kwargs": {"fps": "2"}}, "fps")])
def test_the_chat_schema_is_strict(media_srv, extra, field):
    r = httpx.post(f"{media_srv.url}/v1/chat/completions", timeout=30,
                   json=chat("file:///nowhere.mp4", **extra))
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_file_urls_name_this_server_only_and_any_case(media_srv):
    path = media_srv.folder / "needle.mp4"
    r = httpx.post(f"{media_srv.url}/v1/chat/completions", timeout=30,
                   json=chat(f"file://otherhost{path}"))
    assert r.status_code == 403 and "otherhost" in r.json()["error"]["message"], r.text
    for url in (f"FILE://{path}", f"File://localhost{path}"):
        ok = httpx.post(f"{media_srv.url}/v1/chat/completions", timeout=120,
                        json=chat(url, max_tokens=2))
        assert ok.status_code == 200, (url, ok.text)


def test_base64_with_line_breaks_is_accepted(media_srv):
    mime = base64.encodebytes(NEEDLE.read_bytes()).decode()      # 76-char lines, \n
    assert "\n" in mime
    for sep in ("\n", "\r\n"):
        url = "data:video/mp4;base64," + mime.replace("\n", sep)
        r = httpx.post(f"{media_srv.url}/v1/chat/completions", timeout=120,
                       json=chat(url, max_tokens=2))
        assert r.status_code == 200, r.text
    bad = "data:video/mp4;base64," + mime.replace("\n", "\n!")
    r = httpx.post(f"{media_srv.url}/v1/chat/completions", timeout=60, json=chat(bad))
    assert r.status_code == 400


def test_the_base64_pieces_decode_to_the_same_bytes():
    raw = os.urandom(100_003)
    mime = base64.encodebytes(raw).decode().replace("\n", "\r\n")
    for chunk in (4, 76, 1000, 4096, 1 << 20):
        out = b"".join(base64.b64decode(p, validate=True)
                       for p, _ in media._b64_pieces(mime, chunk))
        assert out == raw, chunk


# ----------------------------------------------------------------------- item 10

def test_health_hides_the_running_request_id_when_a_key_is_set(serve):
    s = serve(api_key="k3y")
    assert "running_request_id" not in httpx.get(f"{s.url}/health").json()
    s2 = serve()
    assert "running_request_id" in httpx.get(f"{s2.url}/health").json()


def test_answer_checks_the_file_before_loading_a_model(monkeypatch, capsys):
    from mminfer import cli
    from mminfer.engine import pipeline

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the file was checked")

    monkeypatch.setattr(pipeline, "Pipeline", no_load)
    t0 = time.monotonic()
    rc = cli.main(["answer", "/nonexistent.mp4", "what?"])
    assert rc == 2 and "no such file" in capsys.readouterr().err
    assert time.monotonic() - t0 < 5


def test_serve_checks_the_port_before_loading_a_model(monkeypatch, capsys, tmp_path):
    from mminfer import cli
    from mminfer.serve import app as app_module

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(app_module, "create_app", no_load)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        rc = cli.main(["serve", "--port", str(port), "--data-dir", str(tmp_path)])
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert rc == 2 and f"port {port}" in err and "in use" in err, err
    assert "Traceback" not in err


def test_every_serve_option_has_help():
    import argparse

    from mminfer.serve.cli import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    missing = [a.dest for a in p._actions if not a.help]
    assert missing == [], missing
