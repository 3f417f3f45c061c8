"""The prefill engine (mminfer.models.prefill) against transformers' own one-shot forward on the
tiny Qwen2.5-VL and LongVILA checkpoints, in fp32: same last hidden state and logits, the same
KV cache contents, the same decode tokens after it; dense and sparse; no token-wise module
ever sees more than a chunk; the mask registration that makes a prefill chunk on a non-empty
cache causal; the one dense/sparse decision; cancellation between layers."""

import os
from contextlib import nullcontext

import types

import pytest
import torch

from mminfer.errors import Cancelled, InputError
from mminfer.models import hooks
from mminfer.models.base import _new_cache
from mminfer.models.prefill import prefill
from mminfer.sparse import patterns as P
from mminfer.sparse.patterns import HeadPatternConfig
from conftest import load_script
from tiny_cases import FrameVideo, random_frames

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class EveryRow(hooks.PrefillContext):
    """Every row of the last layer (as lab/experiments/last_layer.py measures it)."""

    def every_row(self) -> bool:
        return True
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                   reason="sparse kernels need CUDA or TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from mminfer.models.qwen2_5_vl import Qwen2_5_VLAdapter
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    path = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("prefill") / "tiny-qwen")
    return Qwen2_5_VLAdapter.from_pretrained(str(path), device="cpu")


@pytest.fixture(scope="module")
def longvila(tmp_path_factory):
    from mminfer.models.longvila import LongVILA
    from lab.toy.tiny_longvila import save_tiny_longvila
    path = save_tiny_longvila(tmp_path_factory.mktemp("prefill") / "tiny-longvila")
    return LongVILA.from_pretrained(path, device="cpu")


def _prepared(adapter, name):
    if name == "qwen":
        return adapter.prepare(FrameVideo(random_frames(6)), "what color is the ball now?")
    return adapter.prepare(random_frames(3, 40, 70), "Where does it go?")


@pytest.fixture(params=["qwen", "longvila"])
def case(request):
    adapter = request.getfixturevalue(request.param)
    p = _prepared(adapter, request.param)
    with torch.inference_mode():
        embeds = adapter.embed(p)
    return adapter, p, embeds


def _one_shot(adapter, p, embeds, ctx=None):
    """transformers' own prefill: one text_model call over the whole prompt into a cache."""
    from mminfer.models.base import _cache_kwarg
    cache = _new_cache(adapter.text_model)
    kw = {_cache_kwarg(adapter.text_model): cache}
    pos = adapter.positions(p, 0, p.total_tokens)
    if pos is not None:
        kw["position_ids"] = pos
    with torch.inference_mode(), (hooks.prefill_context(ctx) if ctx else nullcontext()):
        h = adapter.text_model(inputs_embeds=embeds.clone(), use_cache=True, **kw)
    return h.last_hidden_state[:, -1:], cache


def _chunked(adapter, p, embeds, chunk, ctx=None):
    cache = _new_cache(adapter.text_model)
    h = prefill(adapter.text_model, embeds.clone(), cache, adapter.positions(p, 0, p.total_tokens),
                chunk=chunk, ctx=ctx)
    return h, cache


def _kv(cache, layers):
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(layers)]


def _decode(adapter, p, cache, first, steps=6):
    """Greedy decode steps exactly as Adapter.generate takes them (no end-token stop)."""
    L = p.total_tokens
    token, out = first, []
    emb = adapter.text_model.get_input_embeddings()
    with torch.inference_mode():
        for i in range(steps):
            hidden = adapter._step(emb(token), adapter.positions(p, L + i, 1), cache)
            token = adapter.lm_head(hidden[:, -1:]).argmax(-1)
            out.append(int(token))
    return out


# ---------------------------------------------------------------------- dense
@pytest.mark.parametrize("chunk", [7, 8, 1 << 20])
def test_chunked_prefill_equals_one_shot(case, chunk):
    adapter, p, embeds = case
    n, layers = p.total_tokens, len(adapter.text_model.layers)
    assert n % 7 and n % 8 and n > 3 * 8        # ragged last chunks
    ref_h, ref_cache = _one_shot(adapter, p, embeds)
    got_h, got_cache = _chunked(adapter, p, embeds, chunk)
    torch.testing.assert_close(got_h, ref_h, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        ref_logits, got_logits = adapter.lm_head(ref_h), adapter.lm_head(got_h)
    torch.testing.assert_close(got_logits, ref_logits, atol=1e-5, rtol=1e-5)
    # the cache decode reads: one entry per layer, N tokens each, the one-shot's contents.
    # In one chunk the numbers are bit for bit the same (the same ops on the same rows);
    # over chunks MKL's GEMM rounds a row subset differently in the last bit (a Linear on
    # rows 0..6 alone already does, see below), so there equal to float32 rounding.
    assert got_cache.get_seq_length() == n and len(got_cache.layers) == layers
    for (k, v), (rk, rv) in zip(_kv(got_cache, layers), _kv(ref_cache, layers)):
        assert k.shape == rk.shape and k.shape[-2] == n and k.dtype == rk.dtype
        if chunk >= n:
            assert torch.equal(k, rk) and torch.equal(v, rv)
        else:
            torch.testing.assert_close(k, rk, atol=1e-6, rtol=0)
            torch.testing.assert_close(v, rv, atol=1e-6, rtol=0)
    if chunk >= n:   # every row of the last layer, as transformers runs it: bit for bit
        full = EveryRow(mode="dense")
        assert torch.equal(_chunked(adapter, p, embeds, chunk, full)[0], ref_h)
    first = ref_logits.argmax(-1)
    assert torch.equal(got_logits.argmax(-1), first)
    assert _decode(adapter, p, got_cache, first) == _decode(adapter, p, ref_cache, first)


def test_the_last_layer_computes_its_last_row_only(case, monkeypatch):
    """Its other rows reach no logit, and the K/V decode reads come from its input: skipping
    them leaves the answer and the cache as they were. Calibration's capture needs them all."""
    from mminfer.models import prefill as engine
    adapter, p, embeds = case
    n, layers = p.total_tokens, len(adapter.text_model.layers)
    seen = {}
    real = engine._attention_function

    def spy(attn):
        fn = real(attn)

        def call(module, q, k, v, *a, **kw):
            seen.setdefault(module.layer_idx, []).append((q.shape[2], k.shape[2]))
            return fn(module, q, k, v, *a, **kw)
        return call
    monkeypatch.setattr(engine, "_attention_function", spy)
    got_h, got_cache = _chunked(adapter, p, embeds, 7)
    assert seen == {i: [(n, n)] for i in range(layers - 1)} | {layers - 1: [(1, n)]}
    seen.clear()
    served = hooks.PrefillContext(mode="dense")
    _chunked(adapter, p, embeds, 7, served)
    assert served.last_row_only == layers - 1          # what the sparsity report names
    seen.clear()
    full = EveryRow(mode="dense")
    full_h, full_cache = _chunked(adapter, p, embeds, 7, full)
    assert seen == {i: [(n, n)] for i in range(layers)} and full.last_row_only is None
    torch.testing.assert_close(got_h, full_h, atol=1e-5, rtol=1e-5)
    for (k, v), (rk, rv) in zip(_kv(got_cache, layers), _kv(full_cache, layers)):
        assert torch.equal(k, rk) and torch.equal(v, rv)      # the same ops on the same rows
    with torch.inference_mode():
        first = adapter.lm_head(full_h).argmax(-1)
        assert torch.equal(adapter.lm_head(got_h).argmax(-1), first)
    assert _decode(adapter, p, got_cache, first) == _decode(adapter, p, full_cache, first)
    seen.clear()
    ctx = hooks.PrefillContext(mode="dense", capture={})
    _chunked(adapter, p, embeds, 7, ctx)
    assert sorted(ctx.capture) == list(range(layers)) and ctx.last_row_only is None
    assert all(q.shape[2] == n for q, _, _ in ctx.capture.values())


def test_dynamic_rope_sees_the_whole_prompt():
    """Dynamic NTK RoPE rescales from the largest position: chunked, it must still see N."""
    from transformers import Qwen2Config, Qwen2Model
    from mminfer.models.base import _cache_kwarg
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                       "rope_theta": 10000.0})
    torch.manual_seed(0)
    tm = Qwen2Model._from_config(cfg, attn_implementation=hooks.register()).eval()
    x = torch.randn(1, 45, 64)
    with torch.inference_mode():
        ref = tm(inputs_embeds=x.clone(), use_cache=True,
                 **{_cache_kwarg(tm): _new_cache(tm)}).last_hidden_state[:, -1:]
    got = prefill(tm, x.clone(), _new_cache(tm), chunk=7)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_the_last_bit_is_the_gemm_not_the_engine():
    """Why the chunked cache is compared to float32 rounding: the same Linear on the same
    rows gives other last bits when it sees fewer rows (MKL picks its blocking by M)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(1, 40, 64)
    with torch.inference_mode():
        whole = lin(x)
        parts = torch.cat([lin(x[:, s:s + 7]) for s in range(0, 40, 7)], 1)
    assert (whole - parts).abs().max() < 1e-6


def test_generate_answers_as_before(case):
    """Adapter.generate (the product path) on the engine gives the tokens of a one-shot
    prefill followed by the same decode steps."""
    adapter, p, embeds = case
    ref_h, ref_cache = _one_shot(adapter, p, embeds)
    with torch.inference_mode():
        first = adapter.lm_head(ref_h).argmax(-1)
    want = [int(first)] + _decode(adapter, p, ref_cache, first, steps=5)
    got = adapter.generate(p, max_new_tokens=6).token_ids
    assert got == want[:len(got)]
    assert len(got) == 6 or got[-1] in adapter.eos_token_ids


def test_no_token_wise_module_sees_more_than_a_chunk(case):
    """Norms, q/k/v/o projections and the MLP run on at most ``chunk`` tokens; the one-shot
    forward hands them all N (so this check would see a whole-length call)."""
    adapter, p, embeds = case
    seen = []
    tm = adapter.text_model
    mods = [m for layer in tm.layers
            for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp,
                      layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                      layer.self_attn.o_proj)]
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
               for m in mods]
    try:
        _chunked(adapter, p, embeds, chunk=8)
        # per chunk in every layer but the last, which runs some on its last row only
        full = len(mods) // len(tm.layers) * (len(tm.layers) - 1)
        assert len(seen) >= full * (p.total_tokens // 8) and max(seen) <= 8
        seen.clear()
        _one_shot(adapter, p, embeds)
        assert max(seen) == p.total_tokens
    finally:
        for hd in handles:
            hd.remove()


def test_prefill_refuses_a_used_cache(qwen):
    p = _prepared(qwen, "qwen")
    with torch.inference_mode():
        embeds = qwen.embed(p)
    _, cache = _one_shot(qwen, p, embeds)
    with pytest.raises(ValueError, match="already holds"):
        prefill(qwen.text_model, embeds.clone(), cache, qwen.positions(p, 0, p.total_tokens))


def test_append_continues_a_cache_as_one_shot(case):
    """prefill(append=True): the prompt's rows in three parts, each over the cache the parts
    before wrote (queries at an offset into a longer key range, causal among themselves), give
    the one-shot prefill's last hidden state and every layer's K/V."""
    from mminfer.models.kv import PrefixKV
    adapter, p, embeds = case
    want, ref = _one_shot(adapter, p, embeds)
    L = p.total_tokens
    cuts = [0, L // 3, L // 3 + 5, L]
    kv = PrefixKV.for_model(adapter.text_model)
    for a, b in zip(cuts, cuts[1:]):
        pos = adapter.positions(p, a, b - a)
        out = prefill(adapter.text_model, embeds[:, a:b].clone(), kv, pos, chunk=4,
                      append=a > 0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for (k, v), (rk, rv) in zip(_kv(kv, adapter.identity.layers),
                                _kv(ref, adapter.identity.layers)):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- sparse
def _sparse_patterns(adapter):
    # budgets far below the prompt: the plans really skip blocks
    row = [P.HeadPattern.single(P.a_shape(sink=4, window=16)),
           P.HeadPattern.single(P.vertical_slash(n_vertical=8, n_slash=4, window=16, sink=4))]
    heads = adapter.identity.heads
    return HeadPatternConfig(adapter.identity,
                             [[row[h % 2] for h in range(heads)]] * adapter.identity.layers)


@needs_kernels
def test_sparse_chunked_prefill_equals_one_shot_sparse(case):
    adapter, p, embeds = case
    layers = adapter.identity.layers
    pats = _sparse_patterns(adapter)

    def ctx(every_row=False):
        return (EveryRow if every_row else hooks.PrefillContext)(
            index=p.index, patterns=pats, mode="sparse", keep_plans=True)
    ref_ctx, got_ctx = ctx(), ctx(every_row=True)
    ref_h, ref_cache = _one_shot(adapter, p, embeds, ref_ctx)
    got_h, got_cache = _chunked(adapter, p, embeds, 7, got_ctx)
    assert got_ctx.sparse is True and sorted(got_ctx.densities) == list(range(layers))
    dens = [got_ctx.densities[i].density()["logical"] for i in range(layers)]
    assert dens == [ref_ctx.densities[i].density()["logical"] for i in range(layers)]
    assert all(d < 0.95 for d in dens)
    torch.testing.assert_close(got_h, ref_h, atol=1e-5, rtol=1e-5)
    for (k, v), (rk, rv) in zip(_kv(got_cache, layers), _kv(ref_cache, layers)):
        torch.testing.assert_close(k, rk, atol=1e-6, rtol=0)      # GEMM rounding, as dense
        torch.testing.assert_close(v, rv, atol=1e-6, rtol=0)
    # and sparse is not dense in disguise
    dense_h, _ = _chunked(adapter, p, embeds, 7)
    assert not torch.allclose(got_h, dense_h, atol=1e-3)
    with torch.inference_mode():
        first = adapter.lm_head(got_h).argmax(-1)
    assert _decode(adapter, p, got_cache, first) == _decode(adapter, p, ref_cache, first)
    # as served, the last layer runs its last row alone, and that one query sees every key:
    # the same as a config whose last layer is dense, with no plan for it
    last_dense = HeadPatternConfig(adapter.identity, [list(r) for r in pats.layers[:-1]]
                                   + [[P.HeadPattern.single(P.dense())] * adapter.identity.heads])
    served = ctx()
    served_h, _ = _chunked(adapter, p, embeds, 7, served)
    assert sorted(served.densities) == list(range(layers - 1))
    want_h, _ = _one_shot(adapter, p, embeds, hooks.PrefillContext(
        index=p.index, patterns=last_dense, mode="sparse"))
    torch.testing.assert_close(served_h, want_h, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(served_h, got_h, atol=1e-3)


# ---------------------------------------------------------------------- mask registration
@pytest.mark.parametrize("name", ["qwen", "longvila"])
def test_prompt_chunk_on_a_cache_is_causal(request, name):
    """A 32-token prefill then an 8-token chunk on that cache equals one 40-token prefill
    under our attention (it differed by 10.5 in the logits with no mask registered)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from mminfer.models.base import _cache_kwarg
    adapter = request.getfixturevalue(name)
    tm = adapter.text_model
    assert tm.config._attn_implementation == hooks.ATTN_NAME
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 40, tm.config.hidden_size, generator=g)
    kw = _cache_kwarg(tm)
    with torch.inference_mode():
        whole = adapter.lm_head(tm(inputs_embeds=x, use_cache=True,
                                   **{kw: _new_cache(tm)}).last_hidden_state)
        cache = _new_cache(tm)
        a = tm(inputs_embeds=x[:, :32], use_cache=True, **{kw: cache}).last_hidden_state
        b = tm(inputs_embeds=x[:, 32:], use_cache=True, **{kw: cache}).last_hidden_state
        parts = adapter.lm_head(torch.cat([a, b], 1))
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    assert hooks.ATTN_NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


# ---------------------------------------------------------------------- the decision
def test_one_rule_decides_dense_or_sparse():
    idx, pats = object(), object()
    choose = hooks.choose_attention
    assert choose("dense", 10**6, patterns=pats, index=idx, min_sparse_len=0) == "dense"
    assert choose("sparse", 8, patterns=pats, index=idx, min_sparse_len=10**6) == "sparse"
    assert choose("auto", 99, patterns=pats, index=idx, min_sparse_len=100) == "dense"
    assert choose("auto", 100, patterns=pats, index=idx, min_sparse_len=100) == "sparse"
    # auto runs a calibrated config only; explicit sparse runs an uncalibrated one too
    raw = types.SimpleNamespace(uncalibrated=True)
    assert choose("auto", 100, patterns=raw, index=idx, min_sparse_len=1) == "dense"
    assert choose("sparse", 100, patterns=raw, index=idx, min_sparse_len=1) == "sparse"
    done = types.SimpleNamespace(uncalibrated=False)
    assert choose("auto", 100, patterns=done, index=idx, min_sparse_len=1) == "sparse"
    # auto never goes where it cannot run; an explicit sparse there is refused with the reason
    assert choose("auto", 100, patterns=None, index=idx, min_sparse_len=1) == "dense"
    assert choose("auto", 100, patterns=pats, index=idx, min_sparse_len=1,
                  unavailable="no kernels here") == "dense"
    with pytest.raises(InputError, match="no kernels here"):
        choose("sparse", 100, patterns=pats, index=idx, min_sparse_len=1,
               unavailable="no kernels here")
    with pytest.raises(InputError, match="head patterns"):
        choose("sparse", 100, patterns=None, index=idx, min_sparse_len=1)
    with pytest.raises(InputError, match="attention must be"):
        choose("fast", 100, patterns=pats, index=idx, min_sparse_len=1)


def test_the_hook_follows_the_request_decision(qwen):
    """The prefill decides once; every layer's attention follows it (here: a decision of
    dense on a ctx that would otherwise go sparse runs no plan at all)."""
    p = _prepared(qwen, "qwen")
    with torch.inference_mode():
        embeds = qwen.embed(p)
    ctx = hooks.PrefillContext(index=p.index, patterns=_sparse_patterns(qwen), mode="auto",
                               min_sparse_len=1, keep_plans=True, sparse=False)
    h, _ = _chunked(qwen, p, embeds, 16, ctx)
    assert ctx.sparse is False and not ctx.densities
    torch.testing.assert_close(h, _chunked(qwen, p, embeds, 16)[0], atol=0, rtol=0)
    ctx = hooks.PrefillContext(index=p.index, patterns=None, mode="auto", min_sparse_len=1)
    _chunked(qwen, p, embeds, 16, ctx)
    assert ctx.sparse is False                    # no patterns: auto stays dense


# ---------------------------------------------------------------------- cancel
def test_cancel_is_checked_before_every_layer(qwen):
    p = _prepared(qwen, "qwen")
    with torch.inference_mode():
        embeds = qwen.embed(p)
    layers = len(qwen.text_model.layers)
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > layers        # passes every layer's check, then stops

    ctx = hooks.PrefillContext(index=p.index, mode="dense", cancel=cancel)
    _chunked(qwen, p, embeds, 16, ctx)            # every check passed: the prefill completes
    assert len(calls) == layers                   # once before each layer
    calls.clear()
    stop_at = iter([False, True])
    ctx = hooks.PrefillContext(index=p.index, mode="dense", cancel=lambda: next(stop_at, True))
    with pytest.raises(Cancelled, match="layer 1"):
        _chunked(qwen, p, embeds, 16, ctx)


# ---------------------------------------------------------------------- GPU: peak memory
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_is_bounded_by_the_chunk_on_gpu():
    """At 64K tokens of a wide-MLP Qwen2 layer stack in bf16, the chunked prefill's peak above
    weights + inputs is the residual, q, the attention output, the cache and chunk-sized
    temporaries; the one-shot forward's MLP alone needs 3 x [N, intermediate]."""
    from transformers import Qwen2Config, Qwen2Model
    n, hidden, inter, chunk = 65536, 512, 8192, 4096
    cfg = Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=n)
    with torch.device("cuda"):
        tm = Qwen2Model._from_config(cfg, dtype=torch.bfloat16,
                                     attn_implementation=hooks.register()).eval()
    x = torch.randn(1, n, hidden, device="cuda", dtype=torch.bfloat16)
    bytes_nh = n * hidden * 2
    kv = 2 * 2 * n * (hidden // 2) * 2            # layers x (k, v) x N x kv width x bf16

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    chunked = peak(lambda: prefill(tm, x.clone(), _new_cache(tm), chunk=chunk))
    # residual (the clone), q, attention output, k/v twice while the cache copies them, the
    # cache, rope, chunk temporaries (MLP: 3 x chunk x inter)
    bound = 4 * bytes_nh + 2 * kv + 4 * chunk * inter * 2 + (64 << 20)
    assert chunked <= bound, (chunked / 2**20, bound / 2**20)
    from mminfer.models.base import _cache_kwarg
    with torch.inference_mode():
        one = peak(lambda: tm(inputs_embeds=x, use_cache=True,
                              **{_cache_kwarg(tm): _new_cache(tm)}))
    assert one > bound                             # the check can tell the two apart


# ---------------------------------------------------------------------- the benchmark
def _benchmark_module():
    return load_script("benchmarks/prefill.py", "bench_prefill")


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_benchmark_runs_the_engine(request, kind):
    """benchmarks/prefill.py times this engine (no copy of its own): on the CPU at a small
    size its row is the engine's cache and the engine's logits."""
    bench = _benchmark_module()
    assert bench.prefill is prefill
    adapter = request.getfixturevalue("qwen" if kind == "qwen" else "longvila")
    tm, head = adapter.text_model, adapter.lm_head
    row = bench.run_one(tm, head, kind, 800, "dense", None, chunk=64)
    index = bench.layout(kind, 800)
    cfg = tm.config
    kv_width = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    assert row["n"] == index.n and row["mode"] == "dense" and row["ttft_ms"] > 0
    assert row["kv_cache_gib"] * 2**30 == cfg.num_hidden_layers * 2 * index.n * kv_width * 4
    pos = bench.positions(kind, index, torch.device("cpu"))
    with torch.inference_mode():
        got = bench.run_prefill(tm, head, index, pos, None, chunk=64)
        ref = head(tm(inputs_embeds=bench._embeds(tm, index, "cpu"),
                      position_ids=pos).last_hidden_state[:, -1:])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_decode_steps_skip_cudnn_and_prefill_keeps_it(monkeypatch):
    """Decode (few queries on a CUDA cache) runs SDPA without cuDNN, whose per-shape plans
    cost ~1.3 ms of host time per layer and step; prefill and CPU calls are left alone."""
    import torch
    from mminfer.models import hooks

    class FakeCuda:
        is_cuda = True
    calls = []
    import torch.nn.attention as A
    monkeypatch.setattr(hooks, "sdpa_kernel", lambda backends: calls.append(backends) or
                        __import__("contextlib").nullcontext())
    with hooks.decode_backends(FakeCuda(), 1):
        pass
    assert calls and A.SDPBackend.CUDNN_ATTENTION not in calls[0]
    assert A.SDPBackend.FLASH_ATTENTION in calls[0] and A.SDPBackend.MATH in calls[0]
    calls.clear()
    with hooks.decode_backends(FakeCuda(), 4096), hooks.decode_backends(torch.zeros(1), 1):
        pass
    assert calls == []


@pytest.mark.gpu
def test_decode_step_on_cuda_does_not_use_cudnn():
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mminfer.models import hooks
    q = torch.randn(1, 28, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 5000, 128, device="cuda", dtype=torch.bfloat16)
    with hooks.decode_backends(q, 1):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), k.float(),
                                                           enable_gqa=True)
    assert (out.float() - ref).abs().max() < 2e-2
