"""Kernel exactness: every pattern family and both groupings against fp32 masked attention
over the oracle masks, written from the *specs* (``oracle.py`` here), never from the
compiled plan: a bug in ``SparsePlan.build`` cannot reach kernel and oracle alike.

CPU runs use the Triton interpreter (fp32/fp16, small N); the same cases run in bf16/fp16
at larger N on a GPU (``-m gpu``; skipped without CUDA).
"""

import pytest
import torch

from mminfer.kernels import (AShape, Block, Fallback, Grid, SparsePlan, VerticalSlash, dense,
                             masked_attention, row_table, sparse_attention)
from mminfer.kernels.masks import spec_mask_rows
from mminfer.kernels.runtime import interpreted

from oracle import replay_tiles, spec_masks

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

# (device, dtype, n, block_m): small sizes under the interpreter, real tiles on the GPU.
CPU_CASES = [("cpu", torch.float32, 157, 16), ("cpu", torch.float16, 131, 32)]
GPU_CASES = [pytest.param("cuda", torch.bfloat16, 1531, 128, marks=[pytest.mark.gpu, gpu]),
             pytest.param("cuda", torch.float16, 777, 64, marks=[pytest.mark.gpu, gpu])]
CASES = CPU_CASES + GPU_CASES
if HAS_CUDA:  # the interpreter cases cannot run without TRITON_INTERPRET
    CASES = GPU_CASES


def _inputs(b, hq, hkv, n, d, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    # A few strong keys make softmax peaky, so masking errors cannot hide in the average.
    k[:, :, ::17] *= 3
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def build(n, hq, specs, **kw):
    """The plan, and the oracle mask ``[B, H, N, N]`` evaluated from the same specs."""
    plan = SparsePlan.build(n, hq, specs, **kw)
    oracle = spec_masks(specs, n, hq, block_m=kw["block_m"], block_n=kw.get("block_n", 64),
                        row_groups=kw.get("row_groups"), batch=kw.get("batch", 1))
    return plan, oracle


def check(q, k, v, plan, oracle, scale=None, config=None):
    """Kernel error <= 2x PyTorch's own error in the same dtype (+ representability atol).
    ``config``: tile overrides of the launch (None: the device's tiles)."""
    mask_cpu = oracle
    mask = mask_cpu.to(q.device)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    out, lse = sparse_attention(q, k, v, plan, out=out, return_lse=True, scale=scale,
                                config=config)
    assert not torch.isnan(out).any(), "rows left unwritten"
    ref, ref_lse = masked_attention(q, k, v, mask, scale=scale)
    if q.dtype == torch.float32:
        tol = 2e-5
    else:
        pt, _ = masked_attention(q, k, v, mask, scale=scale, dtype=q.dtype)
        atol = 2 * (ref.to(q.dtype) + 0.3 - 0.3 - ref.to(q.dtype)).float().abs().max()
        tol = 2 * (pt.float() - ref).abs().max() + atol
    err = (out.float() - ref).abs().max()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-3)
    return mask_cpu, out.cpu()


def _vs(b, h, n, nv, ns, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    vert = torch.randint(0, n, (b, h, nv), generator=g)
    vert[..., :2] = torch.tensor([0, 1])          # sinks as forced verticals
    vert[..., -1] = -1                            # padding is ignored
    sl = torch.randint(0, n, (b, h, ns), generator=g)
    sl[..., 0] = 0
    return vert.to(device), sl.to(device)


def _blocks(b, h, r, n, block_n, k, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    nkb = (n + block_n - 1) // block_n
    kb = torch.randint(0, nkb, (b, h, r, k), generator=g)
    kb[..., -1] = -1
    return kb.to(device)


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
@pytest.mark.parametrize("family", ["a_shape", "grid_cols", "grid_rows", "grid_both",
                                    "vertical_slash", "block", "dense"])
def test_pattern_exact(device, dtype, n, block_m, family):
    hq, hkv, d = 4, 2, 64
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device)
    heads = list(range(hq))
    if family == "a_shape":
        spec = AShape(heads, sink=[1, 5, 9, 0], window=[block_m, 3, 40, 2 * block_m + 7])
    elif family.startswith("grid"):
        lines = family.split("_")[1]
        spec = Grid(heads, start=[5, 0, 11, 20], end=[n - 3, n, n - 20, n], stride=[7, 13, 5, 31],
                    phase=[3, 0, 4, 30], lines=lines, sink=[4, 0, 2, 8], window=[16, 0, 33, 5])
    elif family == "vertical_slash":
        vert, sl = _vs(1, hq, n, 9, 7, device)
        spec = VerticalSlash(heads, vert, sl, window=[0, 8, block_m, 3 * block_m])
    elif family == "block":
        r = row_table(n, block_m).shape[0]
        spec = Block(heads, _blocks(1, hq, r, n, 32, 3, device), window=[0, 5, 16, 40])
    else:
        spec = dense(heads, n)
    # key blocks of 32 keys: visited as two 16-key tiles on the CPU
    plan, oracle = build(n, hq, [spec], block_m=block_m, block_n=32, device=device)
    mask, _ = check(q, k, v, plan, oracle)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert not (mask & ~causal).any(), "mask must be causal"
    assert mask.diagonal(dim1=-2, dim2=-1).all(), "every row sees itself"
    if family == "dense":
        assert mask.all(dim=0).eq(causal).all()


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
@pytest.mark.parametrize("ratio,d", [(1, 128), (7, 64), (8, 80), (7, 128)])
def test_gqa_and_head_dims(device, dtype, n, block_m, ratio, d):
    hkv = 1 if ratio > 1 else 3
    hq = hkv * ratio
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=ratio + d)
    # Every family in one plan, heads interleaved across the KV groups.
    fams = [h % 4 for h in range(hq)]
    by = {f: [h for h in range(hq) if fams[h] == f] for f in range(4)}
    r = row_table(n, block_m).shape[0]
    specs = []
    if by[0]:
        specs.append(AShape(by[0], sink=3, window=block_m))
    if by[1]:
        specs.append(Grid(by[1], start=4, end=n, stride=9, phase=2, lines="both", sink=2,
                          window=8))
    if by[2]:
        vert, sl = _vs(1, len(by[2]), n, 6, 5, device, seed=ratio)
        specs.append(VerticalSlash(by[2], vert, sl, window=4))
    if by[3]:
        specs.append(Block(by[3], _blocks(1, len(by[3]), r, n, 16, 2, device), window=0))
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    check(q, k, v, plan, oracle)


# text - video - text - video - text, as in a multi-video prompt
def _layout(n):
    cuts = [0, 13, 13 + (n - 40) // 2, 13 + (n - 40) // 2 + 11, n - 16, n]
    groups = [0, 1, 0, 1, 0]
    return [(cuts[i], cuts[i + 1], groups[i]) for i in range(5)]


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_q_boundary(device, dtype, n, block_m):
    hq, hkv, d = 4, 2, 64
    spans = _layout(n)
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=5)
    v_start, v_end = spans[1][0], spans[1][1]
    vert, sl = _vs(1, 2, n, 5, 4, device)
    specs = [
        # video rows: grid inside the first video span (cols) / A-shape; text rows: VS / dense
        Grid([0], start=v_start, end=v_end, stride=6, phase=1, lines="both", sink=3, window=4,
             qgroup=1),
        Grid([1], start=v_start, end=spans[3][1], stride=5, phase=0, lines="cols", sink=0,
             window=7, qgroup=1),
        AShape([2, 3], sink=2, window=[3, block_m], qgroup=1),
        VerticalSlash([0, 2], vert, sl, window=2, qgroup=0),
        dense([1, 3], n, qgroup=0),
    ]
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans,
                         device=device)
    # Row blocks never straddle modality spans.
    for a, b_, g in plan.table.cpu().tolist():
        assert any(s <= a and b_ <= e and gg == g for s, e, gg in spans)
    mask, _ = check(q, k, v, plan, oracle)
    rows_text = torch.zeros(n, dtype=torch.bool)
    for s, e, g in spans:
        rows_text[s:e] = g == 0
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    # head 1 text rows are dense; head 2 video rows are A-shape (no grid columns)
    assert (mask[0, 1][rows_text] == causal[rows_text]).all()
    assert not (mask[0, 1][~rows_text] == causal[~rows_text]).all()


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_2d_boundary(device, dtype, n, block_m):
    hq, hkv, d = 3, 1, 64
    spans = _layout(n)
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=7)
    vert, sl = _vs(1, 1, n, 6, 3, device)
    specs = [
        # head 0: 2D — video->video grid columns, video->text dense, text->video VS, text->text dense
        Grid([0], start=spans[1][0], end=spans[3][1], stride=4, phase=1, lines="cols", sink=0,
             window=2, qgroup=1, kgroup=1),
        dense([0], n, qgroup=1, kgroup=0),
        VerticalSlash([0], vert, sl, window=1, qgroup=0, kgroup=1),
        dense([0], n, qgroup=0, kgroup=0),
        # head 2: 2D with A-shapes; head 1: no boundary
        AShape([2], sink=1, window=block_m, qgroup=-1, kgroup=0),
        AShape([2], sink=0, window=3, qgroup=-1, kgroup=1),
        Grid([1], start=spans[1][0], end=spans[1][1], stride=3, phase=2, lines="both",
             window=5),
    ]
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans,
                         device=device)
    assert plan.heads_2d == [0, 2]
    mask, _ = check(q, k, v, plan, oracle)
    key_text = torch.zeros(n, dtype=torch.bool)
    for s, e, g in spans:
        key_text[s:e] = g == 0
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    # head 0: every (row, text key) pair that is causal is in (dense text keys)
    assert (mask[0, 0][:, key_text] == causal[:, key_text]).all()


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_full_budget_is_dense(device, dtype, n, block_m):
    hq, hkv, d = 4, 1, 64
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=3)
    allv = torch.arange(n, device=device).expand(1, 1, n)
    r = row_table(n, block_m).shape[0]
    allb = torch.arange((n + 15) // 16, device=device).expand(1, 1, r, -1)
    specs = [AShape([0], sink=n, window=0), VerticalSlash([1], allv, allv[..., :1], window=0),
             Block([2], allb, window=0),
             Grid([3], start=0, end=n, stride=1, phase=0, lines="cols", sink=0, window=0)]
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    mask, out = check(q, k, v, plan, oracle)
    assert mask.all(dim=(0, 1)).eq(torch.ones(n, n, dtype=torch.bool).tril()).all()
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1),
        is_causal=True).cpu()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - sdpa).abs().max() < tol


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_batch_with_per_request_grid(device, dtype, n, block_m):
    hq, hkv, d = 2, 1, 64
    q, k, v = _inputs(2, hq, hkv, n, d, dtype, device, seed=11)
    stride = torch.tensor([[5, 7], [11, 3]], device=device)
    phase = torch.tensor([[4, 0], [2, 1]], device=device)
    spec = Grid([0, 1], start=3, end=n - 2, stride=stride, phase=phase, lines="both", sink=2,
                window=6)
    plan, oracle = build(n, hq, [spec], block_m=block_m, block_n=16, batch=2, device=device)
    mask, _ = check(q, k, v, plan, oracle)
    assert not torch.equal(mask[0], mask[1])


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_density_counts_match_masks(device, dtype, n, block_m):
    hq = 4
    vert, sl = _vs(1, 2, n, 5, 4, device)
    specs = [AShape([0], sink=4, window=8), VerticalSlash([1, 2], vert, sl, window=3),
             Grid([3], start=2, end=n, stride=6, phase=5, lines="both", sink=1, window=2)]
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    dens = plan.density()
    tri = hq * n * (n + 1) / 2
    assert dens["logical"] == pytest.approx(oracle.sum().item() / tri, abs=1e-9)
    assert dens["physical"] >= dens["logical"]
    _density_is_the_oracles_and_the_replays(plan, oracle)


def _density_is_the_oracles_and_the_replays(plan, oracle):
    """plan.density() (closed form over the plan's arrays) counts the oracle's pairs, per
    head, and the tiles of the traversal replayed here loop by loop (``replay_tiles``)."""
    d = plan.density()
    B, n = plan.batch, plan.n
    tri = n * (n + 1) / 2
    per_head = oracle.sum((0, 2, 3))
    assert d["pairs"] == float(per_head.sum())
    assert torch.equal(d["logical_per_head"], per_head.double() / (B * tri))
    tiles, by_family, dense_tiles = replay_tiles(plan)
    assert d["tiles"] == by_family
    assert torch.equal(d["physical_per_head"], tiles.double() / (B * dense_tiles))


def _mixed_specs(n, block_m, device, batch=1):
    """Every family, Q- and 2D-boundary slots, grid row lines across groups and a Fallback
    whose choice differs per request and head: the plan kinds density must count."""
    spans = _layout(n)
    r = row_table(n, block_m, spans).shape[0]
    vert, sl = _vs(batch, 2, n, 6, 3, device)
    v_lo, v_hi = spans[1][0], spans[1][1]
    use = torch.tensor([[True, False, True], [False, True, True]][:batch], device=device)
    return spans, [
        Grid([0], start=spans[1][0], end=spans[3][1], stride=4, phase=1, lines="cols",
             sink=3, window=2, qgroup=1, kgroup=1),
        Block([0], _blocks(batch, 1, r, n, 16, 3, device), window=3, qgroup=1, kgroup=0),
        VerticalSlash([0], vert[:, :1], sl[:, :1], window=1, qgroup=0, kgroup=1),
        AShape([0], sink=2, window=5, qgroup=0, kgroup=0),
        Fallback(Grid([1, 2, 3], start=v_lo, end=v_hi, stride=[3, 5, 2], phase=[2, 0, 1],
                      lines=["both", "rows", "both"], sink=1, window=[5, 0, 9], qgroup=1),
                 [VerticalSlash([1, 3], vert, sl, window=[4, 0], qgroup=1),
                  AShape([2], sink=3, window=6, qgroup=1)], use=use),
        Grid([1, 2, 3], start=spans[2][0], end=spans[2][1], stride=3, phase=1, lines="both",
             sink=0, window=4, qgroup=0),
    ]


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
@pytest.mark.parametrize("batch", [1, 2])
def test_mixed_plan_exact_and_its_density_counts_it(device, dtype, n, block_m,
                                                                batch):
    hq, hkv, d = 4, 2, 64
    spans, specs = _mixed_specs(n, block_m, device, batch)
    q, k, v = _inputs(batch, hq, hkv, n, d, dtype, device, seed=13)
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans,
                         batch=batch, device=device)
    check(q, k, v, plan, oracle)
    dens = plan.density()
    assert dens["logical"] == pytest.approx(oracle.sum().item() / (batch * hq * n * (n + 1) / 2))
    _density_is_the_oracles_and_the_replays(plan, oracle)


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_fallback_runs_exactly_one_side_per_request_and_head(device, dtype, n, block_m):
    hq, hkv, d = 4, 2, 64
    spans, specs = _mixed_specs(n, block_m, device, batch=2)
    fb = specs[4]
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans, batch=2,
                         device=device)
    q, k, v = _inputs(2, hq, hkv, n, d, dtype, device, seed=17)
    check(q, k, v, plan, oracle)   # poisoned output: the chosen side wrote every row
    assert torch.equal(plan.launches["grid"].active[:, 1:4].cpu(), ~fb.use.cpu())
    # The oracle of the Fallback is, per (request, head), the mask of the side it uses.
    use = fb.use.cpu()
    kw = dict(block_m=block_m, block_n=16, row_groups=spans, batch=2)
    grid_only = spec_masks([fb.primary], n, hq, **kw)
    alt_only = spec_masks(list(fb.alternatives), n, hq, **kw)
    for b in range(2):
        for i, h in enumerate(fb.primary.heads):
            rows = torch.tensor([g == 1 for s, e, g in spans for _ in range(s, e)])
            want = (alt_only if use[b, i] else grid_only)[b, h][rows]
            assert torch.equal(oracle[b, h][rows], want)


def test_fallback_validation_messages():
    n = 64
    use = torch.tensor([[True, False]])
    g = Grid([0, 1], 0, n, stride=4, phase=1)
    with pytest.raises(ValueError, match="exactly once"):
        SparsePlan.build(n, 2, [Fallback(g, [AShape([0])], use)], block_m=16)
    with pytest.raises(ValueError, match="alternative head 1 .query group 1"):
        SparsePlan.build(n, 2, [Fallback(g, [AShape([0]), AShape([1], qgroup=1)], use)],
                         block_m=16, row_groups=[(0, 32, 0), (32, n, 1)])
    with pytest.raises(ValueError, match=r"use must be a \[1, 2\] bool tensor"):
        SparsePlan.build(n, 2, [Fallback(g, [AShape([0, 1])], use[:, :1])], block_m=16)
    # The alternatives never count for coverage: the primary's heads are covered once.
    plan = SparsePlan.build(n, 2, [Fallback(g, [AShape([0, 1])], use)], block_m=16)
    assert plan.launches["a_shape"].active.tolist() == [[True, False]]


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_specs_of_one_family_with_different_index_widths(device, dtype, n, block_m):
    """Index lists of different widths (verticals, slashes, key blocks) are padded, not a
    torch.cat size error; a malformed one is an error that names it."""
    hq, hkv, d = 4, 2, 64
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=19)
    v0, s0 = _vs(1, 1, n, 3, 2, device)
    v1, s1 = _vs(1, 1, n, 11, 7, device, seed=4)
    r = row_table(n, block_m).shape[0]
    specs = [VerticalSlash([0], v0, s0, window=2), VerticalSlash([1], v1, s1, window=5),
             Block([2], _blocks(1, 1, r, n, 16, 1, device), window=1),
             Block([3], _blocks(1, 1, r, n, 16, 4, device, seed=5), window=0)]
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    check(q, k, v, plan, oracle)
    with pytest.raises(ValueError, match=r"vertical_slash heads \[0\]: verticals must be"):
        SparsePlan.build(n, 2, [VerticalSlash([0], v0[0], s0), specs[1]], block_m=block_m,
                         block_n=16, device=device)


def test_dense_plans_read_exactly_one():
    """A plan computing every pair visits exactly a dense pass's tiles: physical 1.0 with
    or without row groups (it read 1.186 at 183 tokens when tiles were counted over the pair
    triangle). A 2D-boundary head sweeps its near range once per key group: 2.0, reported."""
    n, spans = 183, [(0, 12, 0), (12, 172, 1), (172, 183, 0)]
    for rg in (None, spans):
        d = SparsePlan.build(n, 2, [dense([0, 1], n)], block_m=16, block_n=16,
                             row_groups=rg).density()
        assert d["logical"] == 1.0 and d["physical"] == 1.0
    d = SparsePlan.build(n, 2, [dense([0], n, kgroup=0), dense([0], n, kgroup=1),
                                dense([1], n)], block_m=16, block_n=16,
                         row_groups=spans).density()
    assert d["logical"] == 1.0 and d["physical_per_head"].tolist() == [2.0, 1.0]


def _naive_mask(fam, n, bm, bn, spans, prm):
    """The pattern definitions of plan.py's docstring, pair by pair in plain Python."""
    starts = [s for s, _, _ in spans]
    out = torch.zeros(n, n, dtype=torch.bool)
    blocks = [(a, min(a + bm, e), g) for s, e, g in spans for a in range(s, e, bm)]
    for r, (a, e, g) in enumerate(blocks):
        for i in range(a, e):
            if prm.get("qgroup", -1) >= 0 and g != prm["qgroup"]:
                continue
            for j in range(i + 1):
                kgrp = [gg for s, ee, gg in spans if s <= j < ee][0]
                if prm.get("kgroup", -1) >= 0 and kgrp != prm["kgroup"]:
                    continue
                ok = j >= max(a - prm["window"], 0)
                if fam in ("a_shape", "grid"):
                    ok |= j < prm["sink"]
                if fam == "grid":
                    def on(x):
                        return prm["start"] <= x < prm["end"] and \
                            (x - prm["start"]) % prm["stride"] == prm["phase"]
                    ok |= prm["lines"] in ("cols", "both") and on(j)
                    ok |= prm["lines"] in ("rows", "both") and on(i)
                if fam == "vertical_slash":
                    ok |= j in prm["verticals"]
                    ok |= any(a - o <= j < e - o for o in prm["slashes"])
                if fam == "block":
                    ok |= j // bn in prm["key_blocks"][r]
                out[i, j] = ok
    assert starts == sorted(starts)
    return out


def test_oracle_equals_the_definitions_pair_by_pair():
    n, bm, bn = 45, 8, 4
    spans = [(0, 7, 0), (7, 31, 1), (31, n, 0)]
    cases = [
        ("a_shape", AShape([0], sink=3, window=5, qgroup=1), dict(sink=3, window=5, qgroup=1)),
        ("grid", Grid([0], 9, 40, 5, 2, lines="both", sink=2, window=3),
         dict(start=9, end=40, stride=5, phase=2, lines="both", sink=2, window=3)),
        ("grid", Grid([0], 7, 31, 4, 3, lines="rows", sink=0, window=0, qgroup=1, kgroup=0),
         dict(start=7, end=31, stride=4, phase=3, lines="rows", sink=0, window=0, qgroup=1,
              kgroup=0)),
        ("vertical_slash", VerticalSlash([0], torch.tensor([[[3, 17, -1, 40]]]),
                                         torch.tensor([[[0, 11, 25, -1]]]), window=2, kgroup=1),
         dict(verticals={3, 17, 40}, slashes=[0, 11, 25], window=2, kgroup=1)),
    ]
    R = len([a for s, e, _ in spans for a in range(s, e, bm)])
    kb = torch.randint(0, (n + bn - 1) // bn, (1, 1, R, 3), generator=torch.Generator().manual_seed(0))
    kb[0, 0, 1, 2] = -1
    cases.append(("block", Block([0], kb, window=1),
                  dict(key_blocks=[set(x for x in row if x >= 0) for row in kb[0, 0].tolist()],
                       window=1)))
    for fam, spec, prm in cases:
        got = spec_masks([spec], n, 1, block_m=bm, block_n=bn, row_groups=spans)[0, 0]
        assert torch.equal(got, _naive_mask(fam, n, bm, bn, spans, prm)), (fam, prm)


def test_plan_validation_messages():
    n = 64
    with pytest.raises(ValueError, match="head 1.*covered by 0"):
        SparsePlan.build(n, 2, [AShape([0])], block_m=16)
    with pytest.raises(ValueError, match="head 0.*covered by 2"):
        SparsePlan.build(n, 2, [AShape([0, 1]), dense([0], n)], block_m=16)
    with pytest.raises(ValueError, match="phase"):
        SparsePlan.build(n, 1, [Grid([0], 0, n, stride=4, phase=4)], block_m=16)
    with pytest.raises(ValueError, match="row groups"):
        SparsePlan.build(n, 1, [AShape([0])], block_m=16, row_groups=[(0, 10, 0), (12, n, 1)])
    spans = [(0, 20, 0), (20, 50, 1), (50, n, 0)]
    with pytest.raises(ValueError, match="not inside one span"):
        SparsePlan.build(n, 1, [Grid([0], 0, n, 4, 1, qgroup=1), dense([0], n, qgroup=0)],
                         block_m=16, row_groups=spans)
    plan = SparsePlan.build(n, 1, [AShape([0])], block_m=16)
    q = torch.randn(1, 1, n + 1, 64)
    with pytest.raises(ValueError, match="plan is for"):
        sparse_attention(q, q, q, plan)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("kind", ["mixed-batch1", "mixed-batch2", "repeated-heads"])
def test_mask_by_row_chunks_equals_the_oracle(block_m, kind):
    """spec_mask_rows (each row block evaluated once, then cut causally row by row, grid row
    lines added per row: the CPU engine's mask at long N) is the oracle's mask exactly, for
    every family, row groups, grid row lines, a Fallback and heads listed by several slots,
    at chunk sizes that split row blocks and spans."""
    n = 157
    if kind == "repeated-heads":
        batch, hq = 1, 8
        spans, specs = _repeated_head_specs(n, hq, block_m, "cpu")
    else:
        batch, hq = int(kind[-1]), 4
        spans, specs = _mixed_specs(n, block_m, "cpu", batch)
    oracle = spec_masks(specs, n, hq, block_m=block_m, block_n=16, row_groups=spans,
                        batch=batch)
    assert oracle.any() and not oracle.all()
    for rows in (1, 7, 16, 50, n):
        chunks = list(spec_mask_rows(specs, n, hq, block_m=block_m, block_n=16,
                                     row_groups=spans, batch=batch, rows=rows))
        assert [r0 for r0, _ in chunks] == list(range(0, n, rows))
        assert torch.equal(torch.cat([m for _, m in chunks], 2), oracle), rows


# ---------------------------------------------------------------------- repeated heads
def _three_groups(n):
    """text - video - image - video - text: three row (and key) groups."""
    c = [0, 11, 11 + (n - 30) // 3, 11 + 2 * (n - 30) // 3, n - 19 - 7, n]
    c[4] = max(c[4], c[3] + 1)
    groups = [0, 1, 2, 1, 0]
    return [(c[i], c[i + 1], groups[i]) for i in range(5)]


def _repeated_head_specs(n, hq, block_m, device, block_n=16):
    """One head listed many times across and inside specs, each slot with its own query
    group, key group and parameters (a 2D-boundary head: one slot per (query group, key
    group)), beside Q-boundary, K-split and plain heads in the same specs. The first spec's
    head-1 slots are issue 31's example, which plan.masks() got wrong."""
    spans = _three_groups(n)
    s1, e1 = spans[1][0], spans[1][1]
    r = row_table(n, block_m, spans).shape[0]
    vert, sl = _vs(1, 3, n, 7, 5, device, seed=23)
    others = list(range(5, hq))
    block_heads = [1, 3] + others
    return spans, [
        # head 1: (q0,k0) (q1,k2) (q2,k1) (q2,k2); head 3: key groups 0 and 2; head 0 plain
        AShape(heads=[1, 1, 1, 1, 3, 0, 3], sink=[3, 0, 0, 5, 2, 4, 0],
               window=[65, 0, n, 11, block_m, 9, 3], qgroup=[0, 1, 2, 2, -1, -1, -1],
               kgroup=[0, 2, 1, 2, 0, -1, 2]),
        # head 1: (q1,k1) with row and column lines, (q1,k0) columns; head 2: video rows
        Grid(heads=[1, 1, 2], start=s1, end=e1, stride=[5, 3, 4], phase=[1, 0, 2],
             lines=["both", "cols", "both"], sink=[2, 0, 1], window=[4, 9, 6],
             qgroup=[1, 1, 1], kgroup=[1, 0, -1]),
        dense([2, 2], n, qgroup=[0, 2]),
        # head 1: (q0,k1) (q0,k2); head 4 plain
        VerticalSlash(heads=[1, 1, 4], verticals=vert, slashes=sl, window=[2, 5, 3],
                      qgroup=[0, 0, -1], kgroup=[1, 2, -1]),
        # head 1: (q2,k0); head 3: key group 1; the rest plain
        Block(heads=block_heads,
              key_blocks=_blocks(1, len(block_heads), r, n, block_n, 3, device, seed=29),
              window=[1, 2] + [3] * len(others), qgroup=[2, -1] + [-1] * len(others),
              kgroup=[0, 1] + [-1] * len(others)),
    ]


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
@pytest.mark.parametrize("ratio,d", [(1, 64), (7, 80), (8, 128)])
def test_repeated_heads_with_different_groups(device, dtype, n, block_m, ratio, d):
    """Slots of one head OR together: kernel output, the runtime's masks by rows, the plan's
    density and the oracle agree on a plan that lists heads many times (GQA 1 / 7 / 8, head
    dims 64 / 80 / 128, odd N, random inputs, poisoned output)."""
    hq = 8 if ratio in (1, 8) else 7
    hkv = hq // ratio
    spans, specs = _repeated_head_specs(n, hq, block_m, device)
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans,
                         device=device)
    assert plan.heads_2d == [1, 3]
    assert oracle[0, 1, 0, 0], "head 1, row 0, key 0: the (text, text) slot's sink"
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=31 + ratio)
    check(q, k, v, plan, oracle)
    assert torch.equal(plan.masks(), oracle)
    _density_is_the_oracles_and_the_replays(plan, oracle)
    # Head 1 as nine one-slot specs of its own gives the same mask (the union of its slots).
    one = []
    for sp in specs:
        for s, h in enumerate(sp.heads):
            if h == 1:
                one.append(_slot_of(sp, s))
    alone = spec_masks(one, n, hq, block_m=block_m, block_n=16, row_groups=spans)
    assert torch.equal(alone[0, 1], oracle[0, 1]) and not alone[0, 0].any()


def _slot_of(sp, s):
    """Slot s of a spec as a spec of its own (per-slot values picked)."""
    def pick(x):
        if isinstance(x, torch.Tensor):
            return x[:, s:s + 1]
        return x if isinstance(x, (int, str)) else [list(x)[s]]
    fields = {f: pick(getattr(sp, f)) for f in sp.__dataclass_fields__ if f != "heads"}
    return type(sp)(heads=[sp.heads[s]], **fields)


def test_the_oracle_ors_repeated_slots_pair_by_pair():
    """The oracle's union over a head's slots, against the definitions pair by pair."""
    n, bm, bn = 45, 8, 4
    spans = [(0, 7, 0), (7, 31, 1), (31, n, 0)]
    spec = AShape(heads=[0, 0, 0, 0], sink=[3, 0, 0, 5], window=[9, 0, n, 2],
                  qgroup=[0, 1, 0, 1], kgroup=[0, 1, 1, 0])
    want = torch.zeros(n, n, dtype=torch.bool)
    for s in range(4):
        want |= _naive_mask("a_shape", n, bm, bn, spans,
                            dict(sink=spec.sink[s], window=spec.window[s],
                                 qgroup=spec.qgroup[s], kgroup=spec.kgroup[s]))
    got = spec_masks([spec], n, 1, block_m=bm, block_n=bn, row_groups=spans)[0, 0]
    assert torch.equal(got, want)
    assert torch.equal(torch.cat([m for _, m in spec_mask_rows(
        [spec], n, 1, block_m=bm, block_n=bn, row_groups=spans, rows=5)], 2)[0, 0], want)


@pytest.mark.skipif(not interpreted(), reason="CPU tensors: needs TRITON_INTERPRET=1")
def test_block_family_reads_through_descriptors_or_plain_loads():
    """The block family's full tiles go through tensor descriptors (TMA on sm_90), which need
    a 16-byte aligned base and row strides; otherwise the launch reads them with plain loads,
    and both compute the oracle's result."""
    from mminfer.kernels import launch as L
    k = torch.randn(1, 2, 40, 64)
    kd, _ = L._descriptors(k, k, {"BLOCK_N": 16}, 64)
    assert kd is not None and list(kd.block_shape) == [1, 1, 16, 64]
    odd = torch.randn(1, 2, 40, 65)[..., 1:]          # base 4 bytes off, row stride 260 B
    assert L._descriptors(odd, odd, {"BLOCK_N": 16}, 64) == (None, None)
    n = 67
    r = row_table(n, 16).shape[0]
    spec = Block([0, 1], _blocks(1, 2, r, n, 16, 3, "cpu", seed=37), window=[0, 20])
    plan, oracle = build(n, 2, [spec], block_m=16, block_n=16)
    for t in (torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 65)[..., 1:]):
        check(t, t, t, plan, oracle)


def test_sparsity_of_a_prefill_sums_its_layers_plans():
    """density.sparsity: what an answer reports of its sparse layers, from their plans (or
    already counted densities), layers in order; tile work only where a plan counted it."""
    from mminfer.kernels import sparsity
    n = 183
    a_shape = SparsePlan.build(n, 2, [AShape([0, 1], sink=4, window=16)], block_m=16,
                               block_n=16)
    full = SparsePlan.build(n, 2, [dense([0, 1], n)], block_m=16, block_n=16)
    d = a_shape.density()
    got = sparsity({3: a_shape, 1: full, 5: 0.5, 7: {"logical": 0.2, "physical": 0.4}})
    assert got["layers"] == [1, 3, 5, 7]
    assert got["per_layer"] == [1.0, round(d["logical"], 6), 0.5, 0.2]
    assert got["mean_density"] == pytest.approx((1.0 + d["logical"] + 0.5 + 0.2) / 4)
    assert got["per_layer_tile_work"] == [1.0, round(d["physical"], 6), 0.4]
    assert got["mean_tile_work"] == pytest.approx((1.0 + d["physical"] + 0.4) / 3)
    assert 0 < d["logical"] < d["physical"] < 1
    assert sparsity({}) is None
    assert "mean_tile_work" not in sparsity({0: 0.25})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("grouped", [False, True])
def test_product_tiles_on_gpu(block_n, grouped):
    """The plans the product builds on a GPU (128-row blocks, 64-key blocks; the kernel
    benchmark's 128-key blocks) at the H200 launch configuration: 128-key tiles, the block
    family's full tiles through TMA (plans without key groups), bf16, Qwen2.5-VL's GQA ratio
    7 and head dim 128; with key groups, heads listed by several slots."""
    n, hq, hkv, d, bm = 2053, 14, 2, 128, 128
    if grouped:
        spans, specs = _repeated_head_specs(n, hq, bm, "cuda", block_n=block_n)
    else:
        spans = None
        r = row_table(n, bm).shape[0]
        vert, sl = _vs(1, 4, n, 300, 12, "cuda", seed=43)
        specs = [AShape([0, 1, 2], sink=[64, 0, 5], window=[1024, 128, 300]),
                 Grid([3, 4, 5, 6], start=40, end=n - 9, stride=[257, 64, 9, 5],
                      phase=[7, 0, 3, 1], lines=["both", "cols", "rows", "both"],
                      sink=[64, 0, 3, 8], window=[256, 128, 0, 77]),
                 VerticalSlash([7, 8, 9, 10], vert, sl, window=[64, 0, 128, 200]),
                 Block([11, 12, 13], _blocks(1, 3, r, n, block_n, 4, "cuda", seed=47),
                       window=[0, 128, 64])]
    plan, oracle = build(n, hq, specs, block_m=bm, block_n=block_n, row_groups=spans,
                         device="cuda")
    assert (plan.key_groups is not None) == grouped
    q, k, v = _inputs(1, hq, hkv, n, d, torch.bfloat16, "cuda", seed=41)
    check(q, k, v, plan, oracle)
    _density_is_the_oracles_and_the_replays(plan, oracle)
