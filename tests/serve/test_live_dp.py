"""Live streams under ``mminfer serve --data-parallel 2`` on the CPU (two engine processes, the
tiny Qwen2.5-VL checkpoint): each stream is created on the least loaded engine and stays there
(pieces, questions in /v1/answer and chat, its status, its deletion all reach that engine); its
answers are those of one server on the same pieces; /metrics sums the engines' streams."""

import httpx
import pytest
from conftest import LiveServer, write_video

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.serve.app import Settings, create_app
from mminfer.serve.data_parallel import DataParallelWorker

Q = "What is shown?"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("dp") / "tiny-qwen")


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    d = tmp_path_factory.mktemp("pieces")
    return [write_video(d / f"p{i}.mp4", n_frames=4, fps=2.0, width=64, height=48)
            for i in range(2)]


def settings(ckpt, data) -> Settings:
    return Settings(model=str(ckpt), device="cpu", data_dir=str(data), queue_size=8,
                    timeout_s=300, api_key=None, shadow_rate=0.0)


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
