"""Live streams (mminfer.engine.streams): a video ingested in pieces and then asked is the
one-shot prompt of the same frames — last-token logits within 1e-4 in fp32 and the same greedy
answer — on the tiny Qwen2.5-VL (M-RoPE in media time, temporal pairs across pieces) and
LongVILA (1-D positions) checkpoints; a question between pieces sees exactly the frames so
far; a piece that fails, changes size or goes back in time leaves the stream as it was; a
stream past its budget is full and still answers."""

import numpy as np
import pytest
import torch

from lab.toy.tiny_longvila import save_tiny_longvila
from mminfer.engine.pipeline import Pipeline
from mminfer.engine.streams import FULL, Stream, Streams
from mminfer.errors import Cancelled, InputError, StreamFull, StreamNotFound, VideoError
from mminfer.models.base import Conversation, PrepareOptions

Q = "where does the red square move?"
FPS = 2.0
# one frame size whatever the frame count: the one-shot's whole-video budget never binds
PIXELS = PrepareOptions(min_pixels=28 * 28 * 4, max_pixels=56 * 84)


def random_frames(n, h=56, w=84, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=g)


class FrameVideo:
    """What Qwen2.5-VL's prepare reads of a decoded video: ``frames``, ``sampled_fps``."""

    def __init__(self, frames, fps):
        self.frames, self.sampled_fps = frames, fps


@pytest.fixture(scope="module")
def qwen():
    """The embedded model (a trained Qwen2.5-VL): its logits follow the positions closely (a
    temporal position off by half moves them by 2.7, where the tiny random checkpoint moves
    by 4e-5), so the 1e-4 bound means something."""
    return Pipeline(None, attention="dense", device="cpu")


@pytest.fixture(scope="module")
def longvila(tmp_path_factory):
    ckpt = save_tiny_longvila(tmp_path_factory.mktemp("streams") / "tiny-longvila")
    return Pipeline(str(ckpt), attention="dense", device="cpu")


def one_shot(pipe, frames, question=Q, options=PIXELS, new=6):
    """The dense one-shot prefill of ``frames`` and its greedy answer."""
    ad = pipe.adapter
    video = FrameVideo(frames, FPS) if ad.name == "qwen2_5_vl" else frames
    prep = ad.prepare(video, Conversation.single(question), options)
    return ad.generate(prep, max_new_tokens=new)


def assert_same(gen, want, tol=1e-4):
    err = (gen.prefill_logits.float() - want.prefill_logits.float()).abs().max().item()
    assert err <= tol, err
    assert gen.token_ids == want.token_ids


def test_qwen_pieces_equal_one_shot(qwen):
    """Pieces of 3, 2 and 3 frames: temporal pairs straddle pieces (an odd frame waits), and
    each question sees the one-shot prompt of the pairs ingested so far."""
    frames = random_frames(8, 56, 84, seed=1)
    s = Stream(qwen, fps=FPS, options=PIXELS)
    r1 = s.append_frames(frames[:3])
    assert (r1["frames"], s.frames, s.status()["pending_frames"]) == (2, 2, 1)
    gen, seen = s.generate(Q, max_new_tokens=6)
    assert_same(gen, one_shot(qwen, frames[:2]))
    assert seen["seen_until"] == 1.0 and seen["media_seconds"] == 1.5
    s.append_frames(frames[3:5])
    s.append_frames(frames[5:8])
    assert s.frames == 8 and s.pending is None
    gen, seen = s.generate(Q, max_new_tokens=6)
    want = one_shot(qwen, frames)
    assert_same(gen, want)
    assert seen["tokens"] + len(s.layout.question_ids(Conversation.single(Q))) == \
        want.prefill_tokens
    # the question's rows were dropped: asking again gives the same
    assert_same(s.generate(Q, max_new_tokens=6)[0], want)
    res = s.ask(Q, max_new_tokens=6)
    assert res.answer == want.text and res.cache == "stream"
    assert res.video["seen_until"] == 4.0


def test_longvila_pieces_equal_one_shot(longvila):
    """1-D positions continue the cache's length. The tiny random checkpoint is weakly
    sensitive (positions off by 3 move its logits by 5e-4; the pieces agree to 1e-7), hence
    the tighter bound."""
    frames = random_frames(3, 40, 70, seed=2)
    s = Stream(longvila, fps=FPS)
    s.append_frames(frames[:1])
    assert_same(s.generate(Q, max_new_tokens=6)[0], one_shot(longvila, frames[:1], options=None),
                tol=1e-5)
    s.append_frames(frames[1:])
    assert_same(s.generate(Q, max_new_tokens=6)[0], one_shot(longvila, frames, options=None),
                tol=1e-5)


def test_conversation_turns_after_the_video(qwen):
    frames = random_frames(4, 56, 84, seed=3)
    s = Stream(qwen, fps=FPS, options=PIXELS)
    s.append_frames(frames)
    from mminfer.models.base import VIDEO, Turn
    conv = Conversation((Turn("user", (VIDEO, "what is shown?")),
                         Turn("assistant", ("a square",)), Turn("user", (Q,))))
    ad = qwen.adapter
    want = ad.generate(ad.prepare(FrameVideo(frames, FPS), conv, PIXELS), max_new_tokens=4)
    assert_same(s.generate(conversation=conv, max_new_tokens=4)[0], want)
    other = Conversation((Turn("system", ("be brief",)), Turn("user", (VIDEO, Q))))
    with pytest.raises(InputError, match="before the video"):
        s.generate(conversation=other)


def test_a_failed_piece_leaves_the_stream_as_it_was(qwen):
    frames = random_frames(6, 56, 84, seed=4)
    s = Stream(qwen, fps=FPS, options=PIXELS)
    s.append_frames(frames[:4])
    want = one_shot(qwen, frames[:4])
    calls = []

    def cancel_mid_prefill():
        calls.append(1)
        return len(calls) > 3          # after the vision, inside the prefill's layers

    with pytest.raises(Cancelled):
        s.append_frames(frames[4:], cancel=cancel_mid_prefill)
    assert s.frames == 4 and s.length == s.kv.length
    assert_same(s.generate(Q, max_new_tokens=6)[0], want)
    with pytest.raises(VideoError, match="one frame size"):
        s.append_frames(random_frames(2, 84, 84))
    assert_same(s.generate(Q, max_new_tokens=6)[0], want)
    # and it goes on: the next piece is the one that failed
    s.append_frames(frames[4:])
    assert_same(s.generate(Q, max_new_tokens=6)[0], one_shot(qwen, frames))


def test_over_budget_the_stream_is_full_and_answers(qwen):
    frames = random_frames(8, 56, 84, seed=5)
    s = Stream(qwen, fps=FPS, options=PIXELS)
    s.append_frames(frames[:4])
    s.budget_bytes = s.held_bytes              # no room for a single row more
    with pytest.raises(StreamFull, match="budget"):
        s.append_frames(frames[4:])
    assert s.state == FULL and "budget" in s.status()["reason"]
    assert_same(s.generate(Q, max_new_tokens=6)[0], one_shot(qwen, frames[:4]))
    with pytest.raises(StreamFull):
        s.append_frames(frames[4:])


def test_registry_budget_and_tenants(qwen):
    reg = Streams(qwen, budget_bytes=1 << 30)
    a = reg.create(fps=FPS, options=PIXELS, tenant="alice")
    with pytest.raises(StreamNotFound):
        reg.get(a.id, "bob")
    assert reg.get(a.id, "alice") is a and reg.list("bob") == []
    a.append_frames(random_frames(2, 56, 84))
    assert reg.stats()["bytes"] == a.held_bytes > 0
    b = reg.create(fps=FPS, options=PIXELS, tenant="bob")
    reg.budget_bytes = a.held_bytes            # alice's stream holds it all: bob's is full
    with pytest.raises(StreamFull):
        b.append_frames(random_frames(2, 56, 84))
    reg.delete(a.id, "alice")
    with pytest.raises(StreamNotFound):
        reg.get(a.id, "alice")
    assert a.kv is None


def test_empty_stream_and_bad_fps(qwen):
    with pytest.raises(InputError, match="fps"):
        Stream(qwen, fps=0)
    s = Stream(qwen, fps=FPS, options=PIXELS)
    with pytest.raises(InputError, match="no video yet"):
        s.ask(Q)
    s.append_frames(random_frames(1, 56, 84))   # half a pair: nothing to ask about yet
    with pytest.raises(InputError, match="no video yet"):
        s.ask(Q)
    with pytest.raises(VideoError):
        s.append_frames(np.zeros((2, 56, 84), np.uint8))
    assert torch.is_tensor(s.pending) and len(s.pending) == 1
