"""Kernel exactness: every pattern family and both groupings against fp32 masked attention
built from the plan's exported masks (independent torch code).

CPU runs use the Triton interpreter (fp32/fp16, small N); the same cases run in bf16/fp16
at larger N on a GPU (``-m gpu``; skipped without CUDA).
"""

import pytest
import torch

from mminfer.kernels import (AShape, Block, Grid, SparsePlan, VerticalSlash, dense, masked_attention,
                             row_table, sparse_attention)

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


def check(q, k, v, plan, scale=None):
    """Kernel error <= 2x PyTorch's own error in the same dtype (+ representability atol)."""
    mask_cpu = plan.masks()
    mask = mask_cpu.to(q.device)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    out, lse = sparse_attention(q, k, v, plan, out=out, return_lse=True, scale=scale)
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
    plan = SparsePlan.build(n, hq, [spec], block_m=block_m, block_n=32, device=device)
    mask, _ = check(q, k, v, plan)
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
    plan = SparsePlan.build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    check(q, k, v, plan)


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
    plan = SparsePlan.build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans,
                            device=device)
    # Row blocks never straddle modality spans.
    for a, b_, g in plan.table.cpu().tolist():
        assert any(s <= a and b_ <= e and gg == g for s, e, gg in spans)
    mask, _ = check(q, k, v, plan)
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
    plan = SparsePlan.build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans,
                            device=device)
    assert plan.heads_2d == [0, 2]
    mask, _ = check(q, k, v, plan)
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
    plan = SparsePlan.build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    mask, out = check(q, k, v, plan)
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
    plan = SparsePlan.build(n, hq, [spec], block_m=block_m, block_n=16, batch=2, device=device)
    mask, _ = check(q, k, v, plan)
    assert not torch.equal(mask[0], mask[1])


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_density_counts_match_masks(device, dtype, n, block_m):
    hq = 4
    vert, sl = _vs(1, 2, n, 5, 4, device)
    specs = [AShape([0], sink=4, window=8), VerticalSlash([1, 2], vert, sl, window=3),
             Grid([3], start=2, end=n, stride=6, phase=5, lines="both", sink=1, window=2)]
    plan = SparsePlan.build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    dens = plan.density()
    tri = hq * n * (n + 1) / 2
    assert dens["logical"] == pytest.approx(plan.masks().sum().item() / tri, abs=1e-9)
    assert dens["physical"] >= dens["logical"]


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
