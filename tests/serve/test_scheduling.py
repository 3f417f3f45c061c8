"""Many users at once, on a real server with the embedded model (CPU, Triton interpreter): a
cache hit passes someone else's long sparse prefill, the prefill's answer is the one it gives
alone, answers decoding at the same time decode together with their own tokens, and a
shutdown answers requests paused or decoding with JSON 503.

Order and counts are asserted, never absolute times (the machine may be busy)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mminfer.serve.app import Settings, create_app

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "videos"
NEEDLE, LONG = SAMPLES / "needle_0.mp4", SAMPLES / "needle_long.mp4"
QUESTION = "What number appears in the video?"


def ask(url, clip: Path, question=QUESTION, **data):
    r = httpx.post(f"{url}/v1/answer", timeout=900, data={"question": question, **{
        k: str(v) for k, v in data.items()}},
                   files={"video": (clip.name, clip.read_bytes(), "video/mp4")})
    return r


def wait_until(cond, timeout=120.0, step=0.05):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(step)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import LiveServer
    app = create_app(Settings(device="cpu", api_key=None, shadow_rate=0.0,
                              data_dir=str(tmp_path_factory.mktemp("data")), timeout_s=900))
    with LiveServer(app) as s:
        assert app.state.worker.wait_ready(120)
        yield s


@pytest.mark.slow
def test_a_cache_hit_passes_a_long_sparse_prefill(server):
    url, w = server.url, server.app.state.worker
    first = ask(url, NEEDLE, max_new_tokens=4)
    assert first.status_code == 200 and first.json()["cache"] == "miss"
    # the long request alone (frames capped so the interpreter's prefill takes seconds, not
    # minutes); then the same prefill again — another key (max_frames), the same frames —
    # while a hit comes in
    long_args = dict(attention="sparse", max_frames=24, max_new_tokens=4)
    alone = ask(url, LONG, **long_args)
    assert alone.status_code == 200, alone.text
    alone = alone.json()
    assert alone["attention"] == "sparse" and alone["video"]["frames"] == 24

    done = {}

    def long_request():
        r = ask(url, LONG, **{**long_args, "max_frames": 25})
        done["long"] = (time.monotonic(), r)

    th = threading.Thread(target=long_request)
    th.start()
    # it is building its prefix: the prefill is admitted
    wait_until(lambda: w.progress()["prefilling"] == 1)
    wait_until(lambda: server.app.state.worker.active_jobs()[0].turn.kind == "long")
    time.sleep(0.5)
    hit = ask(url, NEEDLE, max_new_tokens=4)
    hit_done = time.monotonic()
    th.join(900)
    assert hit.status_code == 200 and hit.json()["cache"] == "hit"
    assert hit.json()["answer"] == first.json()["answer"]
    t_long, long = done["long"]
    assert long.status_code == 200, long.text
    assert hit_done < t_long, "the hit waited for the whole prefill"
    long = long.json()
    # the paused prefill's answer is the one it gives alone, computed the same
    assert long["video"]["frames"] == 24 and long["cache"] == "miss"
    assert long["answer"] == alone["answer"]
    assert long["tokens"] == alone["tokens"]
    assert long["sparsity"]["mean_density"] == alone["sparsity"]["mean_density"]
    # it waited for the hit, and said so as a stage of its own
    assert long["timings_ms"]["wait"] > 0
    assert w.scheduler.switches > 0
    # the stages before generate still add up to the time to first token
    t = long["timings_ms"]
    before = sum(v for k, v in t.items() if k not in ("generate", "density", "ttft", "total"))
    assert before == pytest.approx(t["ttft"], rel=0.1, abs=50)


def test_answers_decoding_together_keep_their_own_tokens(server):
    url, w = server.url, server.app.state.worker
    clips = [SAMPLES / f"{n}.mp4" for n in ("needle_1", "needle_2", "colour_0", "count_0")]
    questions = [QUESTION, QUESTION, "What color is the ball?", "How many red flashes are there?"]
    alone = []
    for clip, q in zip(clips, questions):       # one by one: misses, each decoding alone
        r = ask(url, clip, q, max_new_tokens=8)
        assert r.status_code == 200, r.text
        alone.append(r.json()["answer"])
    batches, steps = w.scheduler.batches, w.scheduler.batched_steps
    out = [None] * 4

    def go(i):
        out[i] = ask(url, clips[i], questions[i], max_new_tokens=8)

    # the model is held while the four arrive (a busy machine may not overlap them on its
    # own): then their questions' rows run first, and all four decode together
    hold = w.scheduler.turn("test")
    assert hold.acquire()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    try:
        for th in threads:
            th.start()
        wait_until(lambda: w.running == 4, timeout=120)
        time.sleep(0.2)                 # each past its upload, waiting for the turn
    finally:
        hold.close()
    for th in threads:
        th.join(300)
    assert [r.status_code for r in out] == [200] * 4
    assert [r.json()["cache"] for r in out] == ["hit"] * 4
    assert [r.json()["answer"] for r in out] == alone
    # their steps went through the scheduler's batches, several answers in some of them
    assert w.scheduler.batched_steps - steps > w.scheduler.batches - batches
    m = httpx.get(f"{url}/metrics").text
    assert "mminfer:num_requests_decoding" in m and "mminfer:request_wait_time_seconds" in m
    # the batch counts: more answers' steps than batches (several answers in some)
    got = {f.name: f.samples[0].value for f in text_string_to_metric_families(m)
           if f.name in ("mminfer:decode_batches", "mminfer:decode_batched_steps")}
    assert got["mminfer:decode_batched_steps"] > got["mminfer:decode_batches"] > 0
    h = httpx.get(f"{url}/health").json()
    assert {"prefilling", "paused", "decoding", "max_active"} <= set(h)
    now = httpx.get(f"{url}/v1/latency-report").json()["now"]
    assert now == {"queued": 0, "running": 0, "prefilling": 0, "waiting_admission": 0,
                   "paused": 0, "decoding": 0}
    page = httpx.get(f"{url}/report").text
    assert 'id="now"' in page and "paused for short work" in page


def test_an_answered_videos_cache_goes_with_its_entry_not_with_a_garbage_collection(server):
    """Once a request is answered, only the video cache holds its prefix: dropping the entry
    frees the KV at once. Nothing of the request (its turn, the last decode step's item, a
    job in a reference cycle) may keep it until a full garbage collection, which a server
    with a frozen heap runs rarely: on an H100 eight dropped 115K-token caches (52 GB) were
    still held that way when a new video's prefill ran out of memory."""
    import gc
    import weakref

    url = server.url
    cache = server.app.state.worker.pipeline.video_cache
    r = ask(url, SAMPLES / "order_1.mp4", "In which order do the shapes appear?",
            max_new_tokens=4, max_frames=9)
    assert r.status_code == 200 and r.json()["cache"] == "miss", r.text
    gc.disable()
    try:
        with cache._lock:
            held = [(k, e) for k, e in cache._entries.items() if e.kv is not None]
            refs = [weakref.ref(e.kv) for _, e in held]
            for k, e in held:
                cache._drop(k, e)
            del held
        assert refs and all(ref() is None for ref in refs), \
            "a dropped entry's KV outlived it (held by a reference cycle)"
    finally:
        gc.enable()


def test_questions_about_one_cached_video_decode_together(server):
    """Three questions about one cached video at once: each forks the video's entry (the
    prefix shared and read only, its own rows apart), so none waits for another's answer:
    they decode in the same batched steps, each answer the one it gets asked alone."""
    url, w = server.url, server.app.state.worker
    clip = SAMPLES / "order_1.mp4"           # a video no other test here asks about
    questions = [QUESTION, "What color is the ball?", "How many red flashes are there?"]
    alone = []
    for q in questions:                       # one by one: a miss, then hits
        r = ask(url, clip, q, max_new_tokens=6)
        assert r.status_code == 200, r.text
        alone.append(r.json())
    assert [a["cache"] for a in alone] == ["miss", "hit", "hit"]
    cache = w.pipeline.video_cache.stats()
    batches, steps = w.scheduler.batches, w.scheduler.batched_steps
    out = [None] * 3

    def go(i):
        out[i] = ask(url, clip, questions[i], max_new_tokens=6)

    hold = w.scheduler.turn("test")
    assert hold.acquire()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    try:
        for th in threads:
            th.start()
        wait_until(lambda: w.running == 3, timeout=120)
        time.sleep(0.2)
    finally:
        hold.close()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads)
    assert [r.status_code for r in out] == [200] * 3
    assert [r.json()["cache"] for r in out] == ["hit"] * 3
    assert [r.json()["answer"] for r in out] == [a["answer"] for a in alone]
    assert [r.json()["tokens"]["generated"] for r in out] == \
        [a["tokens"]["generated"] for a in alone]
    # one entry, read by the three at once: their steps shared batches
    assert w.scheduler.batched_steps - steps > w.scheduler.batches - batches
    now = w.pipeline.video_cache.stats()
    assert now["hits"] - cache["hits"] == 3 and now["misses"] == cache["misses"]
    assert now["gpu_bytes"] == cache["gpu_bytes"]      # the questions' rows were their own


def test_shutdown_answers_a_paused_prefill_and_a_hit_with_json_503(tmp_path, live_server):
    app = create_app(Settings(device="cpu", api_key=None, shadow_rate=0.0,
                              data_dir=str(tmp_path), timeout_s=600))
    s = live_server(app)
    w = app.state.worker
    assert w.wait_ready(120)
    assert ask(s.url, NEEDLE, max_new_tokens=2).status_code == 200
    out = {}

    def long_request():
        out["long"] = ask(s.url, LONG, attention="sparse", max_frames=24, max_new_tokens=2)

    th = threading.Thread(target=long_request)
    th.start()
    wait_until(lambda: w.progress()["prefilling"] == 1)
    wait_until(lambda: w.active_jobs() and w.active_jobs()[0].turn is not None
               and w.active_jobs()[0].turn.kind == "long")
    w.begin_shutdown()
    th.join(120)
    r = out["long"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    wait_until(lambda: w.running == 0, timeout=30)
    # nothing is admitted any more and nothing holds the model
    assert w.progress()["active"] == 0
