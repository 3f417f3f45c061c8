"""layer_attention: the per-layer entry point used by the transformers hook."""

import pytest
import torch

from mminfer.sparse.attention import layer_attention
from mminfer.kernels import masked_attention
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import HeadPattern, a_shape, grid, vertical_slash
from mminfer.engine.timing import StageTimer

VS = vertical_slash(n_vertical=8, n_slash=4, window=8, sink=2)
HEADS = [HeadPattern("q", {"video": grid(sink=2, window=8, min_lift=0.0, fallback=VS),
                           "text": VS}),
         HeadPattern.single(VS, "k"),
         HeadPattern.single(a_shape(sink=4, window=16)),
         HeadPattern.single(grid(sink=2, window=8, min_lift=1e9, fallback=VS))]


def _inputs(seed=0, H=4, Hkv=2, D=32):
    idx = ModalityIndex.from_segments([("text", 12), ("video", 4, 4, 6, 0), ("text", 30)])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, idx.n, D, generator=g)
    k = torch.randn(1, Hkv, idx.n, D, generator=g)
    v = torch.randn(1, Hkv, idx.n, D, generator=g)
    return idx, q, k, v


def _sdpa(q, k, v, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True, scale=scale)


def _tiny_qwen2():
    """A 2-layer Qwen2 with 4 query and 2 KV heads, random weights: the hook's host."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def test_sparse_attention_needs_the_modality_index():
    """Dense or sparse is decided once per request (hooks.choose_attention, tested in
    tests/models/test_prefill.py); layer_attention only computes the sparse path."""
    idx, q, k, v = _inputs()
    with pytest.raises(ValueError, match="ModalityIndex"):
        layer_attention(q, k, v, None, HEADS)


def test_sparse_path_matches_masked_attention_of_its_plan():
    idx, q, k, v = _inputs(seed=1)
    B, H, N, D = q.shape
    buf = torch.full((B, N, H, D), float("nan"))
    timer = StageTimer()
    scale = 0.3
    out, plan = layer_attention(q, k, v, idx, HEADS, return_plan=True,
                                scale=scale, out=buf.transpose(1, 2), timer=timer)
    assert out.data_ptr() == buf.data_ptr()
    assert plan.block_m == 16 and plan.row_groups == idx.row_groups()
    mask = plan.masks()
    ref, _ = masked_attention(q, k, v, mask, scale=scale)
    torch.testing.assert_close(buf.transpose(1, 2), ref, atol=2e-5, rtol=2e-5)
    # Sparse for real: fewer pairs than the causal triangle, and not the dense answer.
    assert float(mask.float().sum()) < 0.9 * H * N * (N + 1) / 2
    assert (buf.transpose(1, 2) - _sdpa(q, k, v, scale)).abs().max() > 1e-3
    assert {"index", "attention"} <= set(timer.totals_ms())


def test_sparse_path_rejects_wrong_head_count():
    idx, q, k, v = _inputs()
    with pytest.raises(ValueError, match="3 head patterns for 4 query heads"):
        layer_attention(q, k, v, idx, HEADS[:3])


def test_through_the_transformers_hook_full_budget_equals_sdpa():
    """The hook's contract: HeadPatternConfig.layer(i) -> layer_attention(..., out=view,
    timer=...), plans kept for reporting; full budgets reproduce the dense model."""
    from mminfer.sparse.estimate import full_budget
    from mminfer.models.hooks import PrefillContext, prefill_context, register
    from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity

    model = _tiny_qwen2()
    idx = ModalityIndex.from_segments([("text", 6), ("video", 2, 4, 6, 0), ("text", 10)])
    ids = torch.randint(0, 100, (1, idx.n))
    patterns = HeadPatternConfig(ModelIdentity("tiny", "main", 2, 4, 2, 16),
                                 [full_budget(HEADS, idx.n)] * 2)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids).logits
        model.set_attn_implementation(register())
        timer = StageTimer()
        ctx = PrefillContext(index=idx, patterns=patterns, mode="sparse", timer=timer,
                             keep_plans=True)
        with prefill_context(ctx):
            out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert set(ctx.densities) == {0, 1}
    assert ctx.densities[0].row_groups == idx.row_groups()   # Q-boundary head
    assert {"index", "attention"} <= set(timer.totals_ms())


def test_reference_engine_runs_the_same_plan_by_row_chunks_without_triton():
    """engine="reference" (the CPU's way to measure sparse answers at long N) gives what the
    kernel gives on the same plan: exact masked attention of the plan's mask, built a few rows
    at a time; the chunks put together are the whole mask, at any chunk size."""
    from mminfer.kernels.reference import plan_attention
    idx, q, k, v = _inputs(seed=2)
    B, H, N, D = q.shape
    buf = torch.full((B, N, H, D), float("nan"))
    out, plan = layer_attention(q, k, v, idx, HEADS, return_plan=True, scale=0.3,
                                out=buf.transpose(1, 2), engine="reference")
    assert out.data_ptr() == buf.data_ptr()
    mask = plan.masks()
    for rows in (7, 16, N):
        chunks = list(plan.mask_rows(rows))
        assert [r0 for r0, _ in chunks] == list(range(0, N, rows))
        assert torch.equal(torch.cat([m for _, m in chunks], 2), mask)
    ref, ref_lse = masked_attention(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(buf.transpose(1, 2), ref, atol=2e-5, rtol=2e-5)
    got, lse = plan_attention(q, k, v, plan, scale=0.3, rows=5, return_lse=True)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    assert (got - _sdpa(q, k, v, 0.3)).abs().max() > 1e-3       # sparse for real
    with pytest.raises(ValueError, match="engine 'flash' is not one of kernel, reference"):
        layer_attention(q, k, v, idx, HEADS, engine="flash")
    # the kernel on the same plan (CPU: the Triton interpreter)
    from mminfer.kernels.runtime import interpreted
    if q.is_cuda or interpreted():
        kern = layer_attention(q, k, v, idx, HEADS, scale=0.3)
        torch.testing.assert_close(kern, got, atol=2e-5, rtol=2e-5)


def test_reference_engine_through_the_hook_with_gpu_tiles():
    """PrefillContext(engine="reference", block=(128, 64)): the hook plans with the GPU's tiles
    and runs the plan without Triton; at full budgets that is the dense model again."""
    from mminfer.sparse.estimate import full_budget
    from mminfer.models.hooks import PrefillContext, prefill_context, register
    from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity

    model = _tiny_qwen2()
    idx = ModalityIndex.from_segments([("text", 6), ("video", 8, 4, 6, 0), ("text", 10)])
    ids = torch.randint(0, 100, (1, idx.n))
    full = HeadPatternConfig(ModelIdentity("tiny", "main", 2, 4, 2, 16),
                             [full_budget(HEADS, idx.n)] * 2)
    sparse = HeadPatternConfig(ModelIdentity("tiny", "main", 2, 4, 2, 16), [HEADS] * 2)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids).logits
        model.set_attn_implementation(register())
        got = {}
        for name, pats in (("full", full), ("sparse", sparse)):
            ctx = PrefillContext(index=idx, patterns=pats, mode="sparse", keep_plans=True,
                                 engine="reference", block=(128, 64))
            with prefill_context(ctx):
                got[name] = model(ids).logits
            assert ctx.densities[0].block_m == 128 and ctx.densities[0].block_n == 64
    torch.testing.assert_close(got["full"], ref, atol=1e-5, rtol=1e-5)
    assert (got["sparse"] - ref).abs().max() > 1e-4
