"""A lone reader of a kept prefix writes its rows into the prefix's tail (ForkKV
``claim=True``: mminfer.models.kv) and decodes over a cache in one piece: its logits and
greedy tokens are those of the prompt continued in place on a prefix of its own, bit for
bit, on every decode path (the lean step, the CUDA-graph plumbing replayed on the CPU, the
batched step); one claim at a time, the other readers ordinary forks that the tail's writes
never touch; the tail given back on release, when the rows outgrow it (which stays correct),
or when the fork is dropped. Tiny Qwen2.5-VL and LongVILA checkpoints, fp32 and FP8 (CPU)."""

import pytest
import torch

from mminfer.models import decode
from mminfer.models.kv import ForkKV, PrefixKV, kv_dtype, prefix_of

from conftest import write_video
from tiny_cases import prepared_pair

STEPS = 5


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("vid") / "square.mp4", n_frames=16, fps=8.0,
                       width=96, height=64, noise=True)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, mp4):
    return prepared_pair(tmp_path_factory.mktemp("ckpt"), mp4)


@pytest.fixture()
def fp8(request, prepared):
    """Set the adapters' KV cache dtype for one test (``indirect`` parameter)."""
    saved = {k: ad.kv_cache_dtype for k, (ad, _, _) in prepared.items()}
    for ad, _, _ in prepared.values():
        ad.kv_cache_dtype = kv_dtype(request.param)
    yield request.param
    for k, (ad, _, _) in prepared.items():
        ad.kv_cache_dtype = saved[k]


def _prefix(ad, prep, embeds, tail):
    """The prefix's cache with ``tail`` rows of room past it (as the video cache keeps it)."""
    return ad.prefill_prefix(prep, embeds.clone(), headroom=tail)


def _questions(ad, prep, embeds, n):
    """The suffix, and ``n - 1`` other questions: other tokens but its last rows."""
    suffix = embeds[:, prep.prefix_len:]
    emb = ad.text_model.get_input_embeddings()
    g = torch.Generator().manual_seed(3)
    out = [suffix]
    for _ in range(n - 1):
        q = suffix.clone()
        with torch.inference_mode():
            q[:, :-2] = emb(torch.randint(0, emb.num_embeddings, (1, q.shape[1] - 2),
                                          generator=g))
        out.append(q)
    return out


def _suffix(ad, prep, cache, q):
    """The question's rows over ``cache``: its last logits ``[vocab]``."""
    P = cache.get_seq_length()
    with torch.inference_mode():
        return ad.lm_head(ad._step(q, ad.positions_after(prep.rope_delta, P, q.shape[1]),
                                   cache))[0, -1]


def _answer(ad, prep, cache, q, n=STEPS):
    """The suffix, then ``n`` greedy lean steps: (logits ``[n + 1, vocab]``, tokens)."""
    dec = decode.decoder_of(ad)
    lg = [_suffix(ad, prep, cache, q)]
    toks = [int(lg[-1].argmax())]
    with torch.inference_mode():
        for _ in range(n):
            pos = ad.positions_after(prep.rope_delta, cache.get_seq_length(), 1)
            lg.append(dec.logits(torch.tensor([[toks[-1]]]), pos, cache)[0, -1])
            toks.append(int(lg[-1].argmax()))
    return torch.stack(lg), toks


def _rows(kv):
    return [(layer.keys.clone(), layer.values.clone()) for layer in kv.layers]


def _same_rows(kv, rows):
    return all(torch.equal(layer.keys, k) and torch.equal(layer.values, v)
               for layer, (k, v) in zip(kv.layers, rows))


@pytest.mark.parametrize("kind,fp8", [("qwen", None), ("longvila", None), ("qwen", "fp8")],
                         indirect=["fp8"])
def test_a_claimed_fork_decodes_as_a_cache_in_one_piece(kind, fp8, prepared):
    ad, prep, embeds = prepared[kind]
    P, S = prep.prefix_len, prep.input_ids.shape[1] - prep.prefix_len
    tail = S + STEPS + 3
    plain = _prefix(ad, prep, embeds, tail)
    ref_logits, ref = _answer(ad, prep, plain, embeds[:, P:])     # continued in place
    shared = _prefix(ad, prep, embeds, tail)
    rows = _rows(shared)
    fork = ForkKV(shared, P, headroom=2, claim=True)
    assert fork.in_tail and shared.tail_claimed
    logits, got = _answer(ad, prep, fork, embeds[:, P:])
    assert torch.equal(logits, ref_logits) and got == ref and len(set(ref)) > 1
    assert fork.in_tail and fork.held_bytes == 0          # nothing of its own
    for layer, base, mine in zip(fork.layers, shared.layers, plain.layers):
        assert prefix_of(layer.keys) is None and prefix_of(layer.values) is None
        # written in place into the prefix's buffers: the rows the plain cache holds
        assert layer.keys.data_ptr() == base.k_buf.data_ptr()
        assert torch.equal(layer.keys.view(torch.uint8), mine.keys.view(torch.uint8))
        assert layer.quantized == (fp8 == "fp8") and layer.keys.shape[-2] == P + S + STEPS
    # the prefix's own rows and length are as they were
    assert shared.length == P and _same_rows(shared, rows)
    fork.release()
    assert not fork.in_tail and not shared.tail_claimed
    fork.release()                                        # idempotent
    with pytest.raises(RuntimeError, match="gave its prefix's tail back"):
        _suffix(ad, prep, fork, embeds[:, -1:])


@pytest.mark.parametrize("kind,fp8", [("qwen", None), ("longvila", None), ("qwen", "fp8")],
                         indirect=["fp8"])
def test_one_claim_at_a_time_and_the_others_never_see_the_tail(kind, fp8, prepared):
    """Three readers of one prefix: the first claims the tail, the other two are ordinary
    forks; decoded together they are one group in the batched step (the claimed one's own
    rows those after the shared ones in the prefix's buffers), and each gives the tokens of
    its question alone. After release the next reader claims the tail again."""
    ad, prep, embeds = prepared[kind]
    P = prep.prefix_len
    questions = _questions(ad, prep, embeds, 3)
    tail = questions[0].shape[1] + STEPS + 3
    alone = [_answer(ad, prep, _prefix(ad, prep, embeds, tail), q) for q in questions]
    # each answer read its own rows: their logits differ by far more than the tolerance
    assert all((lg[0] - alone[0][0][0]).abs().max() > 1e-3 for lg, _ in alone[1:])
    shared = _prefix(ad, prep, embeds, tail)
    rows = _rows(shared)
    forks = [ForkKV(shared, P, headroom=2, claim=True) for _ in questions]
    assert [f.in_tail for f in forks] == [True, False, False]
    dec = decode.decoder_of(ad)
    tokens = []
    for (ref_logits, ref), q, fork in zip(alone, questions, forks):
        first = _suffix(ad, prep, fork, q)
        torch.testing.assert_close(first, ref_logits[0], atol=1e-4, rtol=1e-4)
        tokens.append([int(first.argmax())])
    assert decode.prefix_groups(forks) == [[0, 1, 2]]     # the claimed one among them
    with torch.inference_mode():
        for s in range(STEPS):
            pos = [ad.positions_after(prep.rope_delta, f.get_seq_length(), 1) for f in forks]
            step = dec.step_many([t[-1] for t in tokens], pos, forks)
            for t, n in zip(tokens, step.argmax(-1).tolist()):
                t.append(n)
            # each reader's logits are its own alone (the claimed one's own rows read once,
            # after the prefix: not the prefix twice)
            for j, (ref_logits, _) in enumerate(alone):
                torch.testing.assert_close(step[j].reshape(-1).float(),
                                           ref_logits[s + 1].reshape(-1).float(),
                                           atol=1e-4, rtol=1e-4)
    assert tokens == [ref for _, ref in alone]
    for fork in forks[1:]:      # the ordinary forks: their rows their own, after the prefix
        assert all(prefix_of(layer.keys) is not None for layer in fork.layers)
        assert fork.held_bytes > 0
    assert shared.length == P and _same_rows(shared, rows)
    forks[1].release()          # an ordinary fork holds no tail: nothing to give back
    assert shared.tail_claimed
    forks[0].release()
    again = ForkKV(shared, P, headroom=2, claim=True)
    assert again.in_tail
    logits, got = _answer(ad, prep, again, questions[2])
    assert got == alone[2][1]
    torch.testing.assert_close(logits, alone[2][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,fp8", [("qwen", None), ("longvila", None), ("qwen", "fp8")],
                         indirect=["fp8"])
def test_outgrowing_the_tail_moves_the_rows_into_the_forks_own(kind, fp8, prepared):
    """A tail with room for the question and two answer tokens: the third step moves the
    reader's rows into buffers of its own and gives the tail back (the next reader claims
    it); the tokens stay those of the plain cache, the logits bit for bit until then. A
    question longer than the tail never writes there."""
    ad, prep, embeds = prepared[kind]
    P, S = prep.prefix_len, prep.input_ids.shape[1] - prep.prefix_len
    ref_logits, ref = _answer(ad, prep, _prefix(ad, prep, embeds, S + STEPS), embeds[:, P:])
    shared = _prefix(ad, prep, embeds, S + 2)
    rows = _rows(shared)
    fork = ForkKV(shared, P, headroom=1, claim=True)
    logits, got = _answer(ad, prep, fork, embeds[:, P:])
    assert got == ref
    assert torch.equal(logits[:3], ref_logits[:3])        # the suffix and two steps in the tail
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert not fork.in_tail and not shared.tail_claimed and fork.held_bytes > 0
    assert fork.get_seq_length() == P + S + STEPS
    assert all(prefix_of(layer.keys) is not None and layer.keys.shape[-2] == S + STEPS
               for layer in fork.layers)
    assert shared.length == P and _same_rows(shared, rows)
    nxt = ForkKV(shared, P, headroom=1, claim=True)
    assert nxt.in_tail
    nxt.release()
    short = _prefix(ad, prep, embeds, S - 1)             # the question alone outgrows it
    fork = ForkKV(short, P, headroom=STEPS, claim=True)
    logits, got = _answer(ad, prep, fork, embeds[:, P:])
    assert got == ref and not fork.in_tail and not short.tail_claimed
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


class _Replay:
    """A captured CUDA graph's stand-in on the CPU: replay runs the segment again."""

    def __init__(self, fn):
        self.fn = fn
        fn()

    def replay(self):
        self.fn()


@pytest.mark.parametrize("fp8", [None, "fp8"], indirect=True)
def test_the_graph_step_writes_and_attends_a_claimed_fork_as_a_plain_cache(fp8, prepared,
                                                                           monkeypatch):
    """The captured step's plumbing (replayed on the CPU) on a claimed fork: its layers are
    written directly and attended as a cache in one piece (SDPA once checked, or the FP8
    kernel), with the plain cache's tokens; a tail outgrown mid-answer hands the step rows
    that carry their prefix, attended by the split path, with the same tokens."""
    ad, prep, embeds = prepared["qwen"]
    monkeypatch.setattr(decode, "_warm_up", lambda dev, fn: fn())
    monkeypatch.setattr(decode, "_capture", lambda dev, fns, pool=None: [_Replay(f)
                                                                          for f in fns])
    monkeypatch.setattr(decode.LeanDecoder, "graph_unsupported", lambda self: None)
    calls = []
    real = decode.fork_attention
    monkeypatch.setattr(decode, "fork_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    P, S = prep.prefix_len, prep.input_ids.shape[1] - prep.prefix_len
    ad._lean_decoder = None
    eos, ad.eos_token_ids = ad.eos_token_ids, ()
    try:
        outs = {}
        for name, tail in (("plain", None), ("room", S + 8), ("outgrown", S + 2)):
            kv = _prefix(ad, prep, embeds, S + 8 if tail is None else tail)
            cache = kv if tail is None else ForkKV(kv, P, headroom=2, claim=True)
            ad.decode_mode = "graph"
            outs[name] = ad.continue_on(cache, embeds[:, P:], rope_delta=prep.rope_delta,
                                        max_new_tokens=7).token_ids
            if name == "room":
                graphs = decode.decoder_of(ad)._graphs
                assert cache.in_tail and graphs.direct_slabs(cache) is not None
                assert graphs.dec._sdpa_direct is not False and calls == []
            if name == "outgrown":
                assert not cache.in_tail and len(calls) > 0
    finally:
        ad.decode_mode, ad.eos_token_ids = "auto", eos
        ad._lean_decoder = None
    assert outs["room"] == outs["plain"] == outs["outgrown"] and len(outs["plain"]) == 7


def test_the_tail_is_given_back_when_the_fork_is_dropped_and_never_claimed_over_rows():
    kv = PrefixKV(2, headroom=4)
    with torch.inference_mode():
        for layer in range(2):
            kv.update(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), layer)
    fork = ForkKV(kv, 6, claim=True)
    assert fork.in_tail and kv.tail_claimed
    with pytest.raises(RuntimeError, match="tail"):      # its reader's rows would move
        kv.truncate(3)
    with pytest.raises(RuntimeError, match="tail"):
        kv.trim(0)
    del fork                                  # dropped unreleased: the tail with it
    assert not kv.tail_claimed
    # a fork of fewer rows than the prefix holds never claims (the rows after it are the
    # prefix's), nor one of a prefix with no room past its rows
    assert not ForkKV(kv, 5, claim=True).in_tail and not kv.tail_claimed
    kv.trim(0)
    assert kv.capacity == kv.length == 6 and not ForkKV(kv, 6, claim=True).in_tail
    # a move gives the prefix new buffers and a free tail; a reader holding the old one keeps
    # the buffers it writes
    kv.move("cpu", headroom=4)
    first = ForkKV(kv, 6, claim=True)
    old = kv.layers[0].k_buf
    with torch.inference_mode():
        first.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    kv.move("cpu", headroom=4)
    assert not kv.tail_claimed and kv.layers[0].k_buf is not old
    assert first.layers[0].keys.data_ptr() == old.data_ptr() and first.in_tail
    second = ForkKV(kv, 6, claim=True)
    assert second.in_tail
    first.release()                           # gives back nothing of the new buffers'
    assert kv.tail_claimed
