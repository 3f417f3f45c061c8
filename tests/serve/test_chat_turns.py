"""Multi-turn chat as clients send it: the whole message list becomes the prompt
(``openai.conversation_of``), the video in whichever user message holds it, and a follow-up
turn about the same video (same turns before it) continues the video's cached prefix."""

import base64
from pathlib import Path

import httpx
import pytest
from conftest import write_video

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.errors import InputError, UnsupportedMedia
from mminfer.models.base import VIDEO, Conversation, Turn
from mminfer.serve.app import Settings, create_app
from mminfer.serve.openai import ChatCompletionRequest, conversation_of


def messages(*msgs):
    return ChatCompletionRequest.model_validate({"messages": list(msgs)}).messages


def video(url="data:video/mp4;base64,AAAA"):
    return {"type": "video_url", "video_url": {"url": url}}


def text(t):
    return {"type": "text", "text": t}


# ----------------------------------------------------------------------- the mapping

def test_history_becomes_the_conversation():
    url, conv = conversation_of(messages(
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [video("data:x"), text("what number?"), text("one word")]},
        {"role": "assistant", "content": "seven"},
        {"role": "user", "content": "and its color?"}))
    assert url == "data:x"
    assert conv == Conversation((Turn("system", ("be brief",)),
                                 Turn("user", (VIDEO, "what number?\none word")),
                                 Turn("assistant", ("seven",)),
                                 Turn("user", ("and its color?",))))
    # the video need not come first in its message, nor be in the first one
    _, conv = conversation_of(messages(
        {"role": "developer", "content": [text("a"), text("b")]},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [text("hi")]},
        {"role": "user", "content": [text("look:"), video(), text("what is it?")]}))
    assert conv.turns[0] == Turn("system", ("a\nb",))
    assert conv.turns[-1] == Turn("user", ("look:", VIDEO, "what is it?"))


@pytest.mark.parametrize("msgs,error,match", [
    ([{"role": "user", "content": [video(), video(), text("q")]}], InputError, r"it has 2"),
    ([{"role": "user", "content": [video(), text("q")]}, {"role": "assistant", "content": "a"},
      {"role": "user", "content": [video(), text("q2")]}], InputError, r"it has 2"),
    ([{"role": "user", "content": "no video here"}], InputError, r"it has 0"),
    ([{"role": "system", "content": "s"}], InputError, r"no user message"),
    ([{"role": "user", "content": [video(), text("q")]}, {"role": "assistant", "content": "a"}],
     InputError, r"last message"),
    ([{"role": "user", "content": [video(), text("q")]}, {"role": "system", "content": "late"},
      {"role": "user", "content": "q2"}], InputError, r"system message may only come"),
    ([{"role": "assistant", "content": [video(), text("q")]},
      {"role": "user", "content": "q"}], InputError, r"only a user message"),
    ([{"role": "tool", "content": "x"}, {"role": "user", "content": [video(), text("q")]}],
     InputError, r"role 'tool'"),
    ([{"role": "user", "content": [video(), {"type": "image_url",
                                             "image_url": {"url": "x"}}, text("q")]}],
     UnsupportedMedia, r"image_url"),
])
def test_conversations_refused(msgs, error, match):
    with pytest.raises(error, match=match):
        conversation_of(messages(*msgs))


# ----------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from conftest import LiveServer
    root = tmp_path_factory.mktemp("chat")
    ckpt = save_tiny_qwen2_5_vl(root / "tiny-qwen")
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(root / "data"),
                              timeout_s=120, api_key=None))
    with LiveServer(app) as s:
        yield s


@pytest.fixture
def clip_url(tmp_path):
    """A data: URL of a clip no other test asked about (its first question is a miss)."""
    def make(n_frames=10):
        raw = Path(write_video(tmp_path / f"c{n_frames}.mp4", n_frames=n_frames, fps=4.0,
                               width=64, height=48)).read_bytes()
        return f"data:video/mp4;base64,{base64.b64encode(raw).decode()}"
    return make


def post(srv, msgs):
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120,
                   json={"messages": msgs, "max_tokens": 3, "max_frames": 8})
    return r


def test_follow_up_turn_hits_the_cached_prefix(srv, clip_url):
    url = clip_url(10)
    system = {"role": "system", "content": "Answer in one word."}
    first_turn = {"role": "user", "content": [video(url), text("What number is shown?")]}
    r1 = post(srv, [system, first_turn])
    assert r1.status_code == 200, r1.text
    d1 = r1.json()
    assert d1["mminfer"]["cache"] == "miss"
    follow = [system, first_turn, {"role": "assistant", "content": d1["choices"][0]["message"]
                                   ["content"] or "seven"},
              {"role": "user", "content": "And what color is the background?"}]
    r2 = post(srv, follow)
    assert r2.status_code == 200, r2.text
    d2 = r2.json()
    # the history is in the prompt: more prompt tokens than the first turn alone
    assert d2["usage"]["prompt_tokens"] > d1["usage"]["prompt_tokens"] + 5
    assert d2["mminfer"]["cache"] == "hit"
    assert d2["mminfer"]["tokens"]["cached"] > 0
    # OpenAI's field for it, as the openai client reads it
    assert d2["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        d2["mminfer"]["tokens"]["cached"]
    assert d1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert d2["timings"]["vision"] == 0 and d1["timings"]["vision"] > 0
    again = post(srv, follow)                       # the same conversation again: a hit
    assert again.json()["mminfer"]["cache"] == "hit"
    assert again.json()["usage"] == d2["usage"]
    # another system prompt is another prefix: a miss, never the other one's cache
    other = post(srv, [{"role": "system", "content": "Answer in French."}, first_turn])
    assert other.json()["mminfer"]["cache"] == "miss"


def test_video_only_in_the_first_user_turn(srv, clip_url):
    url = clip_url(12)
    msgs = [{"role": "user", "content": [video(url), text("What number is shown?")]},
            {"role": "assistant", "content": "three"},
            {"role": "user", "content": [text("Are you sure?")]}]
    r = post(srv, msgs)
    assert r.status_code == 200, r.text
    single = post(srv, [{"role": "user", "content": [video(url), text("Are you sure?")]}])
    assert single.status_code == 200, single.text
    assert r.json()["usage"]["prompt_tokens"] > single.json()["usage"]["prompt_tokens"]
    # the same prefix (no system prompt, nothing before the video): the second is a hit
    assert (r.json()["mminfer"]["cache"], single.json()["mminfer"]["cache"]) == ("miss", "hit")


def test_two_videos_or_none_is_a_400(srv, clip_url):
    url = clip_url(10)
    two = post(srv, [{"role": "user", "content": [video(url), text("q")]},
                     {"role": "assistant", "content": "a"},
                     {"role": "user", "content": [video(url), text("q2")]}])
    assert two.status_code == 400
    assert "exactly one video_url" in two.json()["error"]["message"]
    none = post(srv, [{"role": "user", "content": "what is in the video?"}])
    assert none.status_code == 400
    assert "exactly one video_url" in none.json()["error"]["message"]
