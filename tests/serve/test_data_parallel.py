"""``mminfer serve --data-parallel 2`` on the CPU: two engine processes (the tiny Qwen2.5-VL
checkpoint) behind one front end on loopback. Every follow-up about a video lands on the
engine that holds its prefix (the hit count of one engine on the same questions; round robin's
measured beside it), budgets and stored videos work as on one server, /health and /metrics
show each engine, a client that leaves stops its job inside the engine, and an engine killed
mid-request loses no request: the one not yet streaming is answered by the other engine, the
streaming one gets a 503 ``engine_restarted`` event, and the engine comes back.

The engines start once for the module (each loads the model in its own process: the longest
part of this file); the kill test runs last, on the same server.
"""

import argparse
import hashlib
import json
import os
import signal
import threading
import time

import httpx
import pytest
from conftest import LiveServer, write_video

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.errors import ConfigError
from mminfer.serve import cli as serve_cli
from mminfer.serve.app import Settings, create_app
from mminfer.serve.data_parallel import DataParallelWorker, Router

LONG = 4096       # answer tokens: a request runs for seconds on the CPU


# ----------------------------------------------------------------------- the router alone

def test_router_follows_the_video_until_its_engine_is_too_busy():
    r = Router(2, "affinity", max_imbalance=2)
    assert r.choose("a", [0, 0], [0, 1]) == (0, "new")     # a tie: the lowest index
    r.sent(0, "a")                                        # on its way to engine 0
    assert r.choose("a", [1, 0], [0, 1]) == (0, "affinity")
    assert r.choose("b", [1, 0], [0, 1]) == (1, "new")    # a new video: the least loaded
    r.finished(0, "a")
    r.reported(0, {"a"})                                  # engine 0 says it keeps it
    assert r.choose("a", [2, 0], [0, 1]) == (0, "affinity")
    assert r.choose("a", [3, 0], [0, 1]) == (1, "overflow")   # 3 beyond the idlest > 2
    assert r.choose("a", [0, 0], [1]) == (1, "new")       # its engine is down
    r.reported(1, {"a"})
    assert r.choose("a", [5, 1], [0, 1]) == (1, "affinity")   # the least loaded holder
    r.forget(1)
    assert r.choose("a", [0, 0], [0, 1]) == (0, "affinity")
    assert r.choose(None, [1, 0], [0, 1]) == (1, "new")
    assert r.choose("a", [0, 0], []) is None


def test_round_robin_ignores_the_cache():
    r = Router(3, "round_robin")
    r.reported(0, {"a"})
    assert [r.choose("a", [0, 0, 0], [0, 1, 2])[0] for _ in range(4)] == [0, 1, 2, 0]
    assert r.choose("a", [0, 0, 0], [0, 2]) == (2, "round_robin")   # 1 is down: skipped
    with pytest.raises(ConfigError):
        Router(2, "random")


def test_cli_flags_build_the_worker(tmp_path):
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--data-parallel", "2", "--dp-routing",
                         "round_robin", "--affinity-max-imbalance", "3",
                         "--data-dir", str(tmp_path)])
    s = serve_cli.settings_from(args)
    w = serve_cli.data_parallel_worker(s, args, DataParallelWorker)
    assert (w.n, w.router.mode, w.router.max_imbalance) == (2, "round_robin", 3)
    assert w.queue_size == 2 * s.queue_size and s.shadow_rate == 0 and not s.self_calibrate
    assert w.state == "new"          # nothing started until the server starts it
    with pytest.raises(ConfigError, match="one GPU of its own"):
        DataParallelWorker(Settings(device="cuda:1"), "m", 2)


# ----------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("dp") / "tiny-qwen")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Distinct small clips (different bytes: different cache keys)."""
    d = tmp_path_factory.mktemp("clips")
    return [write_video(d / f"v{i}.mp4", n_frames=20 + i, width=64, height=48).read_bytes()
            for i in range(8)]


def settings(ckpt, data) -> Settings:
    return Settings(model=str(ckpt), device="cpu", data_dir=str(data), queue_size=8,
                    timeout_s=300, api_key=None, shadow_rate=0.0, max_question_tokens=64)


@pytest.fixture(scope="module")
def dp(ckpt, tmp_path_factory):
    s = settings(ckpt, tmp_path_factory.mktemp("dpdata"))
    worker = DataParallelWorker(s, str(ckpt), 2)
    with LiveServer(create_app(s, worker=worker)) as srv:
        assert worker.state == "ready", worker.error
        srv.worker = worker
        yield srv


def ask(url, video: bytes, question="What number appears?", **fields):
    r = httpx.post(f"{url}/v1/answer", timeout=300,
                   files={"video": ("clip.mp4", video, "video/mp4")},
                   data={"question": question, **{k: str(v) for k, v in fields.items()}})
    return r


def hits_of(url, workload) -> list[str]:
    out = []
    for i, v in enumerate(workload):
        r = ask(url, v, f"question {i}?")
        assert r.status_code == 200, r.text
        out.append(r.json()["cache"])
    return out


def holders(worker, video: bytes) -> list[int]:
    """The engines whose cache reports the video."""
    sha = hashlib.sha256(video).hexdigest()
    return [e for e in range(worker.n) if sha in worker.router.held[e]]


def test_every_follow_up_lands_on_the_engine_that_holds_its_video(dp, ckpt, videos, tmp_path):
    a, b, c, d = videos[:4]
    # one engine (the ordinary server) on the same questions: the baseline hit count
    s = settings(ckpt, tmp_path / "one")
    with LiveServer(create_app(s)) as one:
        baseline = hits_of(one.url, [a, a, a, b, b, b])
    assert baseline.count("hit") == 4
    assert hits_of(dp.url, [a, a, a, b, b, b]) == baseline
    w = dp.worker
    # each video is held by exactly one engine, and the two videos went to different ones
    assert [len(holders(w, v)) for v in (a, b)] == [1, 1]
    assert holders(w, a) != holders(w, b)
    routed = [e["routed"] for e in w.engines_health()]
    assert sum(r.get("affinity", 0) for r in routed) == 4
    assert sum(r.get("new", 0) for r in routed) == 2
    # round robin on fresh videos: follow-ups land where the prefix is not
    w.router.mode = "round_robin"
    try:
        rr = hits_of(dp.url, [c, c, c, d, d, d])
    finally:
        w.router.mode = "affinity"
    assert rr.count("hit") < baseline.count("hit")
    assert rr.count("hit") == 2


def test_a_burst_about_a_new_video_goes_to_one_engine(dp, videos):
    v = videos[4]
    out = [None] * 3

    def one(i):
        out[i] = ask(dp.url, v, f"burst {i}?")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in out] == [200] * 3
    assert len(holders(dp.worker, v)) == 1
    # the engine built the prefix once; the other two read it
    assert sorted(r.json()["cache"] for r in out) == ["hit", "hit", "miss"]


def test_a_stored_video_follows_its_content_to_its_engine(dp, videos):
    v = videos[5]
    assert ask(dp.url, v).json()["cache"] == "miss"
    [engine] = holders(dp.worker, v)
    up = httpx.post(f"{dp.url}/v1/videos", files={"file": ("v.mp4", v, "video/mp4")},
                    timeout=60)
    assert up.status_code == 200, up.text
    r = httpx.post(f"{dp.url}/v1/answer", timeout=300,
                   files={"dummy": ("x.bin", b"", "application/octet-stream")},
                   data={"video_id": up.json()["id"], "question": "and now?"})
    assert r.status_code == 200 and r.json()["cache"] == "hit"
    assert holders(dp.worker, v) == [engine]


def test_budgets_are_checked_in_the_front_end(dp, videos):
    # the question's tokens are counted with the engines' tokenizer, before any engine runs
    r = ask(dp.url, videos[0], "word " * 200)
    assert r.status_code == 413 and r.json()["error"]["field"] == "question"


def test_health_and_metrics_show_every_engine(dp):
    h = httpx.get(f"{dp.url}/health").json()
    assert h["status"] == "ok"
    assert [e["engine"] for e in h["engines"]] == ["0", "1"]
    assert all(e["state"] == "ready" and e["pid"] for e in h["engines"])
    assert h["queue_size"] == 16
    text = httpx.get(f"{dp.url}/metrics").text

    def series(name):
        return {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith(name + "{")}

    up = series("mminfer:engine_up")
    assert sorted(up.values()) == [1.0, 1.0] and all('engine="' in k for k in up)
    per_engine = sum(series("mminfer:engine_prefix_cache_queries_total").values())
    [total] = series("mminfer:prefix_cache_queries_total").values()
    assert per_engine == total > 0


def test_a_client_that_leaves_stops_its_job_in_the_engine(dp, videos):
    w = dp.worker
    v = videos[6]
    assert ask(dp.url, v).status_code == 200
    stopped_before = sum(e.status.get("stopped", 0) for e in w.engines)
    with pytest.raises(httpx.ReadTimeout):
        ask_t = httpx.post(f"{dp.url}/v1/answer", timeout=httpx.Timeout(300, read=1.0),
                           files={"video": ("clip.mp4", v, "video/mp4")},
                           data={"question": "long?", "max_new_tokens": str(LONG)})
        del ask_t
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sum(e.status.get("stopped", 0) for e in w.engines) > stopped_before \
                and w.running == 0 and w.waiting == 0:
            break
        time.sleep(0.1)
    assert sum(e.status.get("stopped", 0) for e in w.engines) == stopped_before + 1
    assert w.running == 0 and w.waiting == 0


def _stream_chat(url, video: bytes, events: list, first: threading.Event):
    import base64
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


def test_killing_an_engine_mid_request_loses_no_request(dp, videos):
    """A streamed answer is frozen mid-answer (SIGSTOP: nothing more comes from its engine,
    deterministically), a second question about the same video is sent to that engine
    behind it, then the engine is killed: the question that had streamed nothing is
    answered by the other engine, the stream ends with a 503 ``engine_restarted`` event."""
    w = dp.worker
    v = videos[7]
    assert ask(dp.url, v).status_code == 200
    [victim] = holders(w, v)
    events, first = [], threading.Event()
    t2 = threading.Thread(target=_stream_chat, args=(dp.url, v, events, first))
    t2.start()
    assert first.wait(120)
    pid = w.engines[victim].pid
    os.kill(pid, signal.SIGSTOP)          # mid-answer: LONG tokens take seconds
    try:
        answer = {}

        def second():
            answer["r"] = ask(dp.url, v, "and in short?", max_new_tokens=8)

        t1 = threading.Thread(target=second)
        t1.start()
        deadline = time.monotonic() + 60
        while len(w.engines[victim].flights) < 2:      # sent to the frozen engine
            assert time.monotonic() < deadline and t1.is_alive(), (answer, events)
            time.sleep(0.01)
        row = w.engines_health()[victim]
        assert (row["running"], row["queue"]) == (1, 1) and t2.is_alive(), (row, events)
    finally:
        os.kill(pid, signal.SIGKILL)
    t1.join(300)
    t2.join(300)
    # the request that had streamed nothing was answered by the other engine
    r = answer["r"]
    assert r.status_code == 200, r.text
    assert r.json()["cache"] == "miss" and r.json()["tokens"]["generated"] > 0
    assert holders(w, v) == [1 - victim]
    # the streaming one ends with a clear error event, then [DONE]
    assert events[0] == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert (err["code"], err["status"]) == ("engine_restarted", 503)
    # the engine comes back, and the next request is served
    deadline = time.monotonic() + 240
    while not (w.engines[victim].state == "ready" and w.engines[victim].restarts == 1):
        assert time.monotonic() < deadline, w.engines_health()
        time.sleep(0.2)
    assert w.engines[victim].pid != pid
    assert ask(dp.url, v, "still there?").status_code == 200
    h = httpx.get(f"{dp.url}/health").json()
    assert h["status"] == "ok" and h["engines"][victim]["restarts"] == 1
    assert h["queue"] == h["running"] == 0
    assert os.listdir(dp.app.state.upload_dir) == []      # no upload left behind
    text = httpx.get(f"{dp.url}/metrics").text
    assert f'mminfer:engine_restarts_total{{engine="{victim}",model_name="tiny-qwen"}} 1.0' \
        in text


def test_every_video_cache_counter_is_carried_over_an_engine_restart():
    """An engine that dies takes its video cache's counts with it; the front end carries
    every counter (CACHE_COUNTERS) into the sums /metrics exports, so none goes back down
    (a Prometheus counter that drops reads as a reset). A counter the cache adds must be
    carried too."""
    from mminfer.engine.cache import VideoCache
    from mminfer.serve.data_parallel import CACHE_COUNTERS, EngineHandle
    assert set(VideoCache("cpu").counts) <= set(CACHE_COUNTERS)
    e = EngineHandle(0, None)
    e.carried.update({"spilled_bytes": 100, "spill_seconds": 1.5})
    e.status = {"cache": {"spilled_bytes": 50, "spill_seconds": 0.25, "gpu_bytes": 7}}
    got = e.cache_stats()
    assert (got["spilled_bytes"], got["spill_seconds"], got["gpu_bytes"]) == (150, 1.75, 7)
