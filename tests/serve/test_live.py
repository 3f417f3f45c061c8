"""Live streams over HTTP on a real server with the embedded model: the needle sample cut into
pieces with PyAV (MP4 files and an MPEG-TS segment) and pushed one by one; after each piece a
question sees exactly the frames so far (its answer is the dense one-shot answer of those
frames, and says up to which media time it saw), on /v1/answer and in chat
(``mminfer://streams/{id}``, streamed or not); bad pieces (corrupt, another frame size, going
back in time) are clear 400s that leave the stream answerable; the streams show in /metrics
and /report; delete -> 404; idle streams move to the host tier and come back; a windowed
stream drops its oldest frames and says so. Pull mode: tests/serve/test_live_pull.py."""

import argparse
import json
import threading
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from mminfer import video as videolib
from mminfer.engine.streams import QUESTION_ROOM
from mminfer.errors import ConfigError
from mminfer.models.base import Conversation
from mminfer.serve import cli as serve_cli
from mminfer.serve.app import Settings, create_app
from mminfer.serve.live_ops import live_of

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "videos"
NEEDLE = SAMPLES / "needle_0.mp4"
Q = "What number appears in the video?"


def source_frames(path):
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def write_piece(path, frames, fps=2, fmt=None, codec="libx264"):
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


class FrameVideo:
    def __init__(self, frames, fps):
        self.frames, self.sampled_fps = frames, fps


def push(url, sid, path, **form):
    with open(path, "rb") as f:
        return httpx.post(f"{url}/v1/streams/{sid}/segments", data=form,
                          files={"file": (Path(path).name, f.read(), "video/mp4")}, timeout=120)


def chat(url, sid, question=Q, **extra):
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "max_tokens": 4, **extra,
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"mminfer://streams/{sid}"}},
            {"type": "text", "text": question}]}]})


def ask(url, sid, question=Q):
    return httpx.post(f"{url}/v1/answer", data={"question": question, "stream_id": sid,
                                                "max_new_tokens": "4"},
                      files={"dummy": ("x.bin", b"", "application/octet-stream")}, timeout=120)


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    """needle_0 (20 frames at 2 fps) in five pieces of 2 s: MP4 files, the third MPEG-TS."""
    d = tmp_path_factory.mktemp("pieces")
    frames = source_frames(NEEDLE)
    out = []
    for i in range(5):
        ts = i == 2
        out.append(write_piece(d / f"piece{i}.{'ts' if ts else 'mp4'}", frames[4 * i:4 * i + 4],
                               fmt="mpegts" if ts else None))
    return out


def test_push_pieces_and_ask_between(pieces, tmp_path, live_server):
    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path),
                                          timeout_s=120)))
    r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=30)
    assert r.status_code == 200, r.text
    st = r.json()
    sid = st["id"]
    assert (st["state"], st["frames"], st["tokens"]) == ("open", 0, 0)
    assert ask(srv.url, sid).json()["error"]["message"].endswith("append a piece first")

    pipe = srv.app.state.worker.pipeline
    ad = pipe.adapter
    seen, answers = [], []
    for i, p in enumerate(pieces):
        r = push(srv.url, sid, p)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["piece"]["frames"] == 4 and body["piece"]["tokens"] > 0
        assert body["stream"]["seen_until"] == body["stream"]["media_seconds"] == 2.0 * (i + 1)
        # what the stream took in: the piece's frames as the server's decoder gives them
        seen.append(videolib.decode(str(p), sampling="uniform", num_frames=4).frames)
        a = ask(srv.url, sid)
        assert a.status_code == 200, a.text
        got = a.json()
        assert got["cache"] == "stream" and got["video"]["seen_until"] == 2.0 * (i + 1)
        frames = np.concatenate(seen)
        want = ad.generate(ad.prepare(FrameVideo(frames, 2.0), Conversation.single(Q)),
                           max_new_tokens=4)
        assert got["answer"] == want.text, (i, got["answer"], want.text)
        assert got["tokens"]["generated"] == len(want.token_ids)
        answers.append(got["answer"])
        if i in (0, 4):         # the same question in chat: the same answer, what it saw
            c = chat(srv.url, sid)
            assert c.status_code == 200, c.text
            body = c.json()
            assert body["choices"][0]["message"]["content"] == want.text
            assert body["mminfer"]["cache"] == "stream"
            assert body["mminfer"]["video"]["seen_until"] == 2.0 * (i + 1)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == got["tokens"][
                "cached"]
    assert len(set(answers)) > 1, answers        # what it sees changes as the video arrives

    st = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
    assert st["frames"] == 20 and st["pieces"] == 5 and st["kv"]["where"] == "cpu"
    assert st["kv"]["bytes"] > 0 and st["last_error"] is None
    assert [s["id"] for s in httpx.get(f"{srv.url}/v1/streams").json()["data"]] == [sid]

    # bad pieces: a clear 400 each, the stream as it was
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 8)
    r = push(srv.url, sid, junk)
    assert r.status_code in (400, 415, 422) and r.json()["error"]["code"] in (
        "bad_video", "unsupported_media_type"), r.text
    small = write_piece(tmp_path / "small.mp4", [f[:112, :160].copy()
                                                  for f in source_frames(NEEDLE)[:4]])
    r = push(srv.url, sid, small)
    assert r.status_code == 400 and "one frame size" in r.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/v1/streams/{sid}").json()["last_error"]["code"] == "bad_video"
    r = push(srv.url, sid, pieces[0], start="3")
    assert r.status_code == 400 and "backwards" in r.json()["error"]["message"]
    st = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
    assert st["frames"] == 20 and st["media_seconds"] == 10.0
    assert ask(srv.url, sid).json()["answer"] == answers[-1]

    # a gap: the piece starts later, sampling goes on from there
    r = push(srv.url, sid, pieces[0], start="12")
    assert r.status_code == 200 and r.json()["stream"]["media_seconds"] == 14.0
    assert r.json()["stream"]["seen_until"] == 14.0     # the samples moved on past the gap

    # chat streamed: the same answer as server-sent events, what it saw in the last chunk
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=120, json={
            "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"mminfer://streams/{sid}"}},
                {"type": "text", "text": Q}]}]}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(ev["choices"][0]["delta"].get("content", "") for ev in events)
    assert text == ask(srv.url, sid).json()["answer"]
    seen = events[-1]["mminfer"]["video"]
    st = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
    assert (seen["seen_until"], seen["media_seconds"]) == (st["seen_until"], 14.0)

    # chat's errors for a stream: the OpenAI error shape, what is wrong
    r = chat(srv.url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    assert "nope" in r.json()["error"]["message"]
    r = chat(srv.url, "a/b")
    assert r.status_code == 400 and "mminfer://streams/{id}" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
        "max_tokens": 4, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"mminfer://streams/{sid}"}},
                {"type": "text", "text": Q}]}]})
    assert r.status_code == 400 and "before the video" in r.json()["error"]["message"]

    # /metrics and /report: the stream, its pieces and their time
    m = httpx.get(f"{srv.url}/metrics").text
    assert metric(m, "mminfer:streams_active") == 1.0
    assert metric(m, "mminfer:stream_pieces_total") == 6.0
    assert metric(m, "mminfer:stream_piece_seconds_count") == 6.0
    assert metric(m, "mminfer:stream_ingested_tokens_total") == st["tokens"]
    assert metric(m, "mminfer:stream_kv_bytes") > 0
    rep = httpx.get(f"{srv.url}/v1/latency-report").json()["streams"]
    assert rep["stats"]["active"] == 1 and [r["id"] for r in rep["streams"]] == [sid]
    page = httpx.get(f"{srv.url}/report").text
    assert 'id="streams-summary" data-active="1"' in page and f'data-stream="{sid}"' in page

    assert httpx.delete(f"{srv.url}/v1/streams/{sid}").json()["deleted"] is True
    assert httpx.get(f"{srv.url}/v1/streams/{sid}").status_code == 404
    assert ask(srv.url, sid).status_code == 404
    r = chat(srv.url, sid)
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    m = httpx.get(f"{srv.url}/metrics").text
    assert metric(m, "mminfer:streams_active") == 0.0


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-but-model series ``name`` in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_stream_past_its_budget_is_full_and_still_answers(pieces, tmp_path, live_server):
    """--stream-kv-gb: room for the first piece and a question, not the second. The second
    piece is a 409 ``stream_full``; the stream says ``full`` and why, refuses more pieces, and
    answers over what it holds."""
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--stream-kv-gb", "0.5"])
    assert serve_cli.settings_from(args).stream_kv_gb == 0.5

    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path),
                                          timeout_s=120)))
    pipe = srv.app.state.worker.pipeline
    frames = source_frames(NEEDLE)
    layout = pipe.adapter.stream_layout(Conversation.single("?"), 2.0, frames[0].shape[:2])
    first = len(layout.head_ids) + 2 * layout.unit_tokens          # 4 frames: 2 pairs
    # the flag as the server reads it when its streams start (the model's layout is known
    # only once it loaded): room for the first piece and a question
    srv.app.state.settings.stream_kv_gb = (first + QUESTION_ROOM + 1) * \
        pipe.kv_bytes_per_token / 2**30
    sid = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=30).json()["id"]
    assert push(srv.url, sid, pieces[0]).status_code == 200
    r = push(srv.url, sid, pieces[1])
    assert r.status_code == 409 and r.json()["error"]["code"] == "stream_full", r.text
    assert "budget" in r.json()["error"]["message"]
    st = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
    assert st["state"] == "full" and "budget" in st["reason"] and st["tokens"] == first
    assert st["last_error"]["code"] == "stream_full"
    r = push(srv.url, sid, pieces[2])
    assert r.status_code == 409 and "takes no more video" in r.json()["error"]["message"]
    a = ask(srv.url, sid)
    assert a.status_code == 200 and a.json()["video"]["seen_until"] == 2.0
    m = httpx.get(f"{srv.url}/metrics").text
    assert metric(m, "mminfer:streams_full") == 1.0


def test_a_stream_chooses_its_pieces_attention(tmp_path, live_server):
    """``attention`` at creation: the pieces' mode in the stream's status; sparse refused where
    the server does not let clients choose it, an unknown mode a 4xx naming the field."""
    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path),
                                          timeout_s=120, allow_client_sparse=False)))
    r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "attention": "dense"}, timeout=30)
    assert r.status_code == 200 and r.json()["attention"] == "dense", r.text
    r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=30)
    assert r.json()["attention"] == srv.app.state.worker.pipeline.attention
    r = httpx.post(f"{srv.url}/v1/streams", json={"attention": "sparse"}, timeout=30)
    assert r.status_code == 403 and "attention=sparse" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{srv.url}/v1/streams", json={"attention": "fast"}, timeout=30)
    assert 400 <= r.status_code < 500 and "attention" in r.text


def tier_metric(text: str, name: str, tier: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'tier="{tier}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{tier={tier}}} not in /metrics")


def first_piece_rows(pipe):
    frames = source_frames(NEEDLE)
    layout = pipe.adapter.stream_layout(Conversation.single("?"), 2.0, frames[0].shape[:2])
    return layout, len(layout.head_ids) + 2 * layout.unit_tokens       # 4 frames: 2 pairs


def test_idle_streams_move_to_the_host_tier_and_come_back(pieces, tmp_path, live_server):
    """--stream-host-kv-gb: a device budget for one stream's first piece and a question. The
    second stream's piece moves the first (idle) to the host tier, where its status says it
    is; a question on it brings it back (the other goes) and answers as before it moved."""
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--stream-host-kv-gb", "2"])
    assert serve_cli.settings_from(args).stream_host_kv_gb == 2.0
    with pytest.raises(ConfigError, match="stream-host-kv-gb"):
        serve_cli.settings_from(parser.parse_args(["--stream-host-kv-gb", "-1"]))

    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path), timeout_s=120,
                                          stream_host_kv_gb=1.0)))
    pipe = srv.app.state.worker.pipeline
    _, first = first_piece_rows(pipe)
    srv.app.state.settings.stream_kv_gb = (first + QUESTION_ROOM + 1) * \
        pipe.kv_bytes_per_token / 2**30
    a, b = (httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=30).json()["id"]
            for _ in range(2))
    assert push(srv.url, a, pieces[0]).status_code == 200
    before = ask(srv.url, a).json()
    r = push(srv.url, b, pieces[1])
    assert r.status_code == 200, r.text
    st_a = httpx.get(f"{srv.url}/v1/streams/{a}").json()
    assert st_a["kv"]["where"] == "host" and st_a["kv"]["tier"] == "host"
    assert st_a["kv"]["bytes"] == first * pipe.kv_bytes_per_token      # its rows, no room
    assert r.json()["stream"]["kv"]["tier"] == "gpu"
    m = httpx.get(f"{srv.url}/metrics").text
    assert tier_metric(m, "mminfer:stream_kv_bytes", "host") == st_a["kv"]["bytes"]
    assert tier_metric(m, "mminfer:stream_kv_budget_bytes", "host") == 2**30
    after = ask(srv.url, a).json()
    assert (after["answer"], after["video"]) == (before["answer"], before["video"])
    assert httpx.get(f"{srv.url}/v1/streams/{a}").json()["kv"]["tier"] == "gpu"
    assert httpx.get(f"{srv.url}/v1/streams/{b}").json()["kv"]["where"] == "host"
    assert ask(srv.url, b).status_code == 200


def test_a_windowed_stream_drops_its_oldest_frames_and_says_so(pieces, tmp_path, live_server):
    """``keep: "window"``: past the budget the oldest frames go; the stream stays open, its
    bytes within the budget, and its status and answers say from which media time it holds
    frames."""
    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path),
                                          timeout_s=120)))
    pipe = srv.app.state.worker.pipeline
    layout, first = first_piece_rows(pipe)
    budget = (first + layout.unit_tokens + QUESTION_ROOM) * pipe.kv_bytes_per_token
    srv.app.state.settings.stream_kv_gb = budget / 2**30       # three pairs and a question
    r = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "keep": "some"}, timeout=30)
    assert r.status_code in (400, 422) and "keep" in r.text
    st = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "keep": "window"},
                    timeout=30).json()
    sid = st["id"]
    assert st["keep"] == "window" and st["window"]["dropped_frames"] == 0
    for p in pieces[:3]:
        r = push(srv.url, sid, p)
        assert r.status_code == 200, r.text
        st = r.json()["stream"]
        assert st["state"] == "open" and st["kv"]["bytes"] <= budget
    # 12 frames in, 6 held: the first three pairs went
    assert st["frames"] == 6 and st["window"]["dropped_frames"] == 6
    assert st["window"]["seen_from"] == 3.0 and st["seen_until"] == 6.0
    got = ask(srv.url, sid).json()
    assert got["video"]["seen_from"] == 3.0 and got["video"]["seen_until"] == 6.0
    c = chat(srv.url, sid).json()
    assert c["mminfer"]["video"]["seen_from"] == 3.0


# ------------------------------------------------------------------ questions fork the stream

QUESTIONS = [Q, "What color is the ball?", "How many red flashes are there?"]


def ask_n(url, sid, question, new):
    return httpx.post(f"{url}/v1/answer", data={"question": question, "stream_id": sid,
                                                "max_new_tokens": str(new)},
                      files={"dummy": ("x.bin", b"", "application/octet-stream")}, timeout=120)


def wait_for(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def in_threads(fns):
    out = [None] * len(fns)

    def go(i):
        out[i] = fns[i]()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    return threads, out


def gate_after_first_step(monkeypatch, pipe):
    """Every answer stops after its first decode step (the model's turn given back) until the
    returned gate opens; ``reached`` is set when one is stopped there."""
    gate, reached, real = threading.Event(), threading.Event(), pipe._stepper

    def stepper(turn):
        step, n = real(turn), [0]

        def run(*a):
            out = step(*a)
            n[0] += 1
            if n[0] == 1:
                reached.set()
                gate.wait(60)
            return out
        return run

    monkeypatch.setattr(pipe, "_stepper", stepper)
    return gate, reached


def test_questions_about_one_stream_decode_together(pieces, tmp_path, live_server):
    """Three questions about one stream sent at once: each forks the stream's cache, so none
    waits for another's answer: their decode steps share batches, each answer is the one it
    gets asked alone, and the stream's bytes are unchanged."""
    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path),
                                          timeout_s=120)))
    w = srv.app.state.worker
    sid = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=30).json()["id"]
    assert push(srv.url, sid, pieces[0]).status_code == 200
    alone = [ask_n(srv.url, sid, q, 6).json() for q in QUESTIONS]
    size = httpx.get(f"{srv.url}/v1/streams/{sid}").json()["kv"]["bytes"]
    batches, steps = w.scheduler.batches, w.scheduler.batched_steps
    hold = w.scheduler.turn("test")          # the model is busy while the three arrive
    assert hold.acquire()
    try:
        threads, out = in_threads([lambda q=q: ask_n(srv.url, sid, q, 6) for q in QUESTIONS])
        wait_for(lambda: w.running == 3)
        time.sleep(0.2)
    finally:
        hold.close()
    for t in threads:
        t.join(120)
    assert [r.status_code for r in out] == [200] * 3
    assert [r.json()["answer"] for r in out] == [a["answer"] for a in alone]
    assert [r.json()["video"]["seen_until"] for r in out] == [2.0] * 3
    assert w.scheduler.batched_steps - steps > w.scheduler.batches - batches
    st = httpx.get(f"{srv.url}/v1/streams/{sid}").json()
    assert st["kv"]["bytes"] == size and st["questions_open"] == 0


def test_a_piece_goes_in_while_a_question_decodes(pieces, tmp_path, live_server,
                                                  monkeypatch):
    """A question stopped in its decode phase (its fork open) does not hold the stream: a
    piece pushed meanwhile is taken in; the question answers over what it forked (its
    answer and seen_until those of the question asked before the piece), the next one sees
    the piece. A windowed stream's piece that must drop frames waits for the question."""
    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path),
                                          timeout_s=120)))
    pipe = srv.app.state.worker.pipeline
    layout, first = first_piece_rows(pipe)
    sid = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2}, timeout=30).json()["id"]
    assert push(srv.url, sid, pieces[0]).status_code == 200
    before = ask_n(srv.url, sid, QUESTIONS[1], 6).json()
    gate, reached = gate_after_first_step(monkeypatch, pipe)
    threads, out = in_threads([lambda: ask_n(srv.url, sid, QUESTIONS[1], 6)])
    try:
        assert reached.wait(60)
        assert httpx.get(f"{srv.url}/v1/streams/{sid}").json()["questions_open"] == 1
        t0 = time.monotonic()
        r = push(srv.url, sid, pieces[1])
        assert r.status_code == 200, r.text
        # in while the question is stopped (it would wait 60 s for the gate)
        assert time.monotonic() - t0 < 30 and out[0] is None
        assert r.json()["stream"]["seen_until"] == 4.0
    finally:
        gate.set()
    threads[0].join(120)
    got = out[0].json()
    assert (got["answer"], got["video"]["seen_until"]) == (before["answer"], 2.0)
    assert ask_n(srv.url, sid, Q, 4).json()["video"]["seen_until"] == 4.0

    # a window's drop moves rows in place: it waits for the open question
    assert httpx.delete(f"{srv.url}/v1/streams/{sid}").status_code == 200
    live_of(pipe).streams.budget_bytes = (first + layout.unit_tokens + QUESTION_ROOM) * \
        pipe.kv_bytes_per_token
    win = httpx.post(f"{srv.url}/v1/streams", json={"fps": 2, "keep": "window"},
                     timeout=30).json()["id"]
    assert push(srv.url, win, pieces[0]).status_code == 200
    gate.clear(), reached.clear()
    threads, out = in_threads([lambda: ask_n(srv.url, win, QUESTIONS[1], 6),
                               lambda: (reached.wait(60), push(srv.url, win, pieces[1]))[1]])
    try:
        assert reached.wait(60)
        time.sleep(1.5)
        assert out[1] is None                     # the piece waits for the question
        st = httpx.get(f"{srv.url}/v1/streams/{win}").json()
        assert st["questions_open"] == 1 and st["window"]["dropped_frames"] == 0
    finally:
        gate.set()
    for t in threads:
        t.join(120)
    assert out[1].status_code == 200 and out[1].json()["piece"]["dropped_frames"] == 2
    got = out[0].json()
    assert got["answer"] == before["answer"] and "seen_from" not in got["video"]
