"""A piece's sparse attention (``layer_attention(..., q_start=)``): the rows ``[q_start, N)``
planned from the piece's own last queries against every key, positions absolute.

Exact where it must be: when the piece starts on the row-block grid and holds every query the
one-shot estimate reads, its plan is the one-shot plan's rows (the same grid strides and
phases, modality groups, verticals, slashes and key blocks) and its output the one-shot
output's rows; at any offset the kernel computes its own plan's mask exactly; a query region
with no row in the piece costs nothing and breaks nothing. Through the transformers hook,
``prefill(append=True)`` of a piece with full budgets is the dense one-shot prefill.
"""

import pytest
import torch

from mminfer.kernels import masked_attention
from mminfer.sparse.attention import layer_attention
from mminfer.sparse.estimate import full_budget
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import (HeadPattern, a_shape, block, dense, grid,
                                     vertical_slash)

VS = vertical_slash(n_vertical=8, n_slash=4, window=8, sink=2)
# Text rows never read the proxy here: the one-shot's last text queries include the text
# before the video, which a piece does not hold (its estimate reads the piece's own).
HEADS = [HeadPattern("q", {"video": grid(sink=2, window=8, min_lift=0.0, fallback=VS),
                           "text": a_shape(sink=4, window=16)}),
         HeadPattern.single(VS, "k"),
         HeadPattern.single(block(top_k=3, window=16)),
         HeadPattern.single(grid(sink=2, window=8, min_lift=1e9, fallback=VS)),
         HeadPattern("2d", {"video->video": grid(sink=0, window=4, min_lift=0.0,
                                                 fallback=VS),
                            "video->text": VS, "text->text": dense(),
                            "text->video": a_shape(sink=0, window=8)}),
         HeadPattern.single(a_shape(sink=4, window=16))]

# text 12 | video: 8 frames of a 4 x 6 grid, [12, 204) | text 30: N = 234. With 16-row
# blocks, 140 = 12 + 8 * 16 starts a video block and the last 64 video queries [140, 204)
# and the last 64 queries [170, 234) all lie in the piece.
INDEX = ModalityIndex.from_segments([("text", 12), ("video", 8, 4, 6, 0), ("text", 30)])
ALIGNED = 140


def _inputs(seed=0, H=6, Hkv=2, D=32):
    g = torch.Generator().manual_seed(seed)
    n = INDEX.n
    q = torch.randn(1, H, n, D, generator=g)
    k = torch.randn(1, Hkv, n, D, generator=g)
    v = torch.randn(1, Hkv, n, D, generator=g)
    # a planted grid (every 6th key of the video strong) so the grid heads keep their lines
    k[:, :, 12 + 3:204:6] *= 2.5
    return q, k, v


def test_a_piece_on_the_block_grid_is_the_one_shot_plans_rows():
    q, k, v = _inputs(seed=1)
    one, p_one = layer_attention(q, k, v, INDEX, HEADS, return_plan=True, scale=0.3)
    part, p_part = layer_attention(q[:, :, ALIGNED:].contiguous(), k, v, INDEX, HEADS,
                                   return_plan=True, scale=0.3, q_start=ALIGNED)
    assert p_part.q_start == ALIGNED and p_part.n == INDEX.n
    assert p_part.row_groups == INDEX.row_groups()
    m_one, m_part = p_one.masks(), p_part.masks()
    assert torch.equal(m_part, m_one[:, :, ALIGNED:])
    # the grids' lines are absolute: their span starts where the video does, not the piece
    grids = [sp.primary for sp in p_part.specs if hasattr(sp, "primary")]
    assert grids and all(int(torch.as_tensor(g.start)) == 12 for g in grids)
    # the planted grid (stride 6, phase 3 from the video's start) is found again, though the
    # piece starts 128 rows in, at phase 2 of it
    ones = [sp.primary for sp in p_one.specs if hasattr(sp, "primary")]
    for g, o in zip(grids, ones):
        assert torch.equal(g.stride, o.stride) and torch.equal(g.phase, o.phase)
    assert any((g.stride == 6).all() and (g.phase == 3).all() for g in grids)
    torch.testing.assert_close(part, one[:, :, ALIGNED:], atol=1e-5, rtol=1e-5)
    # and sparse for real: the piece's rows lose pairs that dense attention has
    causal = torch.ones(INDEX.n, INDEX.n, dtype=torch.bool).tril()[ALIGNED:]
    assert m_part.sum() < 0.8 * causal.sum() * q.shape[1]


def test_any_offset_computes_its_own_plan_exactly():
    q, k, v = _inputs(seed=2)
    for q_start in (ALIGNED + 5, 60, 210):      # inside the video, early, in the last text
        rows = q[:, :, q_start:].contiguous()
        out, plan = layer_attention(rows, k, v, INDEX, HEADS, return_plan=True, scale=0.3,
                                    q_start=q_start)
        mask = plan.masks()
        assert mask.shape[-2:] == (INDEX.n - q_start, INDEX.n)
        ref, _ = masked_attention(rows, k, v, mask, scale=0.3)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        # row q_start sees keys up to itself, not up to row 0
        assert not mask[..., 0, q_start + 1:].any() and mask[..., 0, q_start].all()
    # from 210 no video row is a query: the video regions were planned without an estimate
    assert plan.table[:, 2].unique().tolist() == [INDEX.group_of("text")]


def test_the_hook_runs_a_piece_sparse_and_full_budgets_give_the_dense_prefill():
    """prefill(append=True) over a cache holding the first rows: with the context's index
    covering every key, the hook plans the piece at its offset; full budgets reproduce the
    dense one-shot prefill, the real patterns do not (sparse for real)."""
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    from mminfer.models.hooks import PrefillContext, register
    from mminfer.models.prefill import prefill
    from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity

    cfg = Qwen2Config(vocab_size=100, hidden_size=192, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (1, INDEX.n))
    ident = ModelIdentity("tiny", "main", 2, 6, 2, 32)
    with torch.no_grad():
        embeds = model.model.get_input_embeddings()(ids)
        model.set_attn_implementation("sdpa")
        want = prefill(model.model, embeds.clone(), DynamicCache(), lm_head=model.lm_head)
        model.set_attn_implementation(register())
        got = {}
        for name, layers in (("full", [full_budget(HEADS, INDEX.n)] * 2), ("sparse", [HEADS] * 2)):
            cache = DynamicCache()
            prefill(model.model, embeds[:, :ALIGNED].clone(), cache)
            ctx = PrefillContext(index=INDEX, patterns=HeadPatternConfig(ident, layers),
                                 mode="sparse", keep_plans=True)
            got[name] = prefill(model.model, embeds[:, ALIGNED:].clone(), cache, ctx=ctx,
                                lm_head=model.lm_head, append=True)
            assert ctx.sparse and ctx.densities[0].q_start == ALIGNED
            assert cache.get_seq_length() == INDEX.n
    torch.testing.assert_close(got["full"], want, atol=1e-5, rtol=1e-5)
    assert (got["sparse"] - want).abs().max() > 1e-4


def test_the_hook_plans_a_piece_with_the_configs_share_of_the_lines():
    """``estimation.piece_lines`` reaches a piece's plan through the hook (the whole prompt's
    prefill keeps the full budgets): fewer vertical_slash lines, fewer tiles."""
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    from mminfer.models.hooks import PrefillContext, register
    from mminfer.models.prefill import prefill
    from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity

    cfg = Qwen2Config(vocab_size=100, hidden_size=192, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    model.set_attn_implementation(register())
    ident = ModelIdentity("tiny", "main", 2, 6, 2, 32)     # (the last layer: the last row only)
    heads = [HeadPattern.single(vertical_slash(n_vertical=24, n_slash=8, window=8, sink=2))] * 6
    vs = {}
    with torch.no_grad():
        embeds = model.model.get_input_embeddings()(torch.randint(0, 100, (1, INDEX.n)))
        for share in (1.0, 0.5):
            cache = DynamicCache()
            prefill(model.model, embeds[:, :ALIGNED].clone(), cache)
            ctx = PrefillContext(index=INDEX, mode="sparse", keep_plans=True,
                                 patterns=HeadPatternConfig(ident, [heads] * 2,
                                                            estimation={"piece_lines": share}))
            prefill(model.model, embeds[:, ALIGNED:].clone(), cache, ctx=ctx, append=True)
            plan = ctx.densities[0]
            spec = next(sp for sp in plan.specs if type(sp).__name__ == "VerticalSlash")
            vs[share] = (int((spec.slashes >= 0).sum(-1).max()),
                         plan.density()["tiles"]["vertical_slash"])
    assert vs[1.0][0] == 8 and vs[0.5][0] == 4, vs       # slashes per head: 8, then 4
    assert vs[0.5][1] < vs[1.0][1], vs


def test_a_sparse_piece_over_an_fp8_cache_attends_to_its_quantised_keys():
    """Over an FP8 cache a piece's rows see the cache's quantised keys, dense (the FP8
    flash-decoding kernel) or sparse (dequantised for the layer): at full budgets the two
    agree to float rounding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mminfer.models.hooks import PrefillContext, register
    from mminfer.models.kv import FP8, PrefixKV
    from mminfer.models.prefill import prefill
    from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity

    cfg = Qwen2Config(vocab_size=100, hidden_size=192, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(cfg).eval()
    model.set_attn_implementation(register())
    ids = torch.randint(0, 100, (1, INDEX.n))
    full = HeadPatternConfig(ModelIdentity("tiny", "main", 2, 6, 2, 32),
                             [full_budget(HEADS, INDEX.n)] * 2)
    got = {}
    with torch.no_grad():
        embeds = model.model.get_input_embeddings()(ids)
        for mode in ("dense", "sparse"):
            kv = PrefixKV.for_model(model.model, 64, dtype=FP8)
            prefill(model.model, embeds[:, :ALIGNED].clone(), kv)
            ctx = PrefillContext(index=INDEX, patterns=full, mode=mode, keep_plans=True)
            got[mode] = prefill(model.model, embeds[:, ALIGNED:].clone(), kv, ctx=ctx,
                                lm_head=model.lm_head, append=True)
            assert bool(ctx.densities) == (mode == "sparse")
    torch.testing.assert_close(got["sparse"], got["dense"], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_piece_over_16k_keys_on_the_gpu():
    """The compiled kernels with the GPU's tiles (128 x 64), bf16, d 128: a 4K-row piece at
    the end of a 16K-key video prompt, planned at its offset, against the fp32 masked
    attention of its own plan (row chunks); error within 2x PyTorch's own bf16 error on the
    same mask."""
    from mminfer.kernels.reference import plan_attention

    index = ModalityIndex.from_segments([("text", 30), ("video", 64, 16, 16, 0), ("text", 20)])
    q_start = 30 + 48 * 256                       # frame 48 of 64
    g = torch.Generator().manual_seed(5)
    n, H, Hkv, D = index.n, 6, 2, 128
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h in (H, Hkv, Hkv))
    k[:, :, 30 + 7:30 + 64 * 256:16] *= 2.5       # a planted grid: every 16th video key
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    rows = q[:, :, q_start:].contiguous()
    out, plan = layer_attention(rows, k, v, index, HEADS, return_plan=True, q_start=q_start)
    assert (plan.block_m, plan.q_start, plan.n_q) == (128, q_start, n - q_start)
    assert plan.density()["logical"] < 0.5
    ref = plan_attention(rows.float(), k.float(), v.float(), plan).float()
    err = (out.float() - ref).abs().max()
    # PyTorch's own bf16 error on the last 512 rows of the same mask
    r0, mask = list(plan.mask_rows(512))[-1]
    tail = slice(r0 - q_start, r0 - q_start + mask.shape[2])
    pt, _ = masked_attention(rows[:, :, tail], k, v, mask.cuda(), dtype=torch.bfloat16)
    tol = 2 * (pt.float() - ref[:, :, tail]).abs().max() + 1e-2
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"
