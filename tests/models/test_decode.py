"""The lean decode step (mminfer.models.decode): the same greedy tokens and the same cache rows as
the text model's own forward (``Adapter._step``) on tiny Qwen2.5-VL and LongVILA checkpoints
(CPU, fp32); the loop's cancel / streaming semantics through ``continue_on``; which path runs
where; and on a GPU (bf16) the CUDA-graph replay against the eager lean step and ``_step``."""

import pytest
import torch

from mminfer.errors import Cancelled
from mminfer.models import decode
from mminfer.models.base import Adapter
from mminfer.models.kv import ForkKV, PrefixKV, kv_dtype
from mminfer.models.sampler import SamplingParams

from conftest import write_video
from tiny_cases import prepared_pair


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("vid") / "square.mp4", n_frames=16, fps=8.0,
                       width=96, height=64, noise=True)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, mp4):
    """kind -> (adapter, Prepared, embeds) of one question on the tiny checkpoint."""
    return prepared_pair(tmp_path_factory.mktemp("ckpt"), mp4)


def _answer(ad, prep, embeds, mode, *, headroom=None, n=14, **kw):
    """prefix prefill + continue_on with decode ``mode``; end tokens off so every step runs."""
    kv = ad.prefill_prefix(prep, embeds.clone(), headroom=headroom)
    ad.decode_mode, eos = mode, ad.eos_token_ids
    ad.eos_token_ids = ()
    try:
        got = ad.continue_on(kv, embeds[:, prep.prefix_len:], rope_delta=prep.rope_delta,
                             max_new_tokens=n, **kw)
    finally:
        ad.decode_mode, ad.eos_token_ids = "auto", eos
    return kv, got


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_lean_step_decodes_as_the_models_forward(kind, prepared):
    ad, prep, embeds = prepared[kind]
    # a small headroom: the slab grows during the answer
    kv_ref, ref = _answer(ad, prep, embeds, "step", headroom=3)
    kv, got = _answer(ad, prep, embeds, "lean", headroom=3)
    assert decode.choose_path(ad) == "lean"              # CPU: no graphs
    assert len(ref.token_ids) == 14 and len(set(ref.token_ids)) > 1
    assert got.token_ids == ref.token_ids
    # the rows written by the decode steps (positions, rotary, K/V) are the forward's
    n = kv_ref.get_seq_length()
    assert kv.get_seq_length() == n == prep.input_ids.shape[1] + 13
    for a, b in zip(kv.layers, kv_ref.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, seed=3)])
def test_a_stepper_decodes_as_the_loop(kind, sampling, prepared):
    """The loop the server runs (each step through a stepper: step_batch, as the scheduler's
    batch of one) gives the loop's own tokens and writes the same cache rows: every step at
    its own position."""
    ad, prep, embeds = prepared[kind]
    steps = []

    def stepper(token, pos, cache, logits):
        steps.append(token)
        return decode.step_batch(ad, [(token, pos, cache, logits)])[0]

    kv_ref, ref = _answer(ad, prep, embeds, "lean", headroom=3, sampling_params=sampling)
    kv, got = _answer(ad, prep, embeds, "lean", headroom=3, sampling_params=sampling,
                      stepper=stepper)
    assert got.token_ids == ref.token_ids and len(steps) == 13
    assert kv.get_seq_length() == kv_ref.get_seq_length()
    for a, b in zip(kv.layers, kv_ref.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_lean_step_logits_track_the_forward_step_by_step(prepared):
    """Each lean step's token is the argmax of the forward's logits at that step, and a wrong
    position would show: the step takes the positions the adapter gives."""
    ad, prep, embeds = prepared["qwen"]
    kv = ad.prefill_prefix(prep, embeds.clone())
    kv2 = ad.prefill_prefix(prep, embeds.clone())
    suffix = embeds[:, prep.prefix_len:]
    P, S = prep.prefix_len, suffix.shape[1]
    with torch.inference_mode():
        for cache in (kv, kv2):
            ad._step(suffix, ad.positions_after(prep.rope_delta, P, S), cache)
        dec = decode.decoder_of(ad)
        token = torch.tensor([[7]])
        for i in range(5):
            pos = ad.positions_after(prep.rope_delta, P + S + i, 1)
            logits = ad.lm_head(ad._step(ad.text_model.get_input_embeddings()(token), pos, kv))
            lean = dec.step(token, pos, kv2)
            assert lean.shape == (1, 1) and int(lean) == int(logits.argmax(-1))
            token = lean
        # off by one position: other keys in the cache
        shifted = ad.positions_after(prep.rope_delta, P + S + 6, 1)
        dec.step(token, shifted, kv2)
        ad._step(ad.text_model.get_input_embeddings()(token),
                 ad.positions_after(prep.rope_delta, P + S + 5, 1), kv)
    assert not torch.allclose(kv.layers[0].keys[..., -1, :], kv2.layers[0].keys[..., -1, :])
    torch.testing.assert_close(kv.layers[0].keys[..., :-1, :], kv2.layers[0].keys[..., :-1, :],
                               atol=1e-5, rtol=1e-5)


def test_cancel_is_checked_before_every_step_and_streaming_adds_up(prepared):
    ad, prep, embeds = prepared["qwen"]
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) == 4

    with pytest.raises(Cancelled, match="after 4 answer tokens"):
        _answer(ad, prep, embeds, "lean", cancel=cancel)
    assert len(calls) == 4
    texts, ids = [], []
    _, got = _answer(ad, prep, embeds, "lean", n=8,
                     on_token=lambda t, i: (texts.append(t), ids.append(i)))
    assert ids[:-1] == got.token_ids or ids == got.token_ids
    assert "".join(texts) == got.text
    # max_new_tokens=1: the suffix's token alone, no step
    _, one = _answer(ad, prep, embeds, "lean", n=1)
    assert one.token_ids == got.token_ids[:1]


def test_path_choice(prepared):
    ad, *_ = prepared["qwen"]
    assert decode.choose_path(ad, "auto") == "lean"
    assert decode.choose_path(ad, "step") == "step"
    with pytest.raises(ValueError, match="CUDA"):
        decode.choose_path(ad, "graph")
    with pytest.raises(ValueError, match="decode mode"):
        decode.choose_path(ad, "fast")
    # a sliding-window layer: the model's own forward
    attn = ad.text_model.layers[0].self_attn
    old = getattr(attn, "sliding_window", None)
    attn.sliding_window = 16
    ad._lean_decoder = None
    try:
        assert decode.choose_path(ad) == "step"
        with pytest.raises(ValueError, match="sliding"):
            decode.choose_path(ad, "lean")
    finally:
        attn.sliding_window = old
        ad._lean_decoder = None


class _Replay:
    """A stand-in for a captured CUDA graph on the CPU: replay runs the segment again. The
    segments read their inputs through the StepGraphs' attributes at call time, as a graph
    reads them at their captured addresses, so this checks the plumbing (static token and
    position, the residual chain, q/k/v handed to the host, the attention buffer)."""

    def __init__(self, fn):
        self.fn = fn
        fn()

    def replay(self):
        self.fn()


def _replayed(dev, fns, pool=None):
    return [_Replay(f) for f in fns]


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_graph_plumbing_replayed_on_the_cpu(kind, prepared, monkeypatch):
    from transformers import DynamicCache
    from mminfer.models.prefill import prefill
    ad, prep, embeds = prepared[kind]
    monkeypatch.setattr(decode, "_warm_up", lambda dev, fn: fn())
    monkeypatch.setattr(decode, "_capture", _replayed)
    monkeypatch.setattr(decode.LeanDecoder, "graph_unsupported", lambda self: None)
    ad._lean_decoder = None
    try:
        assert decode.choose_path(ad) == "graph"
        # a PrefixKV: rows written and attended directly (the check holds on the CPU)
        kv_ref, ref = _answer(ad, prep, embeds, "lean", headroom=3)
        kv, got = _answer(ad, prep, embeds, "graph", headroom=3)
        graphs = decode.decoder_of(ad)._graphs
        assert graphs is not None and graphs.dec._sdpa_direct is True
        assert got.token_ids == ref.token_ids
        for a, b in zip(kv.layers, kv_ref.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(a.values, b.values, atol=1e-6, rtol=1e-6)
        # a DynamicCache: through cache.update and the attention function; the same capture
        L = prep.input_ids.shape[1]
        outs, caches = {}, {}
        for mode in ("lean", "graph"):
            cache = DynamicCache()
            with torch.inference_mode():
                first = int(prefill(ad.text_model, embeds.clone(), cache, ad.positions(prep, 0, L),
                                    lm_head=ad.lm_head).argmax(-1))
            eos, ad.eos_token_ids = ad.eos_token_ids, ()
            try:
                outs[mode] = decode.decode_loop(ad, cache, [first], rope_delta=prep.rope_delta,
                                                max_new_tokens=9, mode=mode)
            finally:
                ad.eos_token_ids = eos
            caches[mode] = cache
        assert decode.decoder_of(ad)._graphs is graphs
        assert outs["graph"] == outs["lean"] and len(outs["lean"]) == 9
        for a, b in zip(caches["graph"].layers, caches["lean"].layers):
            assert a.keys.shape[-2] == L + 8
            torch.testing.assert_close(a.keys, b.keys, atol=1e-6, rtol=1e-6)
    finally:
        ad._lean_decoder = None


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_sampling_and_logprobs_on_every_path(kind, prepared, monkeypatch):
    """Every decode path hands the sampler its logits: greedy with logprobs keeps the greedy
    tokens, a seed gives the same sampled tokens on each path (the graph path feeds the
    sampler's token back, not its own argmax), and ``generate`` (one-shot prefill) samples
    through the same loop as ``continue_on``."""
    ad, prep, embeds = prepared[kind]
    monkeypatch.setattr(decode, "_warm_up", lambda dev, fn: fn())
    monkeypatch.setattr(decode, "_capture", _replayed)
    monkeypatch.setattr(decode.LeanDecoder, "graph_unsupported", lambda self: None)
    ad._lean_decoder = None
    lp = SamplingParams(logprobs=True, top_logprobs=2)
    hot = SamplingParams(temperature=1.5, seed=99)
    try:
        runs = {}
        for mode in ("step", "lean", "graph"):
            _, greedy = _answer(ad, prep, embeds, mode)
            kv, logged = _answer(ad, prep, embeds, mode, sampling_params=lp)
            _, sampled = _answer(ad, prep, embeds, mode, sampling_params=hot)
            _, again = _answer(ad, prep, embeds, mode, sampling_params=hot)
            assert logged.token_ids == greedy.token_ids and greedy.logprobs is None
            assert len(logged.logprobs) == len(logged.token_ids) == 14
            for entry in logged.logprobs:         # greedy: the chosen token is the top one
                assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
                assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
            assert sampled.token_ids == again.token_ids != greedy.token_ids
            runs[mode] = (greedy, logged, sampled)
        assert decode.decoder_of(ad)._graphs is not None
        for mode in ("lean", "graph"):
            assert runs[mode][0].token_ids == runs["step"][0].token_ids
            assert runs[mode][2].token_ids == runs["step"][2].token_ids
            for a, b in zip(runs[mode][1].logprobs, runs["step"][1].logprobs):
                assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        # the one-shot prefill answers through the same loop and sampler
        ad.decode_mode, eos, ad.eos_token_ids = "lean", ad.eos_token_ids, ()
        try:
            whole = ad.generate(prep, embeds=embeds.clone(), max_new_tokens=14,
                                sampling_params=hot)
        finally:
            ad.decode_mode, ad.eos_token_ids = "auto", eos
        assert whole.token_ids == runs["lean"][2].token_ids
    finally:
        ad._lean_decoder = None


def test_a_stop_string_ends_the_answer(prepared):
    ad, prep, embeds = prepared["qwen"]
    _, full = _answer(ad, prep, embeds, "lean", n=24)
    assert full.finish_reason == "length" and len(full.text) > 6
    stop = full.text[3:5]                    # from inside the answer, across tokens or not
    texts = []
    _, cut = _answer(ad, prep, embeds, "lean", n=24, on_token=lambda t, i: texts.append(t),
                     sampling_params=SamplingParams(stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)].strip()
    assert "".join(texts) == cut.text and stop not in cut.text
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    assert len(cut.token_ids) < len(full.token_ids)    # decoding ended there


def test_a_failed_capture_decodes_eagerly(prepared, monkeypatch, caplog):
    ad, prep, embeds = prepared["qwen"]

    def refuse(dev, fns):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode, "_warm_up", lambda dev, fn: fn())
    monkeypatch.setattr(decode, "_capture", refuse)
    monkeypatch.setattr(decode.LeanDecoder, "graph_unsupported", lambda self: self._graph_failed)
    ad._lean_decoder = None
    try:
        assert decode.choose_path(ad) == "graph"
        _, ref = _answer(ad, prep, embeds, "lean")
        with caplog.at_level("WARNING", logger="mminfer.models.decode"):
            _, got = _answer(ad, prep, embeds, "auto")
        assert got.token_ids == ref.token_ids
        assert "capture failed" in caplog.text
        assert decode.choose_path(ad) == "lean"          # not tried again
        with pytest.raises(ValueError, match="capture failed"):
            decode.choose_path(ad, "graph")
    finally:
        ad._lean_decoder = None


# ------------------------------------------------------------------------------ GPU
class _Bare(Adapter):
    """An adapter around a bare text model (no tokenizer, no vision): what decode_loop needs."""

    def __init__(self, text_model, lm_head, mrope):
        self.text_model, self.lm_head, self.mrope = text_model, lm_head, mrope
        self.eos_token_ids = ()
        self.device = lm_head.weight.device

    def positions_after(self, rope_delta, start, length):
        if not self.mrope:
            return None
        p = torch.arange(start, start + length, device=self.device) + int(rope_delta)
        return p.view(1, 1, -1).expand(3, 1, -1)


def _small_gpu_model(kind):
    from mminfer.models import hooks
    dev, dt = torch.device("cuda"), torch.bfloat16
    sizes = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                 rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if kind == "qwen":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
        cfg = Qwen2_5_VLConfig(text_config=dict(
            **sizes, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                      "mrope_section": [4, 6, 6]},
            tie_word_embeddings=False)).text_config
        with dev:
            tm = m.Qwen2_5_VLTextModel._from_config(cfg, dtype=dt,
                                                     attn_implementation=hooks.register())
            head = torch.nn.Linear(256, 512, bias=False, dtype=dt)
        return tm.eval(), head
    from mminfer.models.longvila import longvila_7b_llm_config, random_llm
    lm = random_llm(longvila_7b_llm_config(**sizes), device=dev, dtype=dt)
    return lm.model, lm.lm_head


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_graph_replay_decodes_as_the_eager_step_on_cuda(kind):
    from mminfer.models.prefill import prefill
    tm, head = _small_gpu_model(kind)
    ad = _Bare(tm, head, mrope=kind == "qwen")
    assert decode.choose_path(ad) == "graph"
    results = {}
    with torch.inference_mode():
        # two caches, one capture: a PrefixKV (written and attended directly where that is
        # bit for bit the attention function) and a DynamicCache (through cache.update)
        for n in (3000, 1234):
            g = torch.Generator(device="cuda").manual_seed(n)
            embeds = torch.randn(1, n, 256, device="cuda", dtype=torch.bfloat16, generator=g)
            if n == 3000:
                kv = PrefixKV.for_model(tm, headroom=8)       # grows during the answer
            else:
                from transformers import DynamicCache
                kv = DynamicCache()
                kv.truncate = kv.crop
            pos = ad.positions_after(5, 0, n) if ad.mrope else None
            prefill(tm, embeds, kv, pos, kv_only_last=True)
            first = int(torch.randint(0, 512, (1,), generator=g, device="cuda"))
            for mode in ("step", "lean", "graph", "graph"):
                out = decode.decode_loop(ad, kv, [first], rope_delta=5, max_new_tokens=40,
                                         mode=mode)
                assert kv.get_seq_length() == n + 39
                # the rows the answer wrote: every layer's input, positions and rotary
                rows = [(layer.keys[..., n:, :].clone(), layer.values[..., n:, :].clone())
                        for layer in kv.layers]
                results.setdefault(n, {}).setdefault(mode, []).append((out, rows))
                kv.truncate(n)
    assert decode.decoder_of(ad)._graphs is not None
    for n, r in results.items():
        ref, ref_rows = r["step"][0]
        assert len(ref) == 40
        for mode, i in (("lean", 0), ("graph", 0), ("graph", 1)):
            got, rows = r[mode][i]
            assert got == ref, (n, mode, i, got, ref)
            for (k, v), (k0, v0) in zip(rows, ref_rows):
                torch.testing.assert_close(k, k0, atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(v, v0, atol=2e-2, rtol=2e-2)


def test_benchmark_tiny_run(tmp_path):
    """benchmarks/decode_step.py --tiny: every path's time, the same greedy tokens, and its
    split-K kernel (under the Triton interpreter) equal to SDPA."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "decode.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "decode_step.py"), "--tiny",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["modes"] == ["step", "lean"] and "CUDA" in rep["graph"]
    assert [r["n"] for r in rep["rows"]] == [300, 700]
    for r in rep["rows"]:
        assert r["step_ms"] > 0 and r["lean_ms"] > 0 and r["kv_bytes"] > 0
        # a lone question's fork in the prefix's tail decodes as the cache in one piece
        assert r["same_tokens"] == {"lean": True, "fork": True, "tail": True}
        assert r["fork_ms"] > 0 and r["tail_ms"] > 0
        # the fork's attention swapped for lab/experiments/fork_flash.py's variants (the
        # split pass and the Triton merge on the interpreter): the fork's own tokens
        assert r["fork_flash_same_tokens"] == {"fork_flash": True, "fork_flash_split": True,
                                               "fork_flash_torchmerge": True}, r
        assert r["fork_flash_ms"] > 0 and r["fork_flash_split_ms"] > 0
        # 8 questions about one cache in batched steps: the shared prefix read once or per
        # question, the same tokens
        assert r["fork8_ms"] > 0 and r["fork8_each_ms"] > 0 and r["fork8_same_tokens"]
        assert len(r["tokens"]["step"]) == 1 + rep["steps"]
        # the measured-only split-K kernel computes the attention SDPA does (fp32 here)
        assert r["splitk_max_abs_err"] < 1e-5, r
    assert "same tokens" in proc.stdout
    # 8 answers decoding together, each over its own cache: eager only on the CPU
    (b,) = rep["batched"]
    assert b["answers"] == 8 and b["n"] == 300 and b["lean_ms"] > 0 and "graph_ms" not in b
    assert b["lean_ms_per_token"] == pytest.approx(b["lean_ms"] / 8, abs=1e-3)
    assert [len(t) for t in b["tokens"]["lean"]] == [1 + rep["steps"]] * 8
    assert len({tuple(t) for t in b["tokens"]["lean"]}) == 8     # each its own answer
    assert b["same_tokens_as_alone"] == {"lean": [True] * 8}


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_batched_step_gives_each_answer_its_own_tokens(kind, prepared):
    """step_many over three answers whose caches differ in length and content (different
    prefixes: the suffix prefilled or not, several decode steps ahead) gives each answer the
    logits and greedy tokens of ``step`` on that answer alone, and writes the same cache rows."""
    ad, prep, embeds = prepared[kind]
    P = prep.prefix_len
    suffix = embeds[:, P:]
    S = suffix.shape[1]
    dec = decode.decoder_of(ad)

    def caches():
        out = []
        with torch.inference_mode():
            for extra in (0, 1, 4):              # 0: the prefix alone; else suffix + steps
                kv = ad.prefill_prefix(prep, embeds.clone())
                if extra:
                    ad._step(suffix, ad.positions_after(prep.rope_delta, P, S), kv)
                    tok = torch.tensor([[3]])
                    for _ in range(extra - 1):
                        n = kv.get_seq_length()
                        tok = dec.step(tok, ad.positions_after(prep.rope_delta, n, 1), kv)
                out.append(kv)
        return out

    alone, batched = caches(), caches()
    tokens = [5, 11, 17]
    with torch.inference_mode():
        for _ in range(4):
            pos = [ad.positions_after(prep.rope_delta, c.get_seq_length(), 1) for c in alone]
            want = [int(dec.step(torch.tensor([[t]]), p, c)) for t, p, c in
                    zip(tokens, pos, alone)]
            logits = dec.step_many(tokens, pos, batched)
            assert logits.shape[0] == 3
            got = logits.argmax(-1).tolist()
            assert got == want
            tokens = got
    # the batched step attended with SDPA directly: it checked that SDPA gives the hook's bits
    assert dec._sdpa_direct is True
    assert len({c.get_seq_length() for c in batched}) == 3
    for a, b in zip(alone, batched):
        assert a.get_seq_length() == b.get_seq_length()
        for la, lb in zip(a.layers, b.layers):
            n = a.get_seq_length()
            torch.testing.assert_close(la.keys[..., :n, :], lb.keys[..., :n, :], atol=1e-5,
                                       rtol=1e-5)


@pytest.mark.parametrize("kind,kv_dtype", [("qwen", None), ("longvila", None), ("qwen", "fp8")])
def test_forked_readers_answer_as_the_in_place_path(kind, kv_dtype, prepared):
    """Three questions forked from one kept prefix (ForkKV: the prefix shared and never
    written, each reader's rows its own) and decoded together in batched steps give each the
    logits and greedy tokens of its question appended in place to a prefix of its own; the
    prefix's rows are untouched. In the model's dtype and FP8 (rows quantised with the
    prefix's scales)."""
    from mminfer.models.kv import ForkKV, kv_dtype as dtype_of
    ad, prep, embeds = prepared[kind]
    P = prep.prefix_len
    suffix = embeds[:, P:]
    S = suffix.shape[1]
    emb = ad.text_model.get_input_embeddings()
    questions = [suffix]
    g = torch.Generator().manual_seed(0)
    for _ in range(2):          # other questions: the suffix but its last rows, other tokens
        q = suffix.clone()
        with torch.inference_mode():
            q[:, :-2] = emb(torch.randint(0, emb.num_embeddings, (1, S - 2), generator=g))
        questions.append(q)
    dec = decode.decoder_of(ad)
    saved = ad.kv_cache_dtype
    ad.kv_cache_dtype = dtype_of(kv_dtype)
    try:
        alone = []               # (suffix logits, tokens) on a prefix of its own, in place
        for q in questions:
            kv = ad.prefill_prefix(prep, embeds.clone())
            with torch.inference_mode():
                logits = ad.lm_head(ad._step(q, ad.positions_after(prep.rope_delta, P, S),
                                             kv))[:, -1]
                toks = [int(logits.argmax(-1))]
                for _ in range(5):
                    n = kv.get_seq_length()
                    toks.append(int(dec.step(torch.tensor([[toks[-1]]]),
                                             ad.positions_after(prep.rope_delta, n, 1), kv)))
            alone.append((logits, toks))
        shared = ad.prefill_prefix(prep, embeds.clone(), headroom=0)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in shared.layers]
        forks = [ForkKV(shared, P, headroom=5) for _ in questions]
        with torch.inference_mode():
            tokens = []
            for (ref_logits, ref), q, fork in zip(alone, questions, forks):
                logits = ad.lm_head(ad._step(q, ad.positions_after(prep.rope_delta, P, S),
                                             fork))[:, -1]
                torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
                tokens.append([int(logits.argmax(-1))])
            for _ in range(5):
                pos = [ad.positions_after(prep.rope_delta, f.get_seq_length(), 1)
                       for f in forks]
                got = dec.step_many([t[-1] for t in tokens], pos, forks).argmax(-1).tolist()
                for t, g in zip(tokens, got):
                    t.append(g)
        assert tokens == [ref for _, ref in alone]
        assert len(set(tokens[0])) > 1
        # the questions' logits differ past the tolerance: each reader read its own rows
        assert all((a - alone[0][0]).abs().max() > 1e-3 for a, _ in alone[1:])
        assert all(f.get_seq_length() == P + S + 5 for f in forks)
        assert shared.get_seq_length() == P and shared.capacity == P
        for layer, (k, v) in zip(shared.layers, before):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
            assert layer.quantized == (kv_dtype == "fp8")
    finally:
        ad.kv_cache_dtype = saved


@pytest.mark.parametrize("kind,kv", [("qwen", None), ("longvila", None), ("qwen", "fp8")])
def test_readers_of_one_prefix_share_its_attention(kind, kv, prepared, monkeypatch):
    """A batched step over three forks of prefix A, two of prefix B, a lone fork of prefix C
    and a cache of its own: each answer's logits and greedy tokens are those of that answer
    decoded alone, and each layer's attention runs once per group of forks (A's three, B's
    two: the prefix read once for the group), the lone fork and the own cache on their own."""
    ad, prep, embeds = prepared[kind]
    P = prep.prefix_len
    suffix = embeds[:, P:]
    S = suffix.shape[1]
    emb = ad.text_model.get_input_embeddings()
    dec = decode.decoder_of(ad)
    g = torch.Generator().manual_seed(1)
    saved = ad.kv_cache_dtype
    ad.kv_cache_dtype = kv_dtype(kv)
    with torch.inference_mode():
        prefixes = []
        for p in range(3):       # three videos: the same layout, other frames
            e = embeds.clone()
            e[:, :P] += p * 0.05 * torch.randn(e[:, :P].shape, generator=g)
            prefixes.append((ad.prefill_prefix(prep, e, headroom=0), e))
        questions = []
        for _ in range(7):       # each answer's question: other tokens but the last rows
            q = suffix.clone()
            q[:, :-2] = emb(torch.randint(0, emb.num_embeddings, (1, S - 2), generator=g))
            questions.append(q)
    which = [0, 0, 0, 1, 1, 2, None]      # the prefix each answer forks (None: its own)

    def caches():
        out, first = [], []
        for w, q in zip(which, questions):
            if w is None:
                c = ad.prefill_prefix(prep, prefixes[0][1].clone())
            else:
                c = ForkKV(prefixes[w][0], P, headroom=3)
            logits = ad.lm_head(ad._step(q, ad.positions_after(prep.rope_delta, P, S), c))
            out.append(c)
            first.append(int(logits[:, -1].argmax(-1)))
        return out, first

    calls = []
    real = decode.fork_group_attention
    monkeypatch.setattr(decode, "fork_group_attention",
                        lambda q, k, *a: calls.append(len(k)) or real(q, k, *a))
    try:
        with torch.inference_mode():
            alone, tokens = caches()
            want, ref_logits = [], []
            for c, t in zip(alone, tokens):
                toks, lg = [t], []
                for _ in range(4):
                    pos = ad.positions_after(prep.rope_delta, c.get_seq_length(), 1)
                    lg.append(dec.logits(torch.tensor([[toks[-1]]]), pos, c)[0, -1])
                    toks.append(int(lg[-1].argmax()))
                want.append(toks)
                ref_logits.append(torch.stack(lg))
            assert calls == []                       # alone: never grouped
            batched, first = caches()
            assert first == tokens
            got, logits = [[t] for t in first], []
            for _ in range(4):
                pos = [ad.positions_after(prep.rope_delta, c.get_seq_length(), 1)
                       for c in batched]
                lg = dec.step_many([t[-1] for t in got], pos, batched)
                logits.append(lg)
                for t, n in zip(got, lg.argmax(-1).tolist()):
                    t.append(n)
    finally:
        ad.kv_cache_dtype = saved
    assert got == want
    # each answer read its own rows: their logits differ by several times the tolerance
    assert all((r - ref_logits[0]).abs().max() > 5e-4 for r in ref_logits[1:])
    for j, ref in enumerate(ref_logits):
        torch.testing.assert_close(torch.stack([lg[j] for lg in logits]), ref, atol=1e-4,
                                   rtol=1e-4)
    assert decode.prefix_groups(batched) == [[0, 1, 2], [3, 4]]
    assert calls == [3, 2] * (4 * len(dec.layers))


def test_graph_plumbing_writes_and_attends_a_fork_directly(prepared, monkeypatch):
    """The captured step on a ForkKV (replayed on the CPU): its layers are written and
    attended directly, with the tokens and rows of the eager lean step on another fork."""
    from mminfer.models.kv import ForkKV
    ad, prep, embeds = prepared["qwen"]
    monkeypatch.setattr(decode, "_warm_up", lambda dev, fn: fn())
    monkeypatch.setattr(decode, "_capture", _replayed)
    monkeypatch.setattr(decode.LeanDecoder, "graph_unsupported", lambda self: None)
    ad._lean_decoder = None
    P = prep.prefix_len
    shared = ad.prefill_prefix(prep, embeds.clone(), headroom=0)
    try:
        forks, outs = {}, {}
        for mode in ("lean", "graph"):
            forks[mode] = ForkKV(shared, P, headroom=2)      # grows during the answer
            outs[mode] = _answer_on(ad, forks[mode], prep, embeds, mode)
        graphs = decode.decoder_of(ad)._graphs
        assert graphs is not None and graphs.direct_slabs(forks["graph"]) is not None
        assert outs["graph"] == outs["lean"] and len(outs["lean"]) == 6
        for a, b in zip(forks["graph"].layers, forks["lean"].layers):
            assert a.get_seq_length() == prep.input_ids.shape[1] + 5
            torch.testing.assert_close(a.keys, b.keys, atol=1e-6, rtol=1e-6)
    finally:
        ad._lean_decoder = None


def _answer_on(ad, cache, prep, embeds, mode, n=6):
    ad.decode_mode, eos = mode, ad.eos_token_ids
    ad.eos_token_ids = ()
    try:
        return ad.continue_on(cache, embeds[:, prep.prefix_len:], rope_delta=prep.rope_delta,
                              max_new_tokens=n).token_ids
    finally:
        ad.decode_mode, ad.eos_token_ids = "auto", eos


# ------------------------------------------------------------------ batched steps in CUDA graphs
def _answers(ad, prep, embeds, extras):
    """One cache per entry of ``extras``: the prefix alone (0), or the suffix prefilled and
    ``extra - 1`` lean steps after it: answers at different lengths with different rows."""
    P = prep.prefix_len
    suffix = embeds[:, P:]
    S = suffix.shape[1]
    dec = decode.decoder_of(ad)
    out = []
    with torch.inference_mode():
        for extra in extras:
            kv = ad.prefill_prefix(prep, embeds.clone(), headroom=2)     # grows while decoding
            if extra:
                ad._step(suffix, ad.positions_after(prep.rope_delta, P, S), kv)
                tok = torch.tensor([[3 + extra]])
                for _ in range(extra - 1):
                    n = kv.get_seq_length()
                    tok = dec.step(tok, ad.positions_after(prep.rope_delta, n, 1), kv)
            out.append(kv)
    return out


@pytest.mark.parametrize("n", [1, 3])
def test_samplers_choose_in_the_batched_step(n, prepared):
    """An item's chooser (its answer's Sampler) picks its token in the step, from the logits
    the step gives that item when asked for them; a chooser that raises fails its own item
    alone (the exception is its result); the others get their tokens."""
    from mminfer.models.sampler import Sampler
    ad, prep, embeds = prepared["qwen"]
    extras = (1, 3, 0)[:n]
    ref, got = _answers(ad, prep, embeds, extras), _answers(ad, prep, embeds, extras)
    params = SamplingParams(temperature=0.9, seed=7)

    def items(caches, want):
        return [(5 + j, ad.positions_after(prep.rope_delta, c.get_seq_length(), 1), c, want(j))
                for j, c in enumerate(caches)]

    logits = decode.step_batch(ad, items(ref, lambda j: True))
    expect = [Sampler(params)(x) for x in logits]

    def bad(_logits):
        raise ValueError("no token")

    chosen = decode.step_batch(ad, items(got, lambda j: bad if j == 1 else Sampler(params)))
    for j, (e, c) in enumerate(zip(expect, chosen)):
        if j == 1:
            assert isinstance(c, ValueError)
        else:
            assert isinstance(c, int) and c == e


def _run_batches(ad, prep, caches, schedule, tokens, mode):
    """``schedule``: the answers (indices) of each batched step, through step_batch; the
    second answer of each batch asks for its logits. Returns each step's results."""
    ad.decode_mode, got = mode, []
    try:
        for batch in schedule:
            items = [(tokens[a], ad.positions_after(prep.rope_delta, caches[a].get_seq_length(),
                                                    1), caches[a], j == 1)
                     for j, a in enumerate(batch)]
            res = decode.step_batch(ad, items)
            got.append(res)
            for a, r in zip(batch, res):
                tokens[a] = r if isinstance(r, int) else int(r.argmax(-1))
    finally:
        ad.decode_mode = "auto"
    return got


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_batched_graphs_replayed_on_the_cpu(kind, prepared, monkeypatch):
    """The batched step's segments over their static buffers, replayed on the CPU (the code
    a capture records): batches that pad (3 -> 4, 5 -> 8), reuse a size with other answers
    in other rows, and split above the largest size give each answer the tokens, logits and
    cache rows of the eager step_many over the same batches, and the tokens of each answer
    stepped alone; while another thread holds the graphs, the step runs eagerly."""
    ad, prep, embeds = prepared[kind]
    monkeypatch.setattr(decode, "_warm_up", lambda dev, fn: fn())
    monkeypatch.setattr(decode, "_capture", _replayed)
    monkeypatch.setattr(decode.LeanDecoder, "graph_unsupported", lambda self: None)
    extras = (0, 1, 3, 2, 4)
    first = [5, 11, 17, 23, 29]
    schedule = [[0, 1, 2], [2, 0], [4, 3, 1, 0, 2], [1, 3, 4], [3, 0, 4, 2, 1]]
    ad._lean_decoder = None
    try:
        dec = decode.decoder_of(ad)
        eager_kv = _answers(ad, prep, embeds, extras)
        eager = _run_batches(ad, prep, eager_kv, schedule, list(first), "lean")
        assert dec._batch == {}                          # "lean": step_many, no capture
        graph_kv = _answers(ad, prep, embeds, extras)
        tokens = list(first)
        with dec._lock:                  # another thread replays: this step runs eagerly
            held = _run_batches(ad, prep, graph_kv, schedule[:1], tokens, "graph")
        assert dec._batch == {}
        monkeypatch.setattr(decode, "BATCH_SIZES", (2, 4, 8))
        graph = _run_batches(ad, prep, graph_kv, schedule[1:4], tokens, "graph")
        d = 3 if kind == "qwen" else 2                  # M-RoPE [3, B, 1], else [B, 1]
        assert sorted(dec._batch) == [(2, d), (4, d), (8, d)]
        assert dec._batch[(8, d)].pos.shape[-2:] == (8, 1)
        monkeypatch.setattr(decode, "BATCH_SIZES", (2, 4))   # 5 answers: 4, then 1 (-> 2)
        graph += _run_batches(ad, prep, graph_kv, schedule[4:], tokens, "graph")
        assert sorted(dec._batch) == [(2, d), (4, d), (8, d)]
        graph = held + graph
    finally:
        ad._lean_decoder = None
    for step, (g, e) in enumerate(zip(graph, eager)):
        for r, want in zip(g, e):
            if isinstance(want, int):
                assert r == want, (step, g, e)
            else:                                    # the logits a sampler reads
                assert r.shape == want.shape == (1, 1, ad.lm_head.out_features)
                torch.testing.assert_close(r, want, atol=1e-5, rtol=1e-5)
    assert sum(isinstance(r, int) for g in graph for r in g) > 10
    for a, b in zip(graph_kv, eager_kv):
        n = a.get_seq_length()
        assert n == b.get_seq_length()
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(la.keys[..., :n, :], lb.keys[..., :n, :], atol=1e-5,
                                       rtol=1e-5)
            torch.testing.assert_close(la.values[..., :n, :], lb.values[..., :n, :],
                                       atol=1e-5, rtol=1e-5)
    # each answer alone, step by step: the same tokens
    alone_kv = _answers(ad, prep, embeds, extras)
    dec = decode.decoder_of(ad)
    tokens = list(first)
    with torch.inference_mode():
        for batch, g in zip(schedule, graph):
            for a, r in zip(batch, g):
                n = alone_kv[a].get_seq_length()
                tokens[a] = int(dec.step(torch.tensor([[tokens[a]]]),
                                         ad.positions_after(prep.rope_delta, n, 1),
                                         alone_kv[a]))
                assert tokens[a] == (r if isinstance(r, int) else int(r.argmax(-1)))


def test_a_failed_batched_capture_steps_eagerly(prepared, monkeypatch, caplog):
    ad, prep, embeds = prepared["qwen"]

    def refuse(dev, fns, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode, "_warm_up", lambda dev, fn: fn())
    monkeypatch.setattr(decode, "_capture", refuse)
    monkeypatch.setattr(decode.LeanDecoder, "graph_unsupported", lambda self: None)
    schedule = [[0, 1, 2], [2, 1], [0, 2, 1]]
    ad._lean_decoder = None
    try:
        ref = _run_batches(ad, prep, _answers(ad, prep, embeds, (0, 1, 2)), schedule,
                           [5, 11, 17], "lean")
        with caplog.at_level("WARNING", logger="mminfer.models.decode"):
            got = _run_batches(ad, prep, _answers(ad, prep, embeds, (0, 1, 2)), schedule,
                               [5, 11, 17], "graph")
        dec = decode.decoder_of(ad)
        assert dec._batch == {} and "capture failed" in dec._batch_failed
        assert caplog.text.count("batched decode steps run eagerly") == 1   # not tried again
        assert dec._graph_failed is None               # a lone answer's graphs still may run
    finally:
        ad._lean_decoder = None
    for g, r in zip(got, ref):
        assert [x if isinstance(x, int) else int(x.argmax(-1)) for x in g] == \
            [x if isinstance(x, int) else int(x.argmax(-1)) for x in r]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_batched_graph_replay_steps_as_step_many_on_cuda(kind):
    """Batched steps replayed from CUDA graphs (captured here at 2, 4 and 8 answers; batches of
    3 and 5 padded, with another batch's rows left in the padding) against the eager step_many
    over the same batches, in lock step (both fed the eager step's tokens), over caches of
    other lengths and kinds (PrefixKV, DynamicCache, a ForkKV); between the batches a lone
    answer replays its own graphs (the same memory pool) against the eager lean step. Greedy
    tokens equal wherever the eager logits' top two are further apart than bf16 rounding of
    GEMMs of other row counts (another summation order) can move them; logits and the
    cache rows written within bf16 tolerance."""
    from transformers import DynamicCache
    from mminfer.models.kv import ForkKV
    from mminfer.models.prefill import prefill
    tm, head = _small_gpu_model(kind)
    ad = _Bare(tm, head, mrope=kind == "qwen")
    assert decode.choose_path(ad) == "graph"
    lengths = (3000, 1234, 2048, 777, 1500, 2500)          # the last one decodes alone

    def caches():
        out = []
        for j, n in enumerate(lengths):
            g = torch.Generator(device="cuda").manual_seed(n)
            embeds = torch.randn(1, n, 256, device="cuda", dtype=torch.bfloat16, generator=g)
            kv = DynamicCache() if j == 1 else PrefixKV.for_model(tm, headroom=4)
            prefill(tm, embeds, kv, ad.positions_after(5, 0, n), kv_only_last=True)
            out.append(ForkKV(kv, n, headroom=4) if j == 3 else kv)
        return out

    def step(kvs, batch, mode, want):
        ad.decode_mode = mode
        try:
            return decode.step_batch(ad, [(tokens[a], ad.positions_after(
                5, kvs[a].get_seq_length(), 1), kvs[a], want(j)) for j, a in enumerate(batch)])
        finally:
            ad.decode_mode = "auto"

    schedule = [[0, 1, 2], [2, 0], [4, 3, 1, 0, 2], [1, 3, 4], [0, 1, 2, 3],
                [3, 0, 4, 2, 1]] * 3
    tokens = [7, 100, 200, 300, 400, 500]
    compared = rows = 0
    with torch.inference_mode():
        eager_kv, graph_kv = caches(), caches()
        for batch in schedule:
            ref = step(eager_kv, batch, "lean", lambda j: True)
            got = step(graph_kv, batch, "graph", lambda j: j == 1)
            for j, (a, r, g) in enumerate(zip(batch, ref, got)):
                r = r.float().view(-1)
                top = r.topk(2).values
                if j == 1:
                    torch.testing.assert_close(g.float().view(-1), r, atol=5e-2, rtol=5e-2)
                    g = int(g.argmax(-1))
                if top[0] - top[1] > 0.05:
                    assert g == int(r.argmax()), (batch, a)
                    compared += 1
                rows += 1
                tokens[a] = int(r.argmax())
            # the lone answer: its own graphs, in the pool the batched ones share
            lone = step(graph_kv, [5], "graph", lambda j: False)
            assert lone == step(eager_kv, [5], "lean", lambda j: False)
            tokens[5] = lone[0]
    dec = decode.decoder_of(ad)
    d = 3 if kind == "qwen" else 2
    assert sorted(dec._batch) == [(2, d), (4, d), (8, d)] and dec._batch_failed is None
    assert dec._graphs is not None and dec._pool is not None
    assert compared >= 0.5 * rows, (compared, rows)
    for a, b, n in zip(graph_kv, eager_kv, lengths):
        assert a.get_seq_length() == b.get_seq_length() > n
        k = a.get_seq_length() - n                  # the rows the steps wrote: the last k
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(la.keys[..., -k:, :], lb.keys[..., -k:, :], atol=2e-2,
                                       rtol=2e-2)
            torch.testing.assert_close(la.values[..., -k:, :], lb.values[..., -k:, :],
                                       atol=2e-2, rtol=2e-2)
