"""Live streams under ``mminfer serve --ray`` (2 Ray Serve replicas on a local Ray cluster, on
the CPU, the tiny Qwen2.5-VL): each stream is created on the least loaded replica and every
later call about it (pieces, questions in /v1/answer and chat, its status, its deletion) goes
to that replica, with the answers of one server on the same pieces; a pulled stream's source
(a live MPEG-TS source on loopback) is read by its replica, its status grows at the front end
as the pieces arrive, and its deletion ends the read; a replica killed takes its streams, and
a call naming one is a 404 that says so while the other replica's streams go on."""

import json
import os
import signal
import threading
import time

import httpx
import pytest
from conftest import LiveServer, write_video
from test_live_pull import NEEDLE, SlowSource, assert_grew_as_one_server, follow, pull, \
    ts_bytes

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'mminfer[ray]')")
try:
    from ray import serve
except ImportError as e:   # ray without its serve extra
    pytest.skip(f"Ray Serve cannot be imported ({e}): pip install 'mminfer[ray]'",
                allow_module_level=True)

from lab.toy.tiny import save_tiny_qwen2_5_vl  # noqa: E402
from mminfer.serve import live_ops  # noqa: E402
from mminfer.serve.app import Settings, create_app  # noqa: E402
from mminfer.serve.ray_serve import RayServeWorker, routers  # noqa: E402

pytestmark = pytest.mark.slow

APP = "mminfer-live-test"
Q = "What is shown?"


@pytest.fixture(scope="module")
def cluster():
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as e:       # noqa: BLE001 - no cluster here: say why, do not fail
        pytest.skip(f"a local Ray cluster cannot start here: {type(e).__name__}: {e}")
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("ray-live") / "tiny-qwen")


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    d = tmp_path_factory.mktemp("pieces")
    return [write_video(d / f"p{i}.mp4", n_frames=4, fps=2.0, width=64, height=48)
            for i in range(2)]


def settings(ckpt, data) -> Settings:
    return Settings(model=str(ckpt), device="cpu", data_dir=str(data), queue_size=8,
                    timeout_s=300, api_key=None, shadow_rate=0.0, self_calibrate=False,
                    allowed_media_domains=("127.0.0.1",))


def run(url, pieces) -> tuple[str, list[str]]:
    """A stream fed the pieces, asked after each: (its id, the answers)."""
    r = httpx.post(f"{url}/v1/streams", json={"fps": 2}, timeout=120)
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    answers = []
    for p in pieces:
        r = httpx.post(f"{url}/v1/streams/{sid}/segments", timeout=300,
                       files={"file": ("p.mp4", p.read_bytes(), "video/mp4")})
        assert r.status_code == 200, r.text
        answers.append(ask(url, sid).json()["answer"])
    return sid, answers


def ask(url, sid):
    r = httpx.post(f"{url}/v1/answer", timeout=300, data={
        "question": Q, "stream_id": sid, "max_new_tokens": "4"},
        files={"dummy": ("x.bin", b"", "application/octet-stream")})
    assert r.status_code in (200, 404), r.text
    return r


@pytest.fixture(scope="module")
def one(ckpt, tmp_path_factory):
    """One server (no Ray) with the same model and settings."""
    with LiveServer(create_app(settings(ckpt, tmp_path_factory.mktemp("one")))) as server:
        yield server


@pytest.fixture(scope="module")
def want(one, pieces):
    """One server's answers on the same pieces."""
    return run(one.url, pieces)[1]


@pytest.fixture(scope="module")
def srv(cluster, ckpt, tmp_path_factory):
    s = settings(ckpt, tmp_path_factory.mktemp("data"))
    worker = RayServeWorker(s, str(ckpt), 2, address="auto", app=APP)
    with LiveServer(create_app(s, worker=worker)) as server:
        assert worker.state == "ready", worker.error
        server.worker = worker
        yield server


def test_a_stream_stays_on_its_replica(srv, pieces, want):
    worker = srv.worker
    sid, got = run(srv.url, pieces)
    assert got == want
    other = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=120).json()["id"]
    # two streams on two replicas (the second creation went to the one holding none)
    home = worker.streams[sid]
    replicas = {rid for rid, _, _ in routers()[APP].replicas()}
    assert {home, worker.streams[other]} == replicas
    st = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
    assert st["engine"] == home and st["frames"] == 8 and st["pieces"] == 2
    assert "tenant" not in st
    ids = sorted(x["id"] for x in httpx.get(f"{srv.url}/v1/streams").json()["data"])
    assert ids == sorted([sid, other])
    # chat about the stream: its replica answers, the same answer
    c = httpx.post(f"{srv.url}/v1/chat/completions", timeout=300, json={
        "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"mminfer://streams/{sid}"}},
            {"type": "text", "text": Q}]}]})
    assert c.status_code == 200, c.text
    assert c.json()["choices"][0]["message"]["content"] == want[-1]
    assert c.json()["mminfer"]["video"]["seen_until"] == 4.0
    # and streamed: the replica's tokens come through the front end as they are made
    body = {"max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": f"mminfer://streams/{sid}"}},
        {"type": "text", "text": Q}]}]}
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    pieces_ = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
               if json.loads(e).get("choices")]
    assert "".join(pieces_) == want[-1] and sum(map(bool, pieces_)) >= 2, events
    # every call about it went to its replica: the other got only its own creation
    routed = {e["engine"]: e["routed"] for e in worker.engines_health()}
    assert routed[home].get("stream", 0) == 6               # 2 pieces, 4 questions
    assert routed[worker.streams[other]].get("stream", 0) == 0
    m = httpx.get(f"{srv.url}/metrics").text
    assert [ln for ln in m.splitlines()
            if ln.startswith("mminfer:streams_active{")][0].endswith(" 2.0")
    rep = httpx.get(f"{srv.url}/v1/latency-report").json()["streams"]
    assert rep["stats"]["active"] == 2 and rep["stats"]["pieces"] == 2
    assert httpx.delete(f"{srv.url}/v1/streams/{sid}").json()["deleted"] is True
    r = httpx.get(f"{srv.url}/v1/streams/{sid}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    assert sid not in worker.streams
    assert httpx.delete(f"{srv.url}/v1/streams/{other}").json()["deleted"] is True


def test_a_pulled_stream_is_read_by_its_replica(srv, one, tmp_path):
    """One live source read by a stream on the Ray server and one on a single server; a
    second, longer one by another stream on the Ray server, deleted while it is read."""
    worker = srv.worker
    data = ts_bytes(tmp_path)                   # needle_0: 20 frames, 10 s at 2 fps
    src = SlowSource(data, pieces=10, gap_s=0.3)
    long = SlowSource(data, pieces=40, gap_s=0.25)
    try:
        sid, ref, gone = pull(srv.url, src.url), pull(one.url, src.url), pull(srv.url, long.url)
        # each on its own replica (the second creation went to the one holding none)
        assert {worker.streams[sid], worker.streams[gone]} == \
            {rid for rid, _, _ in routers()[APP].replicas()}
        seen = follow(srv.url, sid)
        want_ = follow(one.url, ref)[-1]
        # deleted while it is read: its replica stops reading (the source sees the
        # connection closed before it sent everything)
        st = follow(srv.url, gone, until=("reading",))[-1]
        assert st["engine"] == worker.streams[gone]
        assert httpx.delete(f"{srv.url}/v1/streams/{gone}").json()["deleted"] is True
        assert long.dropped.wait(15), "the replica still reads the deleted stream's source"
        assert httpx.get(f"{srv.url}/v1/streams/{gone}").status_code == 404
    finally:
        src.close()
        long.close()
    assert_grew_as_one_server(seen, want_, worker.streams[sid])
    assert getattr(worker.pipeline, live_ops.ATTR, None) is None    # the front end pulls none
    # a question over it: the single server's answer over the same media
    got, ref_answer = ask(srv.url, sid).json(), ask(one.url, ref).json()
    assert got["answer"] == ref_answer["answer"]
    assert got["video"]["seen_until"] == ref_answer["video"]["seen_until"] == 10.0
    for s_, id_ in ((srv, sid), (one, ref)):
        assert httpx.delete(f"{s_.url}/v1/streams/{id_}").json()["deleted"] is True
    # sources the operator did not allow: refused by the front end as by one server
    for source in ("http://example.com/live.ts", str(NEEDLE)):
        a, b = (httpx.post(f"{s_.url}/v1/streams", json={"source": source}, timeout=30)
                for s_ in (srv, one))
        assert (a.status_code, a.json()) == (b.status_code, b.json()), (a.text, b.text)
        assert a.json()["error"]["code"] in ("remote_media_refused", "forbidden"), a.text
    assert httpx.get(f"{srv.url}/v1/streams").json()["data"] == []


def test_a_killed_replica_takes_its_streams(srv, pieces):
    """A question about a stream is running on its replica when the replica's process is
    killed: the question is a 404 saying the stream is gone with its replica (it is never
    sent to a replica that does not hold the stream), as is every later call naming the
    stream; the other replica's stream goes on."""
    worker = srv.worker
    a, _ = run(srv.url, pieces[:1])
    b = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=120).json()["id"]
    victim = worker.streams[a]
    assert worker.streams[b] != victim
    pid = next(st["pid"] for rid, st, _ in routers()[APP].replicas() if rid == victim)
    out = {}

    def long_question():
        out["r"] = httpx.post(f"{srv.url}/v1/answer", timeout=300, data={
            "question": "tell me everything", "stream_id": a, "max_new_tokens": "2048"},
            files={"dummy": ("x.bin", b"", "application/octet-stream")})

    t = threading.Thread(target=long_question)
    t.start()
    deadline = time.monotonic() + 60
    try:
        while next(e["running"] for e in worker.engines_health() if e["engine"] == victim) < 1:
            assert time.monotonic() < deadline and t.is_alive(), out
            time.sleep(0.01)
    finally:
        os.kill(pid, signal.SIGKILL)
    t.join(300)
    r = out["r"]
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "stream_not_found" and err["stream"] == a, err
    assert f"is gone: its replica {victim} stopped" in err["message"], err
    for call in (lambda: httpx.get(f"{srv.url}/v1/streams/{a}"), lambda: ask(srv.url, a),
                 lambda: httpx.delete(f"{srv.url}/v1/streams/{a}")):
        r = call()
        assert r.status_code == 404 and f"replica {victim} stopped" in r.text, r.text
    assert a not in worker.streams
    # the other replica's stream goes on
    r = httpx.post(f"{srv.url}/v1/streams/{b}/segments", timeout=300,
                   files={"file": ("p.mp4", pieces[0].read_bytes(), "video/mp4")})
    assert r.status_code == 200, r.text
    assert ask(srv.url, b).status_code == 200
    assert [x["id"] for x in httpx.get(f"{srv.url}/v1/streams").json()["data"]] == [b]
    h = httpx.get(f"{srv.url}/health").json()
    assert h["status"] == "ok" and h["queue"] == h["running"] == 0
