"""The video cache: a question continued on a kept prefix equals the one-shot prefill of the
whole prompt; keys (a changed byte, sampling or earlier turn is a miss), tiers and eviction,
an entry in use never evicted, cancellation leaving nothing behind, multi-turn prompts."""

import shutil

import pytest
import torch

from lab.toy.tiny import save_tiny_qwen2_5_vl
from lab.toy.tiny_longvila import save_tiny_longvila
from mminfer import video as videolib
from mminfer.engine.cache import Entry, PrefixFacts, VideoCache, cache_key, file_digest
from mminfer.engine.pipeline import Pipeline
from mminfer.errors import Cancelled, InputError
from mminfer.models.base import VIDEO, Conversation, Turn
from mminfer.models.hooks import PrefillContext
from mminfer.models.kv import TAIL_ROWS, ForkKV, PrefixKV, tail_rows
from mminfer.sparse.modality import ModalityIndex

from conftest import write_video


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vc") / "tiny-qwen")


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("vid") / "square.mp4", n_frames=16, fps=8.0,
                       width=96, height=64, noise=True)


@pytest.fixture()
def pipe(qwen):
    return Pipeline(str(qwen), attention="dense", device="cpu")


def _one_shot(ad, prep, embeds, **kw):
    """The whole prompt prefilled at once (no split), greedy: the reference."""
    return ad.generate(prep, embeds=embeds.clone(), ctx=PrefillContext(mode="dense"), **kw)


def _split(ad, prep, embeds, ctx=None, **kw):
    kv = ad.prefill_prefix(prep, embeds.clone(), ctx=ctx)
    return kv, ad.continue_on(kv, embeds[:, prep.prefix_len:], rope_delta=prep.rope_delta, **kw)


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_suffix_on_a_kept_prefix_equals_the_one_shot_prefill(kind, qwen, mp4, tmp_path):
    ckpt = qwen if kind == "qwen" else save_tiny_longvila(tmp_path / "tiny-longvila")
    pipe = Pipeline(str(ckpt), attention="dense", device="cpu")
    ad = pipe.adapter
    decoded = videolib.decode(str(mp4), sampling=ad.sampling, fps=4.0,
                              max_frames=min(8, ad.frame_limit or 8))
    conv1 = Conversation.single("where does the red square move?")
    prep = ad.prepare(decoded, conv1)
    assert 0 < prep.prefix_len < prep.input_ids.shape[1]
    assert prep.prefix_index.n == prep.prefix_len
    embeds = ad.embed(prep)
    ref = _one_shot(ad, prep, embeds, max_new_tokens=6)
    kv, got = _split(ad, prep, embeds, max_new_tokens=6)
    assert torch.allclose(got.prefill_logits, ref.prefill_logits, atol=1e-4, rtol=1e-4), \
        (got.prefill_logits - ref.prefill_logits).abs().max()
    assert got.token_ids == ref.token_ids
    # the same prefix answers a second question as a fresh one-shot prefill of it would
    kv.truncate(prep.prefix_len)
    conv2 = Conversation.single("what colour is the background of this clip?")
    prep2 = ad.prepare(decoded, conv2)
    assert prep2.prefix_len == prep.prefix_len
    embeds2 = ad.embed(prep2)
    ref2 = _one_shot(ad, prep2, embeds2, max_new_tokens=6)
    got2 = ad.continue_on(kv, ad.suffix_embeds(conv2), rope_delta=prep.rope_delta,
                          max_new_tokens=6)
    assert torch.allclose(got2.prefill_logits, ref2.prefill_logits, atol=1e-4, rtol=1e-4)
    assert got2.token_ids == ref2.token_ids


def test_a_second_question_hits_and_answers_as_a_fresh_prefill(pipe, mp4):
    q1, q2 = "where does the red square move?", "is the background blue?"
    a = pipe.answer(mp4, q1, fps=4.0, max_new_tokens=5)
    b = pipe.answer(mp4, q2, fps=4.0, max_new_tokens=5)
    c = pipe.answer(mp4, q1, fps=4.0, max_new_tokens=5)
    fresh = pipe.answer(mp4, q2, fps=4.0, max_new_tokens=5, use_cache=False)
    assert (a.cache, b.cache, c.cache, fresh.cache) == ("miss", "hit", "hit", "off")
    assert b.answer == fresh.answer and c.answer == a.answer
    assert b.tokens["cached"] > 0 and b.tokens["total"] == fresh.tokens["total"]
    assert b.tokens["cached"] + 1 < b.tokens["total"] and a.tokens["cached"] == 0
    # a hit skips decode, vision and the prefix's prefill
    t = b.timings_ms
    assert t["decode"] == t["vision"] == t["llm_other"] == 0 and t["suffix"] > 0
    assert a.timings_ms["vision"] > 0 and a.video["sha256"] == b.video["sha256"]
    s = pipe.video_cache.stats()
    assert (s["queries"], s["hits"], s["misses"], s["gpu_entries"]) == (3, 2, 1, 1)
    assert s["gpu_bytes"] > 0


def test_what_changes_the_prefix_is_a_miss(pipe, mp4, tmp_path):
    q = "where does the red square move?"
    assert pipe.answer(mp4, q, fps=4.0, max_new_tokens=2).cache == "miss"
    # the same bytes under another name: a hit (the key is the content, not the path)
    same = tmp_path / "copy.mp4"
    shutil.copy(mp4, same)
    assert pipe.answer(same, q, fps=4.0, max_new_tokens=2).cache == "hit"
    # one byte more: another video
    changed = tmp_path / "changed.mp4"
    changed.write_bytes(mp4.read_bytes() + b"\0")
    assert file_digest(changed) != file_digest(mp4)
    assert pipe.answer(changed, q, fps=4.0, max_new_tokens=2).cache == "miss"
    # sampling, the frame cap, the window, the attention mode: other prefixes
    assert pipe.answer(mp4, q, fps=2.0, max_new_tokens=2).cache == "miss"
    assert pipe.answer(mp4, q, fps=4.0, max_frames=4, max_new_tokens=2).cache == "miss"
    assert pipe.answer(mp4, q, fps=4.0, start=0.5, max_new_tokens=2).cache == "miss"
    # a system prompt changes the prefix; later turns do not
    sys_conv = Conversation((Turn("system", ("Be terse.",)), Turn("user", (VIDEO, q))))
    assert pipe.answer(mp4, conversation=sys_conv, fps=4.0, max_new_tokens=2).cache == "miss"
    follow = Conversation((*sys_conv.turns, Turn("assistant", ("right",)),
                           Turn("user", ("and then?",))))
    r = pipe.answer(mp4, conversation=follow, fps=4.0, max_new_tokens=2)
    assert r.cache == "hit"


def test_a_file_rewritten_in_place_is_hashed_again(tmp_path, mp4):
    p = tmp_path / "v.mp4"
    p.write_bytes(mp4.read_bytes())
    d1 = file_digest(p)
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))          # same size, same path
    assert file_digest(p) != d1


def test_multi_turn_prompt_holds_every_turn(pipe, mp4):
    q = "where does the red square move?"
    one = pipe.answer(mp4, q, fps=4.0, max_new_tokens=2)
    conv = Conversation((Turn("system", ("You watch videos.",)),
                         Turn("user", (VIDEO, q)), Turn("assistant", ("to the right",)),
                         Turn("user", ("how fast?",))))
    many = pipe.answer(mp4, conversation=conv, fps=4.0, max_new_tokens=2)
    ad = pipe.adapter
    prefix, suffix = ad.split_prompt(conv, 7)
    ids = prefix + suffix

    def at(piece):          # where the piece's tokens sit, in order, in the prompt
        p = ad.tokenizer(piece, add_special_tokens=False)["input_ids"]
        starts = [i for i in range(len(ids)) if ids[i:i + len(p)] == p]
        assert starts, piece
        return starts[0]

    assert at("You watch videos.") < len(prefix) - 7          # the system turn: prefix
    assert len(prefix) <= at(q) < at("to the right") < at("how fast?")   # the rest: suffix
    assert many.tokens["total"] > one.tokens["total"]


def test_conversation_checks():
    with pytest.raises(InputError, match="no video"):
        Conversation((Turn("user", ("hi",)),)).validate()
    with pytest.raises(InputError, match="exactly one video"):
        Conversation((Turn("user", (VIDEO, "a")), Turn("assistant", ("b",)),
                      Turn("user", (VIDEO, "c")))).validate()
    with pytest.raises(InputError, match="last message"):
        Conversation((Turn("user", (VIDEO, "a")), Turn("assistant", ("b",)))).validate()
    with pytest.raises(InputError, match="system"):
        Conversation((Turn("user", (VIDEO, "a")), Turn("system", ("b",)),
                      Turn("user", ("c",)))).validate()


def test_host_tier_spill_and_restore(qwen, mp4, tmp_path):
    pipe = Pipeline(str(qwen), attention="dense", device="cpu")
    q = "where does the red square move?"
    other = write_video(tmp_path / "other.mp4", n_frames=12, fps=8.0, width=96, height=64)
    a = pipe.answer(mp4, q, fps=4.0, max_new_tokens=3)
    size = pipe.video_cache.stats()["gpu_bytes"]
    # room for one entry on the device and one on the host (two while a restore's host
    # copy still counts, as the entry it brings back spills the other one)
    pipe.video_cache.gpu_budget = int(size * 1.5)
    pipe.video_cache.host_budget = int(size * 2.5)
    assert pipe.answer(other, q, fps=4.0, max_new_tokens=3).cache == "miss"
    assert pipe.video_cache.settle(30)          # the spill's copy to the host has landed
    s = pipe.video_cache.stats()
    assert (s["gpu_entries"], s["host_entries"], s["evictions_gpu"]) == (1, 1, 1)
    back = pipe.answer(mp4, q, fps=4.0, max_new_tokens=3)
    assert back.cache == "host" and back.answer == a.answer
    assert pipe.video_cache.settle(30)
    s = pipe.video_cache.stats()
    assert s["host_hits"] == 1 and s["gpu_entries"] == 1 and s["host_entries"] == 1
    # no host tier: the least recently used is dropped, and is a miss again
    pipe.video_cache.host_budget = 0
    pipe.video_cache.clear()
    pipe.answer(mp4, q, fps=4.0, max_new_tokens=3)
    pipe.answer(other, q, fps=4.0, max_new_tokens=3)
    assert pipe.video_cache.stats()["gpu_entries"] == 1
    assert pipe.answer(mp4, q, fps=4.0, max_new_tokens=3).cache == "miss"


def _entry(n_tokens):
    kv = PrefixKV(2, headroom=0)
    for layer in range(2):
        kv.update(torch.randn(1, 2, n_tokens, 8), torch.randn(1, 2, n_tokens, 8), layer)
    return Entry(kv=kv, length=n_tokens, rope_delta=0,
                 index=ModalityIndex.from_segments([("text", n_tokens)]),
                 facts=PrefixFacts(attention="dense", visual_tokens=0, video={}))


def test_an_entry_in_use_is_never_evicted():
    one = _entry(16).kv.nbytes
    cache = VideoCache("cpu", gpu_bytes=int(one * 1.5), host_bytes=0)
    k1, k2, k3 = (cache_key(v=i) for i in range(3))
    with cache.use(k1) as slot:
        slot.store(_entry(16))
    with cache.use(k1) as slot:                 # being read ...
        assert slot.status == "hit"
        with cache.use(k2) as other:            # ... while another prefix is built
            other.store(_entry(16))
        assert slot.entry.kv is not None and slot.entry.kv.length == 16
        assert cache.stats()["gpu_entries"] == 2       # over budget, but k1 is pinned
    with cache.use(k3) as slot:                 # the next insert evicts the idle LRU (k1)
        slot.store(_entry(16))
    with cache.use(k1) as slot:
        assert slot.status == "miss"


def test_an_entry_over_the_budget_is_served_not_kept():
    cache = VideoCache("cpu", gpu_bytes=10, host_bytes=0)
    with cache.use(cache_key(v=1)) as slot:
        slot.store(_entry(16))
        assert slot.entry.kv is not None
    assert cache.stats()["gpu_entries"] == 0 and cache.stats()["rejected"] == 1


def test_an_entry_holds_its_prefix_and_tail_and_questions_never_change_its_rows(pipe, mp4):
    pipe.answer(mp4, "where does the red square move?", fps=4.0, max_new_tokens=4)
    (entry,) = pipe.video_cache._entries.values()
    # the prefix's rows and its tail, charged: its builder's question wrote into the tail
    # through a fork, and gave it back
    room = tail_rows(entry.length)
    assert 0 < room <= TAIL_ROWS
    assert entry.kv.length == entry.length and entry.kv.capacity == entry.length + room
    assert entry.nbytes == entry.kv.held_bytes == entry.kv.bytes_at(entry.length + room)
    reads = pipe.video_cache.counts["tail_reads"]
    assert reads >= 1 and not entry.kv.tail_claimed
    rows = [layer.keys.clone() for layer in entry.kv.layers]
    nbytes = entry.nbytes
    assert pipe.answer(mp4, "and the colour?", fps=4.0, max_new_tokens=4).cache == "hit"
    assert entry.kv.length == entry.length and entry.kv.capacity == entry.length + room
    assert entry.nbytes == nbytes and not entry.kv.tail_claimed
    assert pipe.video_cache.counts["tail_reads"] == reads + 1
    assert all(torch.equal(layer.keys, r) for layer, r in zip(entry.kv.layers, rows))


def test_questions_on_a_cached_video_decode_in_its_tail_one_at_a_time(pipe, mp4):
    """The builder's question and each hit's claim the entry's tail (they decode over a
    cache in one piece) and give it back when they end, cancelled too; a hit asked while
    another reader holds the tail decodes through an ordinary fork. Every time the same
    answer."""
    q = "where does the red square move?"
    counts = pipe.video_cache.counts
    reads = counts["tail_reads"]
    first = pipe.answer(mp4, q, fps=4.0, max_new_tokens=6)
    (entry,) = pipe.video_cache._entries.values()
    kv = entry.kv
    assert first.cache == "miss" and counts["tail_reads"] == reads + 1
    assert not kv.tail_claimed
    again = pipe.answer(mp4, q, fps=4.0, max_new_tokens=6)
    assert again.cache == "hit" and counts["tail_reads"] == reads + 2
    assert not kv.tail_claimed
    assert again.answer == first.answer and again.tokens["generated"] == \
        first.tokens["generated"]
    holder = ForkKV(kv, entry.length, claim=True)          # another reader's answer
    assert holder.in_tail and kv.tail_claimed
    other = pipe.answer(mp4, q, fps=4.0, max_new_tokens=6)
    assert other.cache == "hit" and counts["tail_reads"] == reads + 2 and kv.tail_claimed
    assert other.answer == first.answer
    holder.release()
    tokens = []
    with pytest.raises(Cancelled):
        pipe.answer(mp4, q, fps=4.0, max_new_tokens=6, on_token=lambda t, i: tokens.append(i),
                    cancel=lambda: len(tokens) > 1)
    assert counts["tail_reads"] == reads + 3 and not kv.tail_claimed and len(tokens) == 2
    assert pipe.answer(mp4, q, fps=4.0, max_new_tokens=6).answer == first.answer
    assert counts["tail_reads"] == reads + 4 and not kv.tail_claimed


def test_cancel_mid_prefill_leaves_nothing(pipe, mp4):
    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        return calls["n"] > 4               # past the stages, inside the prefill's layers

    with pytest.raises(Cancelled):
        pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2, cancel=cancel)
    s = pipe.video_cache.stats()
    assert s["gpu_entries"] == 0 and s["misses"] == 1
    assert pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2).cache == "miss"
    assert pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2).cache == "hit"


def test_cache_off(qwen, mp4):
    pipe = Pipeline(str(qwen), attention="dense", device="cpu", kv_cache_gb=0)
    assert pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2).cache == "off"
    assert pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2).cache == "off"
    assert pipe.video_cache.stats()["queries"] == 0


DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "data"


def test_sparse_prefix_plumbing_equals_the_one_shot_prefill():
    """Sparse prefix (Triton kernels under the interpreter, the prefix's own ModalityIndex,
    K/V views of the PrefixKV buffers) + dense suffix: with head patterns whose budgets cover
    every pair, the one-shot dense prefill of the whole prompt, in fp32; with a small budget,
    a real sparse prefill (density < 1) whose kept prefix answers a second time the same."""
    from mminfer.sparse.patterns import HeadPatternConfig
    pipe = Pipeline(None, attention="sparse", device="cpu", min_sparse_len=0)
    ad = pipe.adapter
    needle = DATA.parents[1] / "samples" / "videos" / "needle_0.mp4"     # 183 tokens
    decoded = videolib.decode(str(needle), sampling=ad.sampling, fps=2.0, max_frames=768)
    conv = Conversation.single("What number appears in the video?")
    prep = ad.prepare(decoded, conv)
    embeds = ad.embed(prep)
    ref = _one_shot(ad, prep, embeds, max_new_tokens=3)
    for config, exact in (("embedded_dense_equivalent.json", True),
                          ("embedded_tiny_budget.json", False)):
        patterns = HeadPatternConfig.load(DATA / config, expect=ad.identity)
        ctx = PrefillContext(index=prep.prefix_index, patterns=patterns, mode="sparse",
                             min_sparse_len=0, unavailable=pipe.sparse_unavailable,
                             keep_plans=True)
        kv, got = _split(ad, prep, embeds, ctx=ctx, max_new_tokens=3)
        assert ctx.sparse and ctx.densities
        assert all(p.n == prep.prefix_len for p in ctx.densities.values())
        if exact:
            assert torch.allclose(got.prefill_logits, ref.prefill_logits, atol=1e-4), \
                (got.prefill_logits - ref.prefill_logits).abs().max()
            assert got.token_ids == ref.token_ids
        else:
            dens = [p.density()["logical"] for p in ctx.densities.values()]
            assert max(dens) < 0.9, dens
            kv.truncate(prep.prefix_len)
            again = ad.continue_on(kv, embeds[:, prep.prefix_len:], rope_delta=prep.rope_delta,
                                   max_new_tokens=3)
            assert torch.equal(again.prefill_logits, got.prefill_logits)
            # a fork of the sparse prefix (what the pipeline's questions read) answers so too
            kv.truncate(prep.prefix_len)
            fork = ForkKV(kv, prep.prefix_len, headroom=3)
            forked = ad.continue_on(fork, embeds[:, prep.prefix_len:],
                                    rope_delta=prep.rope_delta, max_new_tokens=3)
            torch.testing.assert_close(forked.prefill_logits, got.prefill_logits, atol=1e-4,
                                       rtol=1e-4)
            assert forked.token_ids == got.token_ids and kv.length == prep.prefix_len


def test_a_conversation_survives_pickling():
    """Tensor-parallel ranks and workers receive requests pickled: VIDEO stays the one VIDEO."""
    import pickle
    conv = Conversation((Turn("system", ("s",)), Turn("user", ("look", VIDEO, "q"))))
    back = pickle.loads(pickle.dumps(conv))
    assert back == conv and back.turns[1].parts[1] is VIDEO
    assert back.validate().prefix_digest() == conv.prefix_digest()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_continuation_attention_on_the_gpu(dtype):
    """The question's rows over a cached prefix on CUDA (SDPA's lower-right causal bias, GQA
    by index, K/V as views of larger buffers) against fp32 attention with the mask written
    out, at a 7B head shape."""
    from mminfer.models.hooks import continuation_attention
    g = torch.Generator(device="cuda").manual_seed(0)
    H, Hkv, D, P, S, cap = 28, 4, 128, 5003, 37, 6000
    q = torch.randn(1, H, S, D, device="cuda", generator=g).to(dtype)
    kb = torch.randn(1, Hkv, cap, D, device="cuda", generator=g).to(dtype)
    vb = torch.randn(1, Hkv, cap, D, device="cuda", generator=g).to(dtype)
    k, v = kb[:, :, :P + S], vb[:, :, :P + S]            # views, as a PrefixKV hands them
    out = continuation_attention(q, k, v, D ** -0.5)      # [1, S, H, D]
    kr, vr = (t.float().repeat_interleave(H // Hkv, 1) for t in (k, v))
    s = (q.float() @ kr.transpose(-1, -2)) * D ** -0.5
    rows = torch.arange(P, P + S, device="cuda")[:, None]
    s = s.masked_fill(torch.arange(P + S, device="cuda")[None, :] > rows, float("-inf"))
    ref = (s.softmax(-1) @ vr).transpose(1, 2)
    err = (out.float() - ref).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_kept_prefix_answers_as_the_one_shot_prefill_on_the_gpu(qwen, mp4):
    """bf16 on CUDA: a question continued on a kept prefix gives the one-shot prefill's greedy
    tokens and nearly its logits; a hit answers as the miss that built the prefix."""
    pipe = Pipeline(str(qwen), attention="dense", device="cuda")
    ad = pipe.adapter
    decoded = videolib.decode(str(mp4), sampling=ad.sampling, fps=4.0, max_frames=8)
    prep = ad.prepare(decoded, Conversation.single("where does the red square move?"))
    embeds = ad.embed(prep)
    ref = _one_shot(ad, prep, embeds, max_new_tokens=6)
    kv, got = _split(ad, prep, embeds, max_new_tokens=6)
    assert got.token_ids == ref.token_ids
    assert torch.allclose(got.prefill_logits.float(), ref.prefill_logits.float(), atol=5e-2)
    a = pipe.answer(mp4, "where does the red square move?", fps=4.0, max_new_tokens=6)
    b = pipe.answer(mp4, "where does the red square move?", fps=4.0, max_new_tokens=6)
    assert (a.cache, b.cache, a.answer) == ("miss", "hit", b.answer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_prefill_stays_within_the_room_it_asks_for(tmp_path, kv_cache_dtype):
    """What a new prefill asks the video cache to free (Pipeline.prefill_bytes) covers what it
    holds at its peak on the GPU, and not by a wide margin (a 7B-like width, 40K tokens)."""
    from mminfer.models.kv import PrefixKV
    from mminfer.models.prefill import prefill
    path = save_tiny_qwen2_5_vl(tmp_path / "wide", hidden=896, layers=2, heads=7, kv_heads=1,
                                max_position_embeddings=65536)
    pipe = Pipeline(str(path), attention="dense", device="cuda")
    pipe.kv_cache_dtype = kv_cache_dtype
    ad, n = pipe.adapter, 40000
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    embeds = torch.randn(1, n, 896, device="cuda", dtype=pipe.dtype)
    kv = PrefixKV.for_model(ad.text_model, 0, dtype=ad.kv_cache_dtype)
    prefill(ad.text_model, embeds, kv, kv_only_last=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    want = pipe.prefill_bytes(n)
    assert peak <= want, (peak, want)
    assert peak >= 0.5 * want, (peak, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_warm_up_captures_the_batched_decode_steps(qwen, mp4):
    """A server's warm-up (batch = --max-num-seqs) captures every batch size its batches use,
    so no request stalls for a capture; a batch then replays them with each answer's own
    tokens."""
    from mminfer.models.decode import decoder_of
    pipe = Pipeline(str(qwen), attention="dense", device="cuda")
    warm = pipe.warmup(batch=6)
    assert warm["batch_graphs"] == [2, 4, 8]
    assert sorted(size for size, _ in decoder_of(pipe.adapter)._batch) == [2, 4, 8]
