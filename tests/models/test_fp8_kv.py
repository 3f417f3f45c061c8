"""The FP8 KV cache (``--kv-cache-dtype fp8``): SlabLayer's quantisation (scales per KV head
from the prefix, later rows saturating, growth, bytes, moves), the prefill attending with the
layer's own unquantised K/V, and questions answered over an FP8 prefix (``continue_on``: the
suffix rows and every decode path) against the same model with its own-dtype cache.

The criterion against the unquantised cache (CPU, fp32 tiny models): the only difference is
the e4m3 rounding of K and V (relative 2^-4 at most per element, much less once averaged over
a head's dot products and the softmax), so (1) against a reference whose cache holds exactly
the quantise-dequantise of the same K/V (``FakeQuantLayer``, fp32 arithmetic), the FP8 path's
logits agree to fp32 rounding and its greedy tokens are the same: that isolates the kernel and
the plumbing from FP8 itself; (2) against the fp32 cache, the first token's logits are within
a relative L2 error of 2e-2 and the greedy tokens equal (we check the reference's top-2 margin
at the first token is well over the measured deviation, so equality is expected, not luck)."""

import pytest
import torch

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.engine.pipeline import Pipeline
from mminfer.kernels.fp8_attention import dequantize
from mminfer.models import decode
from mminfer.models.kv import (FP8, FP8_MAX, PrefixKV, SlabLayer, head_scales, kv_dtype,
                               quantize_into, scale_of)
from mminfer.models.prefill import prefill

from conftest import write_video
from tiny_cases import prepared_pair


def _kv(n, heads=(0.01, 1.0, 300.0), D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mag = torch.tensor(heads).view(1, -1, 1, 1)
    k = torch.randn(1, len(heads), n, D, generator=g) * mag
    v = torch.randn(1, len(heads), n, D, generator=g) * mag * 0.5
    return k, v


def _within_e4m3(deq, x, scale):
    """e4m3 round-to-nearest: half an ulp is 2^-4 of the value for normals, 2^-10 (in scaled
    units) for subnormals."""
    s = scale.view(1, -1, 1, 1)
    return bool(((deq - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * s + 1e-30).all())


def test_kv_dtype_names():
    assert kv_dtype("auto") is None and kv_dtype(None) is None
    assert kv_dtype("fp8") is FP8 and kv_dtype("fp8_e4m3") is FP8
    with pytest.raises(ValueError, match="fp8_e4m3"):
        kv_dtype("fp8_e5m2")


def test_slab_layer_round_trip_within_e4m3():
    k, v = _kv(40)
    layer = SlabLayer(headroom=4, dtype=FP8)
    keys, values = layer.update(k, v)
    assert keys.dtype == values.dtype == FP8 and keys.shape == k.shape
    # one scale per KV head, from the prefix's own amax: heads 4 orders of magnitude apart
    torch.testing.assert_close(layer.k_scale, k.abs().amax(dim=(0, 2, 3)) / FP8_MAX)
    torch.testing.assert_close(layer.v_scale, v.abs().amax(dim=(0, 2, 3)) / FP8_MAX)
    assert scale_of(keys) is layer.k_scale and scale_of(values) is layer.v_scale
    assert _within_e4m3(dequantize(keys, layer.k_scale), k, layer.k_scale)
    assert _within_e4m3(dequantize(values, layer.v_scale), v, layer.v_scale)
    # the largest value of each head is represented (448 exactly), none saturates
    torch.testing.assert_close(dequantize(keys, layer.k_scale).abs().amax(dim=(0, 2, 3)),
                               k.abs().amax(dim=(0, 2, 3)), rtol=1e-6, atol=0)
    prefix_bits = layer.k_buf[..., :40, :].view(torch.uint8).clone()

    # later rows: the same scales, a value past the prefix's amax saturates (never NaN),
    # the slab grows (headroom 4) and keeps the prefix's bytes
    k2, v2 = _kv(9, seed=1)
    k2[0, 1, 3, 5] = 50 * k[0, 1].abs().max()
    scales = layer.k_scale.clone()
    keys, values = layer.update(k2, v2)
    assert keys.shape[-2] == 49 and torch.equal(layer.k_scale, scales)
    deq = dequantize(keys, layer.k_scale)
    assert torch.isfinite(deq).all()
    assert deq[0, 1, 43, 5] == FP8_MAX * layer.k_scale[1]
    ok = k2.clone()
    ok[0, 1, 3, 5] = FP8_MAX * layer.k_scale[1]
    assert _within_e4m3(deq[..., 40:, :], ok.clamp(-FP8_MAX * scales.view(1, -1, 1, 1),
                                                   FP8_MAX * scales.view(1, -1, 1, 1)),
                        layer.k_scale)
    assert torch.equal(layer.k_buf[..., :40, :].view(torch.uint8), prefix_bits)


def test_slab_layer_bytes_and_move_carry_the_scales():
    k, v = _kv(30)
    ref = SlabLayer(dtype=None)
    ref.update(k.half(), v.half())
    layer = SlabLayer(dtype=FP8)
    layer.update(k, v)
    scale_bytes = 2 * 3 * 4
    assert layer.nbytes - scale_bytes == ref.nbytes // 2 == 30 * 3 * 16 * 2
    bits = layer.keys.view(torch.uint8).clone()
    layer.move("cpu", headroom=5)
    assert layer.k_buf.shape[-2] == 35 and layer.k_buf.dtype == FP8
    assert torch.equal(layer.keys.view(torch.uint8), bits)
    assert scale_of(layer.keys) is layer.k_scale and layer.k_scale is not None
    layer.crop(10)
    assert scale_of(layer.keys) is layer.k_scale and layer.keys.shape[-2] == 10
    kv = PrefixKV(2, dtype="fp8")
    assert all(x.quantized for x in kv.layers) and kv.store_dtype is FP8
    assert not any(x.quantized for x in PrefixKV(2).layers)


def test_quantize_in_chunks_equals_whole(monkeypatch):
    import mminfer.models.kv as kvmod
    k, _ = _kv(50)
    s = head_scales(k)
    whole = torch.empty(k.shape, dtype=FP8)
    quantize_into(whole, k, s)
    monkeypatch.setattr(kvmod, "QUANT_CHUNK", 7)
    torch.testing.assert_close(head_scales(k), s, rtol=0, atol=0)
    parts = torch.empty(k.shape, dtype=FP8)
    quantize_into(parts, k, s)
    assert torch.equal(parts.view(torch.uint8), whole.view(torch.uint8))


class FakeQuantLayer(SlabLayer):
    """The reference cache: fp32 rows holding exactly dequantise(quantise(K/V)) with the same
    per-head scales; the first write (the prefill) returns its inputs, as the FP8 prefill
    attends with its unquantised K/V."""

    def update(self, k, v, *args, **kwargs):
        first = self.k_scale is None
        if first:
            self.k_scale, self.v_scale = head_scales(k), head_scales(v)
        fq = []
        for x, s in ((k, self.k_scale), (v, self.v_scale)):
            q = torch.empty(x.shape, dtype=FP8)
            quantize_into(q, x, s)
            fq.append(dequantize(q, s, x.dtype))
        keys, values = super().update(*fq)
        return (k, v) if first else (keys, values)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    mp4 = write_video(root / "square.mp4", n_frames=16, fps=8.0, width=96, height=64,
                      noise=True)
    return prepared_pair(root, mp4)


def _answer(ad, prep, embeds, kv_dtype_, mode="lean", n=6, fake=False):
    ad.kv_cache_dtype, ad.decode_mode, eos = kv_dtype_, mode, ad.eos_token_ids
    ad.eos_token_ids = ()
    try:
        if fake:
            kv = PrefixKV.for_model(ad.text_model, 64)
            kv.layers = [FakeQuantLayer(64) for _ in kv.layers]
            with torch.inference_mode():
                prefill(ad.text_model, embeds[:, :prep.prefix_len].clone(), kv,
                        ad.positions(prep, 0, prep.prefix_len), kv_only_last=True)
        else:
            kv = ad.prefill_prefix(prep, embeds.clone(), headroom=3)
        got = ad.continue_on(kv, embeds[:, prep.prefix_len:], rope_delta=prep.rope_delta,
                             max_new_tokens=n)
    finally:
        ad.kv_cache_dtype, ad.decode_mode, ad.eos_token_ids = None, "auto", eos
    return kv, got


def test_prefill_attends_with_its_own_kv_and_stores_fp8(prepared):
    """The FP8 cache changes nothing of the prefill's own output (each layer attends with the
    K/V it computed, not the quantised copy), and the rows it stores are the model-dtype
    cache's rows within e4m3's rounding."""
    ad, prep, embeds = prepared["qwen"]
    P = prep.prefix_len
    outs = {}
    for dt in (None, FP8):
        kv = PrefixKV.for_model(ad.text_model, 8, dtype=dt)
        with torch.inference_mode():
            outs[dt] = (kv, prefill(ad.text_model, embeds[:, :P].clone(), kv,
                                    ad.positions(prep, 0, P), lm_head=ad.lm_head))
    (ref_kv, ref), (kv, got) = outs[None], outs[FP8]
    assert torch.equal(got, ref)
    assert kv.nbytes < ref_kv.nbytes / 3.9          # fp32 model here: a quarter (+ scales)
    for a, b in zip(kv.layers, ref_kv.layers):
        assert a.k_buf.dtype == FP8 and a.length == b.length == P
        assert _within_e4m3(dequantize(a.keys, a.k_scale), b.keys, a.k_scale)
        assert _within_e4m3(dequantize(a.values, a.v_scale), b.values, a.v_scale)


@pytest.mark.parametrize("kind", ["qwen", "longvila"])
def test_continue_on_fp8_cache_equals_the_dequantised_reference(kind, prepared):
    """FP8 path (Triton kernel under the interpreter: suffix rows and decode steps) against a
    fp32 cache holding the same dequantised values: agreement to fp32 rounding."""
    ad, prep, embeds = prepared[kind]
    kv, got = _answer(ad, prep, embeds, FP8)
    _, ref = _answer(ad, prep, embeds, None, fake=True)
    assert kv.layers[0].k_buf.dtype == FP8
    assert kv.get_seq_length() == prep.input_ids.shape[1] + 5     # suffix + answer rows
    torch.testing.assert_close(got.prefill_logits, ref.prefill_logits, atol=1e-4, rtol=1e-4)
    assert got.token_ids == ref.token_ids


def test_continue_on_fp8_cache_is_within_fp8_error_of_the_model_dtype(prepared):
    ad, prep, embeds = prepared["qwen"]
    _, ref = _answer(ad, prep, embeds, None)
    _, got = _answer(ad, prep, embeds, FP8)
    a, b = ref.prefill_logits.float(), got.prefill_logits.float()
    err = ((a - b).norm() / a.norm()).item()
    assert 0 < err < 2e-2           # > 0: the cache really was quantised
    top2 = a.topk(2).values
    assert top2[0] - top2[1] > 4 * (a - b).abs().max()     # a real margin, not a near tie
    assert got.token_ids == ref.token_ids


def test_every_decode_path_reads_the_fp8_cache_alike(prepared):
    """The lean step (hook -> kernel) and the text model's own forward (``_step``) on the FP8
    cache: the same greedy tokens (on a GPU, the graph path: test below)."""
    ad, prep, embeds = prepared["qwen"]
    _, lean = _answer(ad, prep, embeds, FP8, "lean")
    _, step = _answer(ad, prep, embeds, FP8, "step")
    assert decode.choose_path(ad) == "lean"
    assert lean.token_ids == step.token_ids and len(set(lean.token_ids)) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_on_an_fp8_cache_decodes_as_the_eager_step_on_cuda(tmp_path):
    """bf16 tiny model on the GPU: the prefill's peak memory drops by the cache's half less
    the one layer whose bf16 K/V exist while it attends; the graph path's direct FP8 slabs
    give the eager lean step's tokens."""
    layers, kv_heads, d, n = 8, 2, 32, 8192
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "q", hidden=256, layers=layers, heads=8,
                                kv_heads=kv_heads)
    ad = Pipeline(str(ckpt), attention="dense", device="cuda", dtype="bf16").adapter
    g = torch.Generator(device="cuda").manual_seed(0)
    embeds = torch.randn(1, n, 256, device="cuda", dtype=torch.bfloat16, generator=g)

    def prefilled(dt):
        kv = PrefixKV.for_model(ad.text_model, 64, dtype=dt)
        with torch.inference_mode():
            prefill(ad.text_model, embeds.clone(), kv, kv_only_last=True)
        return kv

    peaks = {}
    for dt in (None, FP8):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        kv = prefilled(dt)
        peaks[dt] = torch.cuda.max_memory_allocated() - base
        del kv
    cache = 2 * layers * kv_heads * n * d * 2                # bf16 K and V of every layer
    assert peaks[None] - peaks[FP8] > cache / 2 - 2 * cache / layers
    tokens = {}
    for mode in ("lean", "graph"):
        kv = prefilled(FP8)
        ad.decode_mode, eos = mode, ad.eos_token_ids
        ad.eos_token_ids = ()
        try:
            tokens[mode] = decode.decode_loop(ad, kv, [5], max_new_tokens=12)
        finally:
            ad.decode_mode, ad.eos_token_ids = "auto", eos
    assert tokens["graph"] == tokens["lean"] and len(set(tokens["lean"])) > 1


def test_graph_path_logic_on_fp8_slabs_emulated_on_the_cpu(prepared, monkeypatch):
    """StepGraphs with its segments run eagerly (no CUDA here: warm-up and capture replaced by
    plain calls): the direct-slab step on an FP8 cache (host writes the rows, the FP8 kernel
    attends between the segments) gives the lean step's tokens."""
    from types import SimpleNamespace
    monkeypatch.setattr(decode, "_warm_up", lambda dev, fn: fn())
    monkeypatch.setattr(decode, "_capture",
                        lambda dev, fns, pool=None: [SimpleNamespace(replay=f) for f in fns])
    ad, prep, embeds = prepared["qwen"]
    kv_lean, first = _answer(ad, prep, embeds, FP8, n=1)
    kv_graph, again = _answer(ad, prep, embeds, FP8, n=1)
    assert first.token_ids == again.token_ids
    eos, ad.eos_token_ids = ad.eos_token_ids, ()
    try:
        lean = decode.decode_loop(ad, kv_lean, list(first.token_ids), max_new_tokens=6,
                                  rope_delta=prep.rope_delta, mode="lean")
    finally:
        ad.eos_token_ids = eos
    dec = decode.decoder_of(ad)
    pos0 = ad.positions_after(prep.rope_delta, kv_graph.get_seq_length(), 1)
    with torch.inference_mode():
        g = decode.StepGraphs(dec, dec.position_ids(pos0, kv_graph))
        g.tok.fill_(first.token_ids[-1])
        slabs = g.direct_slabs(kv_graph)
        assert slabs is not None and all(s.quantized for s in slabs)
        out = list(first.token_ids)
        while len(out) < 6:
            out.append(int(g.step(kv_graph, slabs)))
    assert out == lean and len(set(out)) > 1
    assert kv_graph.get_seq_length() == kv_lean.get_seq_length()
