"""``mminfer serve --ray``: the engine as 2 Ray Serve replicas on a local Ray cluster (this
machine alone), on the CPU, behind the ordinary front end on loopback. Every follow-up about
a video lands on the replica that holds its prefix (round robin's hits measured beside it), a
video's bytes reach a replica once, a stored video follows its content, and a replica killed
mid-request loses no request: the one not yet streaming is answered by the other replica, the
streaming one gets a 503 ``engine_restarted`` event.

One cluster and one deployment for the module (Ray's start and the replicas' model loads are
the slow part); the kill test runs last. The checkpoint is the tiny random Qwen2.5-VL of
test_data_parallel.py: its answers run as long as asked, so a request is still running when
its replica is killed.
"""

import argparse
import asyncio
import base64
import hashlib
import json
import os
import signal
import threading
import time

import httpx
import pytest
from conftest import LiveServer, write_video

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'mminfer[ray]')")
try:
    from ray import serve
except ImportError as e:   # ray without its serve extra
    pytest.skip(f"Ray Serve cannot be imported ({e}): pip install 'mminfer[ray]'",
                allow_module_level=True)

from lab.toy.tiny import save_tiny_qwen2_5_vl  # noqa: E402
from mminfer.errors import ConfigError  # noqa: E402
from mminfer.serve import cli as serve_cli  # noqa: E402
from mminfer.serve import ray_serve  # noqa: E402
from mminfer.serve.app import Settings, create_app  # noqa: E402
from mminfer.serve.ray_serve import RayServeWorker, routers  # noqa: E402

pytestmark = pytest.mark.slow

APP = "mminfer-test"
LONG = 4096       # answer tokens: a request runs for seconds on the CPU


def test_cli_flags_build_the_worker(tmp_path):
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--ray", "auto", "--ray-replicas", "3",
                         "--dp-routing", "round_robin", "--affinity-max-imbalance", "2",
                         "--data-dir", str(tmp_path)])
    s = serve_cli.settings_from(args)
    w = serve_cli.ray_serve_worker(s, args, RayServeWorker)
    assert (w.n, w.address, w.routing, w.max_imbalance) == (3, "auto", "round_robin", 2)
    assert w.queue_size == 3 * s.queue_size and s.shadow_rate == 0 and not s.self_calibrate
    assert w.state == "new"            # nothing joins a cluster until the server starts it
    with pytest.raises(ConfigError, match="--ray-replicas"):
        RayServeWorker(s, "m", 0)
    args.data_parallel = 2
    with pytest.raises(ConfigError, match="leave out"):
        serve_cli.run(args)


def test_stream_statuses_asked_of_replicas_at_once_are_bounded(tmp_path):
    """A stream's GET asks its replica from a thread of the event loop's executor (shared
    with other clients' JSON bodies) for up to PEEK_TIMEOUT_S: past PEEKS_AT_ONCE asked at
    once, one answers from the reports (None) without taking a thread or waiting. The Ray
    transport is stood in for by a call that blocks until released (no cluster needed: the
    bound is the front end's)."""
    release, asked = threading.Event(), []

    class Call:
        def result(self, timeout_s=None):
            asked.append(timeout_s)
            release.wait(10)
            return {"frames": 4}

    class Method:
        def remote(self, req, tenant):
            assert req["peek"] and req["pin"] == "r1"
            return Call()

    class Handle:
        stream_status = Method()

    s = Settings(device="cpu", data_dir=tmp_path)
    w = RayServeWorker(s, "m", 2)
    w.unary_handle, w.streams["s1"] = Handle(), "r1"

    async def main():
        held = [asyncio.create_task(w.stream_status("s1", None))
                for _ in range(ray_serve.PEEKS_AT_ONCE)]
        while len(asked) < ray_serve.PEEKS_AT_ONCE:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        extra = await w.stream_status("s1", None)
        waited = time.monotonic() - t0
        release.set()
        got = await asyncio.gather(*held)
        again = await w.stream_status("s1", None)      # the slots were given back
        return extra, waited, got, again

    extra, waited, got, again = asyncio.run(main())
    assert extra is None and waited < 1.0          # 1 s: far below the 10 s a slot would hold
    assert got == [{"frames": 4, "engine": "r1"}] * ray_serve.PEEKS_AT_ONCE
    assert again == {"frames": 4, "engine": "r1"}
    assert asked == [ray_serve.PEEK_TIMEOUT_S] * (ray_serve.PEEKS_AT_ONCE + 1)


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
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return [write_video(d / f"v{i}.mp4", n_frames=20 + i, width=64, height=48).read_bytes()
            for i in range(6)]


@pytest.fixture(scope="module")
def srv(cluster, tmp_path_factory):
    ckpt = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("ray") / "tiny-qwen")
    s = Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path_factory.mktemp("data")),
                 queue_size=8, timeout_s=300, api_key=None, shadow_rate=0.0,
                 self_calibrate=False, max_question_tokens=64)
    worker = RayServeWorker(s, str(ckpt), 2, address="auto", app=APP)
    with LiveServer(create_app(s, worker=worker)) as server:
        assert worker.state == "ready", worker.error
        server.worker = worker
        yield server


def ask(url, video: bytes, question="What number appears?", **fields):
    return httpx.post(f"{url}/v1/answer", timeout=300,
                      files={"video": ("clip.mp4", video, "video/mp4")},
                      data={"question": question, **{k: str(v) for k, v in fields.items()}})


def hits_of(url, workload) -> list[str]:
    out = []
    for i, v in enumerate(workload):
        r = ask(url, v, f"question {i}?", max_new_tokens=4)
        assert r.status_code == 200, r.text
        out.append(r.json()["cache"])
    return out


def holders(video: bytes, timeout: float = 10.0) -> list[str]:
    """The replicas whose cache reports the video (reports come every second)."""
    sha = hashlib.sha256(video).hexdigest()
    deadline = time.monotonic() + timeout
    while True:
        found = [rid for rid, st, _ in routers()[APP].replicas() if sha in st.get("videos", ())]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_every_follow_up_lands_on_the_replica_that_holds_its_video(srv, videos):
    a, b, c, d = videos[:4]
    affinity = hits_of(srv.url, [a, a, a, b, b, b])
    # one engine gets these hits on the same questions: each video's first is its only miss
    assert affinity == ["miss", "hit", "hit", "miss", "hit", "hit"]
    [ha], [hb] = holders(a), holders(b)
    assert ha != hb                         # the second new video went to the idle replica
    rows = srv.worker.engines_health()
    assert sum(r["routed"].get("affinity", 0) for r in rows) == 4
    assert sum(r["routed"].get("new", 0) for r in rows) == 2
    # the bytes went to each video's replica once (a follow-up moved none)
    assert sum(r["videos_fetched"] or 0 for r in rows) == 2
    # round robin on fresh videos, measured beside it
    router = routers()[APP]
    router.mode = "round_robin"
    try:
        rr = hits_of(srv.url, [c, c, c, d, d, d])
    finally:
        router.mode = "affinity"
    print(f"\nfollow-up hits, 2 Ray Serve replicas: affinity {affinity.count('hit')}/4, "
          f"round robin {rr.count('hit')}/4")
    assert rr.count("hit") < affinity.count("hit")


def test_a_stored_video_follows_its_content_to_its_replica(srv, videos):
    v = videos[4]
    assert ask(srv.url, v, max_new_tokens=4).json()["cache"] == "miss"
    [replica] = holders(v)
    up = httpx.post(f"{srv.url}/v1/videos", files={"file": ("v.mp4", v, "video/mp4")},
                    timeout=60)
    assert up.status_code == 200, up.text
    r = httpx.post(f"{srv.url}/v1/answer", timeout=300,
                   files={"dummy": ("x.bin", b"", "application/octet-stream")},
                   data={"video_id": up.json()["id"], "question": "and now?",
                         "max_new_tokens": "4"})
    assert r.status_code == 200 and r.json()["cache"] == "hit", r.text
    assert holders(v) == [replica]


def test_health_shows_every_replica(srv):
    h = httpx.get(f"{srv.url}/health").json()
    assert h["status"] == "ok" and h["queue_size"] == 16
    assert len(h["engines"]) == 2
    # each replica names the node it runs on: this machine's, the cluster's only one
    assert {e["node"] for e in h["engines"]} == {n["NodeManagerAddress"] for n in ray.nodes()}
    assert all(e["pid"] and e["served"] is not None for e in h["engines"]), h["engines"]
    text = httpx.get(f"{srv.url}/metrics").text
    assert text.count("mminfer:engine_up{") == 2


def _stream_chat(url, video: bytes, events: list, first: threading.Event):
    body = {"stream": True, "max_tokens": LONG, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {
            "url": "data:video/mp4;base64," + base64.b64encode(video).decode()}},
        {"type": "text", "text": "tell me everything"}]}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        events.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) >= 3:         # the role chunk, then a piece of the answer
                    first.set()
    first.set()


def test_killing_a_replica_mid_request_loses_no_request(srv, videos):
    """Two answers about one video run on its replica, one streaming, one not yet answered
    (nothing streamed), when the replica's process is killed: the second is sent once more,
    to the other replica, and answered there; the stream ends with a 503
    ``engine_restarted`` event."""
    v = videos[5]
    assert ask(srv.url, v, max_new_tokens=4).status_code == 200
    [victim] = holders(v)
    pid = next(st["pid"] for rid, st, _ in routers()[APP].replicas() if rid == victim)
    events, first = [], threading.Event()
    t2 = threading.Thread(target=_stream_chat, args=(srv.url, v, events, first))
    t2.start()
    assert first.wait(120), events
    answer = {}

    def second():
        answer["r"] = ask(srv.url, v, "and in short?", max_new_tokens=256)

    t1 = threading.Thread(target=second)
    t1.start()
    deadline = time.monotonic() + 60
    try:
        while next(e["running"] for e in srv.worker.engines_health() if e["engine"] == victim) < 2:
            assert time.monotonic() < deadline and t1.is_alive(), (answer, events)
            time.sleep(0.01)
    finally:
        os.kill(pid, signal.SIGKILL)
    t1.join(300)
    t2.join(300)
    r = answer["r"]
    assert r.status_code == 200, r.text           # sent once more, to the other replica
    assert r.json()["cache"] == "miss"
    assert srv.worker.moved == 1
    assert victim not in holders(v)
    assert events[0] == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert (err["code"], err["status"]) == ("engine_restarted", 503)
    h = httpx.get(f"{srv.url}/health").json()
    assert h["status"] == "ok" and h["queue"] == h["running"] == 0
    assert os.listdir(srv.app.state.upload_dir) == []      # no upload left behind
