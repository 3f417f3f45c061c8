"""OpenAI streaming (``stream: true``) on a real uvicorn server with the tiny checkpoints: the
chunks as OpenAI sends them, adding up to the non-streamed answer; nothing sent before the
first token exists; errors before it as JSON with their status, after it as an SSE error
event; a client that leaves mid-stream stops the job and frees the worker."""

import base64
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mminfer.serve.app import STAGE_ORDER, Settings, create_app
from mminfer.serve.worker import ModelWorker
from lab.toy.tiny import save_tiny_qwen2_5_vl
from lab.toy.tiny_longvila import save_tiny_longvila

NEEDLE = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("stream") / "tiny-qwen",
                                max_position_embeddings=1024)


def video_url() -> str:
    return "data:video/mp4;base64," + base64.b64encode(NEEDLE.read_bytes()).decode()


def chat(text="What number appears?", **extra) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video_url()}},
        {"type": "text", "text": text}]}], **extra}


def events(lines) -> list:
    """The ``data:`` payloads of an SSE body, JSON decoded ([DONE] kept as the string)."""
    out, seen_blank = [], True
    for line in lines:
        if not line:
            seen_blank = True
            continue
        assert seen_blank and line.startswith("data: "), line     # one data line an event
        seen_blank = False
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text: str, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


class Watched:
    """The real pipeline, with its on_token calls timed (and optionally slowed, as a big
    model's decode steps are slow): what the worker thread produced, and when."""

    def __init__(self, ckpt, token_delay_s=0.0):
        from mminfer.engine.pipeline import Pipeline
        self.inner = Pipeline(str(ckpt), device="cpu")
        self.token_delay_s = token_delay_s
        self.token_times: list[float] = []
        self.finished = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def answer(self, *args, on_token=None, **kwargs):
        self.token_times.clear()
        self.finished.clear()

        def timed(text, token_id):
            if token_id is not None:
                self.token_times.append(time.monotonic())
            on_token(text, token_id)
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
        try:
            return self.inner.answer(*args, on_token=timed if on_token else None, **kwargs)
        finally:
            self.finished.set()


def watched_server(ckpt, tmp_path, live_server, token_delay_s=0.0, **settings):
    holder = {}

    def load():
        holder["p"] = Watched(ckpt, token_delay_s)
        return holder["p"]

    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              api_key=None, **settings), worker=ModelWorker(load, queue_size=4))
    s = live_server(app)
    assert app.state.worker.wait_ready(60)
    return s, app, holder["p"]


def test_stream_adds_up_to_the_answer_with_usage_last(ckpt, tmp_path, live_server):
    s, app, pipe = watched_server(ckpt, tmp_path, live_server)
    url = f"{s.url}/v1/chat/completions"
    plain = httpx.post(url, json=chat(max_tokens=12), timeout=120)
    assert plain.status_code == 200, plain.text
    want = plain.json()

    t0 = time.monotonic()
    with httpx.stream("POST", url, json=chat(max_tokens=12, stream=True,
                                             stream_options={"include_usage": True}),
                      headers={"X-Request-ID": "sse-1"}, timeout=120) as r:
        headers_at = time.monotonic()
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        assert r.headers["x-request-id"] == "sse-1"
        evs = events(r.iter_lines())
    # nothing, not even the status line, before the worker had the first token
    assert pipe.token_times and t0 < pipe.token_times[0] <= headers_at
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert {c["id"] for c in chunks} == {"chatcmpl-sse-1"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {"tiny-qwen"}
    first, *middle, final, last = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1])      # include_usage: null until last
    texts = [c["choices"][0]["delta"]["content"] for c in middle]
    assert all(texts) and len(texts) >= 6                    # a chunk per piece of text
    assert all(c["choices"][0]["finish_reason"] is None for c in (first, *middle))
    assert "".join(texts) == want["choices"][0]["message"]["content"]
    assert final["choices"][0]["delta"] == {}
    assert final["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert list(final["timings"]) == list(STAGE_ORDER)
    assert final["timings"]["ttft"] <= final["timings"]["total"]
    # the same prompt as the plain answer, its video's prefix now cached: only that differs
    details = last["usage"]["prompt_tokens_details"]
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert details["cached_tokens"] > 0 and final["mminfer"]["cache"] == "hit"
    assert last["choices"] == [] and last["usage"] == {
        **want["usage"], "prompt_tokens_details": {**want["usage"]["prompt_tokens_details"],
                                                   "cached_tokens": details["cached_tokens"]}}
    assert last["usage"]["completion_tokens"] == len(pipe.token_times) == 12

    # recorded like any answer: counted, its stages in the histograms and the report
    m = httpx.get(f"{s.url}/metrics").text
    assert metric(m, "mminfer:requests_total", status="200") == 2
    assert metric(m, "mminfer:time_to_first_token_seconds_count") == 2
    assert metric(m, "mminfer:generation_tokens_total") == 24
    rows = app.state.store.rows()
    assert [(r["id"], r["endpoint"], r["status"]) for r in rows][-1] == ("sse-1", "chat", 200)
    assert rows[-1]["timings"] == final["timings"]

    # without stream_options: no usage key at all (OpenAI's shape)
    with httpx.stream("POST", url, json=chat(max_tokens=3, stream=True), timeout=120) as r:
        evs = events(r.iter_lines())
    assert evs[-1] == "[DONE]" and all("usage" not in c for c in evs[:-1])
    assert evs[-2]["choices"][0]["finish_reason"] == "length"


def test_byte_level_tokens_stream_as_whole_characters(tmp_path, live_server):
    """The tiny LongVILA's tokenizer is one token per byte, so a random model's answer is
    full of characters that only decode in groups (and invalid bytes)."""
    ck = save_tiny_longvila(tmp_path / "tiny-longvila")
    app = create_app(Settings(model=str(ck), device="cpu", data_dir=str(tmp_path / "d"),
                              api_key=None))
    s = live_server(app)
    url = f"{s.url}/v1/chat/completions"
    want = httpx.post(url, json=chat(max_tokens=40), timeout=120).json()
    with httpx.stream("POST", url, json=chat(max_tokens=40, stream=True), timeout=120) as r:
        evs = events(r.iter_lines())
    texts = [c["choices"][0]["delta"].get("content", "") for c in evs[1:-2]]
    content = want["choices"][0]["message"]["content"]
    assert any(len(ch.encode()) > 1 for ch in content)       # the case this test is about
    assert "".join(texts) == content
    assert len([t for t in texts if t]) > 3


def test_errors_before_the_first_token_are_json_with_their_status(ckpt, tmp_path,
                                                                  live_server):
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path),
                              api_key=None, max_fps=4))
    s = live_server(app)
    url = f"{s.url}/v1/chat/completions"
    cases = [  # (body, status, code)
        (chat(stream=True, fps=8), 413, "over_limit"),                  # a server budget
        (chat(stream=True, model="nope"), 404, None),                 # an unknown model
        (chat(stream=False, stream_options={"include_usage": True}), 400, "bad_input"),
        (chat(stream=True, max_tokens=1020), 400, "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            {"type": "text", "text": "what?"}]}], "stream": True}, 400, "bad_video"),
    ]
    for body, status, code in cases:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == status, (body.get("model"), r.text)
        assert r.headers["content-type"] == "application/json"
        if code:
            assert r.json()["error"]["code"] == code, r.text
    assert app.state.worker.served == 0                  # none of them reached the model


def test_the_deadline_before_and_after_the_first_token(ckpt, tmp_path, live_server):
    # before: the job is stopped and the answer is a JSON 504, as without streaming
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path / "a"),
                              api_key=None, timeout_s=0.001))
    s = live_server(app)
    r = httpx.post(f"{s.url}/v1/chat/completions", json=chat(stream=True), timeout=60)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"

    # after: an SSE error event with the status it would have had, then [DONE]
    s, app, pipe = watched_server(ckpt, tmp_path / "b", live_server, token_delay_s=0.5,
                                  timeout_s=6.0)
    with httpx.stream("POST", f"{s.url}/v1/chat/completions", timeout=60,
                      json=chat(max_tokens=200, stream=True)) as r:
        assert r.status_code == 200
        evs = events(r.iter_lines())
    assert evs[-1] == "[DONE]"
    err = evs[-2]["error"]
    assert (err["code"], err["status"]) == ("timeout", 504) and "while running" in err[
        "message"]
    assert any(c.get("choices") and c["choices"][0]["delta"].get("content") for c in evs[1:-2])
    assert pipe.finished.wait(10) and 1 < len(pipe.token_times) < 200   # the job was stopped
    m = httpx.get(f"{s.url}/metrics").text
    assert metric(m, "mminfer:errors_total", code="timeout") == 1
    assert metric(m, "mminfer:requests_total", status="504") == 1
    assert app.state.store.rows()[-1]["status"] == 504


def test_a_client_leaving_mid_stream_stops_the_job(ckpt, tmp_path, live_server):
    s, app, pipe = watched_server(ckpt, tmp_path, live_server, token_delay_s=0.25)
    w = app.state.worker
    url = f"{s.url}/v1/chat/completions"
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url, json=chat(max_tokens=200, stream=True)) as r:
            got = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got.append(json.loads(line[6:]))
                if len(got) == 3:               # the role and two pieces of text
                    break
            assert w.running == 1
            t0 = time.monotonic()
        # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 10
    while w.running and time.monotonic() < deadline:
        time.sleep(0.01)
    freed = time.monotonic() - t0
    assert w.running == 0 and freed < 2.0, freed
    assert w.stopped == 1 and len(pipe.token_times) < 20         # far from its 200 tokens
    m = httpx.get(f"{s.url}/metrics").text
    assert metric(m, "mminfer:errors_total", code="client_disconnected") == 1
    assert metric(m, "mminfer:request_stop_seconds_count") == 1
    deadline = time.monotonic() + 10
    while not app.state.store.rows() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [(r["status"], r["code"]) for r in app.state.store.rows()] == [
        (499, "client_disconnected")]
    # the worker is free: the next request (streamed too) runs to its end
    pipe.token_delay_s = 0.0
    with httpx.stream("POST", url, json=chat(max_tokens=4, stream=True), timeout=60) as r:
        evs = events(r.iter_lines())
    assert evs[-1] == "[DONE]" and evs[-2]["choices"][0]["finish_reason"] == "length"
    assert w.served == 2
