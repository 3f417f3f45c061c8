"""Live streams under ``mminfer serve --data-parallel 2`` on the CPU (two engine processes, the
tiny Qwen2.5-VL checkpoint): each stream is created on the least loaded engine and stays there
(pieces, questions in /v1/answer and chat, its status, its deletion all reach that engine); its
answers are those of one server on the same pieces; /metrics sums the engines' streams. A
pulled stream's source (a live MPEG-TS source on loopback) is read by its engine, its GET
grows as the pieces arrive (asked of the engine, not read from its periodic statuses), and
its deletion ends the read."""

import httpx
import pytest
from conftest import LiveServer, write_video
from test_live_pull import (NEEDLE, SlowSource, ask, assert_grew_as_one_server, follow,
                            pull, ts_bytes)

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.serve import live_ops
from mminfer.serve.app import Settings, create_app
from mminfer.serve.data_parallel import PEEKS_AT_ONCE, DataParallelWorker

Q = "What is shown?"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("dp") / "tiny-qwen")


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    d = tmp_path_factory.mktemp("pieces")
    return [write_video(d / f"p{i}.mp4", n_frames=4, fps=2.0, width=64, height=48)
            for i in range(2)]


def settings(ckpt, data, **kw) -> Settings:
    return Settings(model=str(ckpt), device="cpu", data_dir=str(data), queue_size=8,
                    timeout_s=300, api_key=None, shadow_rate=0.0, **kw)


def run(url, pieces) -> tuple[str, list[str]]:
    """A stream fed the pieces, asked after each: (its id, the answers)."""
    sid = httpx.post(f"{url}/v1/streams", json={"fps": 2}, timeout=120).json()["id"]
    answers = []
    for p in pieces:
        r = httpx.post(f"{url}/v1/streams/{sid}/segments", timeout=300,
                       files={"file": ("p.mp4", p.read_bytes(), "video/mp4")})
        assert r.status_code == 200, r.text
        a = httpx.post(f"{url}/v1/answer", timeout=300, data={
            "question": Q, "stream_id": sid, "max_new_tokens": "4"},
            files={"dummy": ("x.bin", b"", "application/octet-stream")})
        assert a.status_code == 200, a.text
        answers.append(a.json()["answer"])
    return sid, answers


def test_a_stream_stays_on_its_engine(ckpt, pieces, tmp_path):
    with LiveServer(create_app(settings(ckpt, tmp_path / "one"))) as one:
        _, want = run(one.url, pieces)

    s = settings(ckpt, tmp_path / "dp")
    worker = DataParallelWorker(s, str(ckpt), 2)
    with LiveServer(create_app(s, worker=worker)) as srv:
        assert worker.state == "ready", worker.error
        sid, got = run(srv.url, pieces)
        assert got == want
        other = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=120).json()["id"]
        # two streams on two engines (the second creation went to the one holding none)
        home = worker.streams[sid]
        assert {home, worker.streams[other]} == {0, 1}
        st = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
        assert st["engine"] == str(home) and st["frames"] == 8 and st["pieces"] == 2
        assert "tenant" not in st
        ids = sorted(x["id"] for x in httpx.get(f"{srv.url}/v1/streams").json()["data"])
        assert ids == sorted([sid, other])
        # chat about the stream: its engine answers, the same answer
        c = httpx.post(f"{srv.url}/v1/chat/completions", timeout=300, json={
            "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"mminfer://streams/{sid}"}},
                {"type": "text", "text": Q}]}]})
        assert c.status_code == 200, c.text
        assert c.json()["choices"][0]["message"]["content"] == want[-1]
        assert c.json()["mminfer"]["video"]["seen_until"] == 4.0
        # every call about it went to its engine: the other holds nothing of it
        routed = {e.index: e.routed["stream"] for e in worker.engines}
        assert routed[home] == 5 and routed[1 - home] == 0      # 2 pieces, 3 questions
        m = httpx.get(f"{srv.url}/metrics").text
        assert 'mminfer:streams_active{model_name=' in m
        assert [ln for ln in m.splitlines()
                if ln.startswith("mminfer:streams_active{")][0].endswith(" 2.0")
        assert httpx.delete(f"{srv.url}/v1/streams/{sid}").json()["deleted"] is True
        r = httpx.get(f"{srv.url}/v1/streams/{sid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
        assert sid not in worker.streams


def freeze_reports(worker) -> dict:
    """Hold the streams the engines' periodic statuses carry at what they are when this is
    called, until the returned dict is cleared: a GET that still grows reads its engine."""
    held = {e.index: (e.status or {}).get("streams") for e in worker.engines}
    real = worker._on_message

    def on_message(e, gen, msg):
        if msg[0] == "status" and held:
            msg = ("status", {**msg[1], "streams": held[e.index]})
        real(e, gen, msg)

    worker._on_message = on_message        # the engines' reader threads look it up per message
    return held


def test_a_pulled_stream_is_read_by_its_engine(ckpt, tmp_path):
    """One live source read by a stream on one server, then on the --data-parallel server; a
    second, longer one by another stream there, deleted while it is read."""
    data = ts_bytes(tmp_path)                   # needle_0: 20 frames, 10 s at 2 fps
    src = SlowSource(data, pieces=10, gap_s=0.3)
    long = SlowSource(data, pieces=40, gap_s=0.25)
    allowed = {"allowed_media_domains": ("127.0.0.1",)}
    refused = ("http://example.com/live.ts", str(NEEDLE))
    try:
        with LiveServer(create_app(settings(ckpt, tmp_path / "one", **allowed))) as one:
            ref = pull(one.url, src.url)
            want = follow(one.url, ref)[-1]
            want_answer = ask(one.url, ref).json()
            want_refusals = [httpx.post(f"{one.url}/v1/streams", json={"source": x},
                                        timeout=30) for x in refused]

        s = settings(ckpt, tmp_path / "dp", **allowed)
        worker = DataParallelWorker(s, str(ckpt), 2)
        with LiveServer(create_app(s, worker=worker)) as srv:
            assert worker.state == "ready", worker.error
            sid = pull(srv.url, src.url)
            home = worker.streams[sid]
            # the periodic statuses (every 0.5 s, about as often as a piece comes) would show
            # the stream growing too: held at its creation, its GET grows only by asking its
            # engine. A reader of the reports alone never sees the source end: 60 s is over
            # ten times what the read takes on a loaded 2-core machine.
            held = freeze_reports(worker)
            seen = follow(srv.url, sid, timeout=60)
            # past PEEKS_AT_ONCE statuses asked at once, the held reports answer
            with worker._lock:
                worker._peeks.update({-1 - k: (home, sid, None) for k in range(PEEKS_AT_ONCE)})
            stale = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
            with worker._lock:
                for k in range(PEEKS_AT_ONCE):
                    del worker._peeks[-1 - k]
            assert stale["frames"] < 20 and stale["source"]["state"] != "ended", stale
            assert httpx.get(f"{srv.url}/v1/streams/{sid}").json()["frames"] == 20
            held.clear()
            got_answer = ask(srv.url, sid).json()

            # deleted while it is read: its engine stops reading (the source sees the
            # connection closed before it sent everything)
            gone = pull(srv.url, long.url)
            assert {home, worker.streams[gone]} == {0, 1}
            st = follow(srv.url, gone, until=("reading",))[-1]
            assert st["engine"] == str(worker.streams[gone])
            assert httpx.delete(f"{srv.url}/v1/streams/{gone}").json()["deleted"] is True
            assert long.dropped.wait(15), "the engine still reads the deleted stream's source"
            assert httpx.get(f"{srv.url}/v1/streams/{gone}").status_code == 404
            assert httpx.delete(f"{srv.url}/v1/streams/{sid}").json()["deleted"] is True

            # sources the operator did not allow: refused by the front end as by one server
            for source, b in zip(refused, want_refusals):
                a = httpx.post(f"{srv.url}/v1/streams", json={"source": source}, timeout=30)
                assert (a.status_code, a.json()) == (b.status_code, b.json()), (a.text, b.text)
                assert a.json()["error"]["code"] in ("remote_media_refused", "forbidden")
            assert httpx.get(f"{srv.url}/v1/streams").json()["data"] == []
            assert getattr(worker.pipeline, live_ops.ATTR, None) is None   # pulls none itself
    finally:
        src.close()
        long.close()
    assert_grew_as_one_server(seen, want, str(home))
    # a question over it: the single server's answer over the same media
    assert got_answer["answer"] == want_answer["answer"], (got_answer, want_answer)
    assert got_answer["video"]["seen_until"] == want_answer["video"]["seen_until"] == 10.0
