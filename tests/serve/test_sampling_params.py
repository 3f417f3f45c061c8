"""OpenAI's sampling parameters on a real server (tiny Qwen2.5-VL, CPU): temperature 0 or
absent is greedy, a seed reproduces a sampled answer, a stop string cuts the answer (streamed
or not, across tokens), logprobs come in OpenAI's shape (and on /v1/answer), and every
parameter the server would otherwise ignore is a 400 naming it, unless its value changes
nothing."""

import base64
import json
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, write_video

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.serve.app import Settings, create_app


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    ckpt = save_tiny_qwen2_5_vl(root / "tiny-qwen")
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(root / "data"),
                              timeout_s=120, api_key=None))
    with LiveServer(app) as s:
        s.clip = Path(write_video(root / "clip.mp4", n_frames=8, fps=4.0, width=64, height=48))
        yield s


def chat(srv, **extra):
    url = "data:video/mp4;base64," + base64.b64encode(srv.clip.read_bytes()).decode()
    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what?"}]}],
        "max_tokens": 12, "max_frames": 8, **extra}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)


def content(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_greedy_by_default_and_a_seed_reproduces_a_sample(srv):
    greedy = content(chat(srv))
    assert content(chat(srv, temperature=0)) == greedy
    a = chat(srv, temperature=1.5, seed=7)
    assert content(a) == content(chat(srv, temperature=1.5, seed=7, top_p=1))
    assert a.json()["mminfer"]["sampling"] == {"temperature": 1.5, "top_p": 1.0, "seed": 7}
    others = {content(chat(srv, temperature=1.5, seed=s)) for s in (8, 9, 10)}
    assert len(others | {content(a), greedy}) > 2          # it does sample
    # no seed: one is drawn and said, and asking with it gives the same answer
    r = chat(srv, temperature=1.5)
    seed = r.json()["mminfer"]["sampling"]["seed"]
    assert content(chat(srv, temperature=1.5, seed=seed)) == content(r)
    assert "sampling" not in chat(srv, max_tokens=1).json()["mminfer"]


def test_a_stop_string_cuts_the_answer_streamed_or_not(srv):
    full = chat(srv).json()["choices"][0]
    text = full["message"]["content"]
    assert full["finish_reason"] == "length" and len(text) > 5
    stop = text[2:4]
    want = text[:text.find(stop)].strip()
    r = chat(srv, stop=[stop, "never-seen"])
    assert content(r) == want and r.json()["choices"][0]["finish_reason"] == "stop"
    assert content(chat(srv, stop=stop)) == want           # a string alone is one stop
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," +
                                                    base64.b64encode(srv.clip.read_bytes())
                                                    .decode()}},
                {"type": "text", "text": "what?"}]}],
            "max_tokens": 12, "max_frames": 8, "stream": True, "stop": [stop]}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    deltas = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert deltas == want and stop not in deltas
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_in_openais_shape(srv):
    d = chat(srv, logprobs=True, top_logprobs=2).json()
    choice = d["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == d["usage"]["completion_tokens"]
    for e in entries:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["logprob"] <= 0 and isinstance(e["bytes"], list)
        assert len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["token"] == e["token"]    # greedy: the likeliest
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]
    assert choice["message"]["content"] == content(chat(srv))  # the same greedy answer
    assert chat(srv, max_tokens=1).json()["choices"][0]["logprobs"] is None


def test_answer_form_takes_the_same_parameters(srv):
    def ask(**fields):
        files = {"video": ("clip.mp4", srv.clip.read_bytes(), "video/mp4")}
        data = {"question": "what?", "max_frames": "8", "max_new_tokens": "12", **fields}
        return httpx.post(f"{srv.url}/v1/answer", files=files, data=data, timeout=120)

    r = ask(logprobs="true", top_logprobs="1")
    assert r.status_code == 200, r.text
    d = r.json()
    assert len(d["logprobs"]) == d["tokens"]["generated"]
    assert d["logprobs"][0]["top_logprobs"][0]["token"] == d["logprobs"][0]["token"]
    assert d["finish_reason"] == "length" and "sampling" not in d
    stop = d["answer"][2:4]
    cut = ask(stop=stop).json()
    assert cut["answer"] == d["answer"][:d["answer"].find(stop)].strip()
    assert cut["finish_reason"] == "stop" and "logprobs" not in cut
    s1, s2 = ask(temperature="1.5", seed="3").json(), ask(temperature="1.5", seed="3").json()
    assert s1["answer"] == s2["answer"] and s1["sampling"]["seed"] == 3
    bad = ask(presence_penalty="0")
    assert bad.status_code == 400 and "presence_penalty" in bad.json()["error"]["message"]


@pytest.mark.parametrize("extra, field", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"50": 100}}, "logit_bias"),
    ({"echo": 0}, "echo"),                               # 0 is not false
    ({"temprature": 0.5}, "temprature"),                  # a typo is not ignored either
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 2}, "top_logprobs"),                # without logprobs
    ({"logprobs": True, "stream": True}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"n": 2}, None),
])
def test_parameters_that_would_be_ignored_are_refused(srv, extra, field):
    r = chat(srv, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if field is not None:
        assert field in err["message"] and err["field"].startswith(field)


def test_neutral_values_are_accepted(srv):
    r = chat(srv, max_tokens=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
             response_format={"type": "text"}, tools=[], tool_choice="none", top_k=-1,
             user="someone", logprobs=False, top_logprobs=0, seed=None, stop=None)
    assert r.status_code == 200, r.text
