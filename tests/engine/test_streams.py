"""Live streams (mminfer.engine.streams): a video ingested in pieces and then asked is the
one-shot prompt of the same frames — last-token logits within 1e-4 in fp32 and the same greedy
answer — on the tiny Qwen2.5-VL (M-RoPE in media time, temporal pairs across pieces) and
LongVILA (1-D positions) checkpoints; a question between pieces sees exactly the frames so
far; a piece that fails, changes size or goes back in time leaves the stream as it was; a
stream past its budget is full and still answers; idle streams move to the host tier and come
back exact; past both budgets a stream is full, or (keep="window") drops its oldest frames and
says so, its positions absolute."""

import threading

import numpy as np
import pytest
import torch

from lab.toy.tiny_longvila import save_tiny_longvila
from mminfer.engine.cache import VideoCache
from mminfer.engine.pipeline import Pipeline
from mminfer.engine.scheduler import Scheduler
from mminfer.engine.streams import FULL, QUESTION_ROOM, Stream, Streams
from mminfer.errors import (Cancelled, InputError, StreamBusy, StreamFull, StreamNotFound,
                            VideoError)
from mminfer.models.base import VIDEO, Conversation, PrepareOptions, Turn
from mminfer.models.kv import PrefixKV
from tests.engine.test_scheduler import idle_work_around

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


def test_idle_streams_move_to_the_host_tier_and_come_back_exact(qwen):
    """Two streams, a device budget for one: each piece or question of one moves the other
    (idle) to the host tier, its rows alone; a question on a stream that went to the host and
    back gives the bit-identical logits it gave before."""
    frames = random_frames(4, 56, 84, seed=6)
    reg = Streams(qwen, budget_bytes=1 << 30, host_bytes=1 << 30)
    a = reg.create(fps=FPS, options=PIXELS)
    a.append_frames(frames)
    before = a.generate(Q, max_new_tokens=6)[0]
    assert_same(before, one_shot(qwen, frames))
    reg.budget_bytes = a.held_bytes                 # room for one stream of this size
    b = reg.create(fps=FPS, options=PIXELS)
    b.append_frames(frames)
    st = reg.stats()
    assert a.status()["kv"]["where"] == "host" and b.status()["kv"]["tier"] == "gpu"
    assert st["host_bytes"] == a.held_bytes == a.length * qwen.kv_bytes_per_token
    assert st["gpu_bytes"] == b.held_bytes <= reg.budget_bytes
    after = a.generate(Q, max_new_tokens=6)[0]     # a back on the device, b to the host
    assert torch.equal(after.prefill_logits, before.prefill_logits)
    assert after.token_ids == before.token_ids
    assert a.status()["kv"]["tier"] == "gpu" and b.status()["kv"]["where"] == "host"
    assert reg.stats()["gpu_bytes"] <= reg.budget_bytes
    assert_same(b.generate(Q, max_new_tokens=6)[0], before)
    assert (reg.counts["spills"], reg.counts["restores"]) == (3, 2)


def test_past_both_budgets_a_stream_is_full_and_answers(qwen):
    """The host tier has no room for the idle stream: the piece that needed its device room
    is refused, the stream is full, says which budgets, and answers over what it held."""
    frames = random_frames(6, 56, 84, seed=7)
    reg = Streams(qwen, budget_bytes=1 << 30, host_bytes=1024)
    a = reg.create(fps=FPS, options=PIXELS)
    a.append_frames(frames[:4])
    b = reg.create(fps=FPS, options=PIXELS)
    b.append_frames(frames[:2])
    reg.budget_bytes = a.held_bytes + b.held_bytes
    with pytest.raises(StreamFull, match="stream-host-kv-gb"):
        b.append_frames(frames[2:])
    assert b.state == FULL and "host tier" in b.status()["reason"]
    assert a.status()["kv"]["tier"] == b.status()["kv"]["tier"] == "gpu"   # nothing moved
    assert_same(b.generate(Q, max_new_tokens=6)[0], one_shot(qwen, frames[:2]))
    assert_same(a.generate(Q, max_new_tokens=6)[0], one_shot(qwen, frames[:4]))


def test_cut_drops_rows_and_keeps_the_rest():
    kv = PrefixKV(2, headroom=3)
    k = torch.randn(1, 2, 20000, 4)
    v = torch.randn(1, 2, 20000, 4)
    for layer in kv.layers:
        layer.update(k, v)
    size = kv.held_bytes
    kv.cut(5, 7)
    want = torch.cat([k[..., :5, :], k[..., 12:, :]], dim=-2)
    assert kv.length == 19993 and kv.held_bytes == size
    assert all(torch.equal(layer.keys, want) for layer in kv.layers)
    kept_v = torch.cat([v[..., :5, :], v[..., 12:, :]], dim=-2)
    kv.layers[0].cut(3, 9000)             # shorter than the rows it moves: chunks overlap
    assert torch.equal(kv.layers[0].values,
                       torch.cat([kept_v[..., :3, :], kept_v[..., 9003:, :]], dim=-2))


def layer0(s):
    return s.kv.layers[0].keys, s.kv.layers[0].values


@pytest.mark.parametrize("model", ["qwen", "longvila"])
def test_a_window_drops_the_oldest_frames_and_says_so(model, request):
    """keep="window" past the budget: the oldest whole units after the head go, the bytes
    stay within the budget, the status and the answer say from which media time the stream
    holds frames. Positions stay absolute: every row the window kept (the new piece's too)
    has the first layer's K/V (a function of its input and position alone) that a stream
    keeping everything has for it, and a question continues from the absolute position."""
    pipe = request.getfixturevalue(model)
    qwen_like = model == "qwen"
    hw, opts = ((56, 84), PIXELS) if qwen_like else ((40, 70), None)
    frames = random_frames(8, *hw, seed=8)
    full = Stream(pipe, fps=FPS, options=opts)
    win = Stream(pipe, fps=FPS, options=opts, keep="window")
    with pytest.raises(InputError, match="keep"):
        Stream(pipe, fps=FPS, keep="some")
    for s in (full, win):
        s.append_frames(frames[:4])
    lay = win.layout
    head, ut, uf = len(lay.head_ids), lay.unit_tokens, lay.unit_frames
    assert win.status()["window"] == {"dropped_frames": 0, "dropped_tokens": 0,
                                      "seen_from": 0.0}
    # room for three units more than the head: the next piece (2 units / 4 frames) drops
    bpt = pipe.kv_bytes_per_token
    units_held = 4 // uf
    win.budget_bytes = (head + (units_held + 4 // uf - 1) * ut + QUESTION_ROOM) * bpt
    win.append_frames(frames[4:8])
    full.append_frames(frames[4:8])
    st = win.status()
    assert st["state"] == "open" and st["window"]["dropped_frames"] == uf
    assert st["window"]["seen_from"] == uf / FPS > 0
    assert st["last_piece"]["dropped_frames"] == uf
    assert win.held_bytes <= win.budget_bytes and win.length == full.length - ut
    assert st["frames"] == 8 - uf
    for got, ref in zip(layer0(win), layer0(full)):
        want = torch.cat([ref[..., :head, :], ref[..., head + ut:, :]], dim=-2)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert win.rope_delta == full.rope_delta + ut
    res = win.ask(Q, max_new_tokens=4)
    assert res.video["seen_from"] == uf / FPS and res.video["seen_until"] == 4.0
    assert "seen_from" not in full.ask(Q, max_new_tokens=4).video
    # more pieces: the window moves on, the bytes stay bounded
    win.append_frames(random_frames(4, *hw, seed=9))
    assert win.held_bytes <= win.budget_bytes
    first = (4 // uf + 1) * uf / FPS           # the units past the budget's, oldest first
    assert win.status()["window"]["seen_from"] == first
    assert win.ask(Q, max_new_tokens=4).video["seen_from"] == first


def test_a_window_makes_room_for_the_context_and_the_budget(qwen, monkeypatch):
    """Past the model's context a windowed stream drops what the context asks, and past its
    byte budget as well what that asks on top; a stream keeping everything is full."""
    frames = random_frames(8, 56, 84, seed=10)
    win = Stream(qwen, fps=FPS, options=PIXELS, keep="window")
    full = Stream(qwen, fps=FPS, options=PIXELS)
    for s in (win, full):
        s.append_frames(frames[:4])
    head, ut = len(win.layout.head_ids), win.layout.unit_tokens
    monkeypatch.setattr(qwen.adapter, "max_context", head + 3 * ut + QUESTION_ROOM)
    with pytest.raises(StreamFull, match="context"):
        full.append_frames(frames[4:])
    win.budget_bytes = (head + 2 * ut + QUESTION_ROOM) * qwen.kv_bytes_per_token
    win.append_frames(frames[4:])          # 4 units: 1 over the context, 1 more over the bytes
    assert win.held_units == 2 and win.status()["window"]["dropped_frames"] == 4
    assert win.seen_from == 2.0 and win.held_bytes <= win.budget_bytes


# ------------------------------------------------------------------ questions fork the stream

QUESTIONS = [Q, "what colour is the background?", "how many objects are there?"]


def take_turns(s, question, new=8):
    """A question the way it was answered before questions forked: appended to the stream's
    own cache and cropped back (the reference a fork must equal)."""
    suffix = s.layout.question_embeds(Conversation.single(question))
    try:
        return s.ad.continue_on(s.kv, suffix, rope_delta=s.rope_delta, max_new_tokens=new)
    finally:
        s.kv.truncate(s.length)


def run_threads(fns, timeout=120):
    """``fns`` each in a thread of its own; their results (errors raised here)."""
    out, errors = [None] * len(fns), []

    def go(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:          # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return out


def asked(sched, s, question, new=8, on_token=None):
    """``s.generate`` with a turn of ``sched`` (a request of the server)."""
    turn = sched.turn(question)
    try:
        return s.generate(question, max_new_tokens=new, turn=turn, on_token=on_token)
    finally:
        turn.close()


def test_questions_fork_the_stream_and_decode_together(qwen):
    """Three questions about one stream at once: each forks the stream's rows (shared, read
    only), so they decode in the same batched steps; each answer is the take-turns answer
    (the question appended to the stream's cache), and the stream's cache is untouched."""
    s = Stream(qwen, fps=FPS, options=PIXELS)
    s.append_frames(random_frames(4, 56, 84, seed=11))
    alone = [take_turns(s, q) for q in QUESTIONS]
    for q, want in zip(QUESTIONS, alone):
        assert_same(s.generate(q, max_new_tokens=8)[0], want, tol=1e-5)
    rows, size = s.kv.length, s.held_bytes
    sched = Scheduler()
    hold = sched.turn("hold")                # they arrive while the model is busy
    assert hold.acquire()
    threading.Timer(0.3, hold.close).start()
    out = run_threads([lambda q=q: asked(sched, s, q) for q in QUESTIONS])
    for (gen, seen), want in zip(out, alone):
        assert_same(gen, want, tol=1e-5)
        assert seen["seen_until"] == 2.0
    assert sched.batched_steps > sched.batches           # several answers in a step
    assert s.kv.length == s.length == rows and s.held_bytes == size
    assert s.status()["questions_open"] == 0 and s.questions == 2 * len(QUESTIONS)


def _blocked_question(sched, s, while_open, new=8):
    """A question whose second token (after a decode step: the turn is free) runs
    ``while_open()`` before the answer goes on; its Generated and what it saw."""
    calls = []

    def on_token(piece, token_id):
        calls.append(token_id)
        if len(calls) == 2:
            while_open()

    gen, seen = asked(sched, s, Q, new=new, on_token=on_token)
    assert len(calls) >= 2, "the answer ended before its second token"
    return gen, seen


def _piece(sched, stream, frames, done):
    """A function appending ``frames`` to ``stream`` on a turn of ``sched`` of its own, as
    the server's ingest does, setting ``done`` when it is over."""
    def piece():
        t = sched.turn("piece")
        try:
            stream.append_frames(frames, turn=t)
        finally:
            t.close()
            done.set()
    return piece


def test_a_piece_is_ingested_while_a_question_decodes(qwen):
    """A piece appended while a question about the stream decodes goes in at once (no turn
    taking): it even grows the stream's buffer under the fork, whose answer is still the one
    over the rows it forked; the next question sees the piece."""
    frames = random_frames(8, 56, 84, seed=12)
    s = Stream(qwen, fps=FPS, options=PIXELS)
    s.append_frames(frames[:4])
    want = take_turns(s, Q)
    s.kv.trim(0)                     # no room left: the piece must move the rows to grow
    buf = s.kv.layers[0].k_buf
    sched, done = Scheduler(), threading.Event()
    seen_open = []

    piece = _piece(sched, s, frames[4:], done)

    def while_open():
        seen_open.append(s.status()["questions_open"])
        threading.Thread(target=piece).start()
        seen_open.append(done.wait(60))

    gen, seen = _blocked_question(sched, s, while_open)
    assert seen_open == [1, True]                 # the piece went in while the fork was open
    assert s.kv.layers[0].k_buf is not buf and s.frames == 8
    assert_same(gen, want, tol=1e-5)
    assert seen["seen_until"] == 2.0 and seen["frames"] == 4
    after = s.generate(Q, max_new_tokens=6)
    assert after[1]["seen_until"] == 4.0
    assert_same(after[0], one_shot(qwen, frames))


def test_a_window_drop_waits_for_the_open_questions(qwen):
    """keep="window": a piece that drops the oldest frames moves rows in place, so it waits
    for the questions reading the stream; the open question's answer is over the rows it
    forked, and the drop happens right after it."""
    frames = random_frames(8, 56, 84, seed=13)
    win = Stream(qwen, fps=FPS, options=PIXELS, keep="window")
    win.append_frames(frames[:4])
    want = take_turns(win, Q)
    head, ut = len(win.layout.head_ids), win.layout.unit_tokens
    win.budget_bytes = (head + 3 * ut + QUESTION_ROOM) * qwen.kv_bytes_per_token
    sched, done = Scheduler(), threading.Event()
    during = []

    piece = _piece(sched, win, frames[4:], done)

    def while_open():
        threading.Thread(target=piece).start()
        during.append(done.wait(1.5))        # held back by this question's fork

    gen, _ = _blocked_question(sched, win, while_open)
    assert during == [False]
    assert done.wait(60) and win.status()["window"]["dropped_frames"] == 2
    assert_same(gen, want, tol=1e-5)
    assert win.ask(Q, max_new_tokens=4).video["seen_from"] == 1.0


def test_a_stream_with_an_open_question_is_not_moved_to_the_host(qwen):
    """A stream a question reads is in use: another stream's piece that needs its device
    room does not move it to the host tier (the piece is refused for now: StreamBusy, the
    stream stays open), and the question's answer is the one over its rows; idle again, it
    moves, and the refused piece goes in."""
    frames = random_frames(6, 56, 84, seed=14)
    reg = Streams(qwen, budget_bytes=1 << 30, host_bytes=1 << 30)
    a = reg.create(fps=FPS, options=PIXELS)
    a.append_frames(frames[:4])
    want = take_turns(a, Q)
    b = reg.create(fps=FPS, options=PIXELS)
    b.append_frames(frames[:2])
    reg.budget_bytes = a.held_bytes + b.held_bytes
    b_len = b.length
    sched, refused = Scheduler(), []

    def while_open():
        try:
            b.append_frames(frames[2:4])
        except StreamBusy as e:
            refused.append(e)

    gen, _ = _blocked_question(sched, a, while_open)
    assert refused and a.status()["kv"]["tier"] == "gpu"
    assert b.state != FULL and b.length == b_len
    assert_same(gen, want, tol=1e-5)
    b.append_frames(frames[2:4])                 # a is idle now: it moves for b's piece
    assert a.status()["kv"]["where"] == "host" and b.length > b_len
    assert reg.counts["spills"] >= 1
    assert_same(a.generate(Q, max_new_tokens=8)[0], want, tol=1e-5)


@pytest.mark.parametrize("room", ["enough", "short"])
def test_a_piece_leaves_a_paused_calibration_step_its_memory_while_room_allows(
        qwen, monkeypatch, room):
    """On a device whose memory the video cache measures, a stream's piece pauses idle work
    (a calibration step) and, with room for the piece's peak, leaves it its memory: it goes
    on from the layer it stopped at. Short of room, it gives its memory up before the piece's
    vision. The room asked for covers the bytes the stream's cache grows by."""
    monkeypatch.setattr(VideoCache, "measures_room", property(lambda self: True))
    cache = qwen.video_cache
    sched, asked = Scheduler(), []
    monkeypatch.setattr(cache, "free_bytes", lambda: (1 << 40) if room == "enough" or
                        sched.idle_evictions else 0)
    real = cache.make_room
    monkeypatch.setattr(cache, "make_room", lambda need, *a, **k: asked.append(need) or
                        real(need, *a, **k))
    s = Stream(qwen, fps=FPS, options=PIXELS)
    s.append_frames(random_frames(2, seed=15))
    s.kv.trim(0)                                  # no room: the piece grows the buffers
    held = s.kv.held_bytes
    done = threading.Event()
    idle_work_around(sched, room, _piece(sched, s, random_frames(2, seed=16), done))
    assert done.is_set() and s.frames == 4
    assert asked and asked[0] >= s.kv.held_bytes - held > 0
