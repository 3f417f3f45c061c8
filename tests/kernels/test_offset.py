"""Queries at an offset into a longer key range (``q_start``: a live stream's appended piece, a
chunk of a prefill): the kernel's rows ``[q_start, N)`` against fp32 masked attention over the
oracle's mask of the same specs (``oracle.py``, written from the semantics, absolute
positions), every family, Q- and 2D-boundary slots, grid row lines whose phase starts before
the piece, a Fallback; and at a block-aligned offset the rows equal the one-shot kernel's.

CPU: the Triton interpreter at small N (fp32/fp16); GPU (``-m gpu``): bf16 at a larger N.
"""

import pytest
import torch

from mminfer.kernels import (AShape, Block, Fallback, Grid, SparsePlan, VerticalSlash, dense,
                             plan_attention, row_table, sparse_attention)

from oracle import replay_tiles, spec_masks
from test_kernels import CASES, _blocks, _inputs, _layout, _vs, check


def _specs(n, block_m, q_start, device, batch=1):
    """Every family over the text-video-text-video-text layout, positions absolute: grids
    whose lines begin before ``q_start``, 2D- and Q-boundary slots, a Fallback, key blocks
    per row block of the query rows."""
    spans = _layout(n)
    r = row_table(n, block_m, spans, q_start).shape[0]
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


def _offsets(n, block_m):
    """The first video row, one inside the first video span off the block grid, one on it,
    one in the last text span."""
    spans = _layout(n)
    v0 = spans[1][0]
    return [v0 + 1, v0 + block_m + 5, spans[2][0], n - 7]


def _plan_and_oracle(n, hq, specs, q_start, **kw):
    plan = SparsePlan.build(n, hq, specs, q_start=q_start, **kw)
    oracle = spec_masks(specs, n, hq, block_m=kw["block_m"], block_n=kw.get("block_n", 64),
                        row_groups=kw.get("row_groups"), batch=kw.get("batch", 1),
                        q_start=q_start)
    return plan, oracle


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
@pytest.mark.parametrize("which", range(4))
@pytest.mark.parametrize("batch", [1, 2])
def test_offset_rows_exact(device, dtype, n, block_m, which, batch):
    q_start = _offsets(n, block_m)[which]
    hq, hkv, d = 4, 2, 64
    spans, specs = _specs(n, block_m, q_start, device, batch)
    q, k, v = _inputs(batch, hq, hkv, n, d, dtype, device, seed=19 + which)
    plan, oracle = _plan_and_oracle(n, hq, specs, q_start, block_m=block_m, block_n=16,
                                    row_groups=spans, batch=batch, device=device)
    assert plan.n_q == n - q_start and oracle.shape[-2:] == (n - q_start, n)
    check(q[:, :, q_start:].contiguous(), k, v, plan, oracle)
    # the oracle is not blind to the offset: a row's mask at q_start is not row 0's
    assert oracle[..., 0, :].sum() > 0 and oracle[..., 0, q_start + 1:].sum() == 0
    # the CPU engine's masks (masks.py) and the density counts agree with the oracle
    assert torch.equal(plan.masks(), oracle)
    d_ = plan.density()
    tri = (n * (n + 1) - q_start * (q_start + 1)) / 2
    assert d_["pairs"] == float(oracle.sum())
    assert d_["logical"] == pytest.approx(float(oracle.sum()) / (batch * hq * tri))
    tiles, by_family, dense_tiles = replay_tiles(plan)
    assert d_["tiles"] == by_family
    assert torch.equal(d_["physical_per_head"], tiles.double() / (batch * dense_tiles))


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_offset_on_the_block_grid_gives_the_one_shot_rows(device, dtype, n, block_m):
    """From a row-block start the piece's blocks are the one-shot plan's: the kernel's rows are
    the one-shot kernel's rows (the same programs over the same keys)."""
    hq, hkv, d = 4, 2, 64
    q_start = 3 * block_m
    g = torch.Generator().manual_seed(3)
    vert = torch.randint(0, n, (1, 2, 7), generator=g).to(device)
    sl = torch.randint(0, n, (1, 2, 5), generator=g).to(device)
    specs = [AShape([0], sink=3, window=block_m + 5),
             Grid([1], start=7, end=n - 3, stride=5, phase=2, lines="both", sink=2, window=9),
             VerticalSlash([2, 3], vert, sl, window=[4, block_m])]
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=23)
    one = SparsePlan.build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    piece = SparsePlan.build(n, hq, specs, block_m=block_m, block_n=16, device=device,
                             q_start=q_start)
    whole = sparse_attention(q, k, v, one)
    part = sparse_attention(q[:, :, q_start:].contiguous(), k, v, piece)
    if device == "cpu":
        # Blocks are the one-shot's programs over the same keys: bit for bit. The grid's row
        # lines (head 1) are gathered into tiles of their own, and a line sits at another
        # place in its tile when the piece starts later; numpy's matmul under the
        # interpreter may round a row by its place (seen on one CPU, 1.3e-6; not on another).
        lines = [1]
        rest = [h for h in range(hq) if h not in lines]
        assert torch.equal(part[:, rest], whole[:, rest, q_start:])
        torch.testing.assert_close(part[:, lines], whole[:, lines, q_start:],
                                   atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=1e-5)
    else:   # compiled variants specialise on the offset's value: rounding may differ
        assert (part.float() - whole[:, :, q_start:].float()).abs().max() < 2e-2
    ref = plan_attention(q[:, :, q_start:], k, v, piece)
    assert (ref.float() - part.float()).abs().max() < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_dense_piece_is_causal_attention_from_the_offset(device, dtype, n, block_m):
    """A dense plan from an offset is the bottom-right causal attention of SDPA."""
    hq, hkv, d = 4, 1, 64
    q_start = n // 2 + 3
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=29)
    plan = SparsePlan.build(n, hq, [dense(list(range(hq)), n)], block_m=block_m,
                            block_n=16, device=device, q_start=q_start)
    out = sparse_attention(q[:, :, q_start:].contiguous(), k, v, plan).float()
    kv = torch.arange(n)[None, :]
    rows = torch.arange(q_start, n)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, q_start:].float(), k.float().repeat_interleave(hq, 1),
        v.float().repeat_interleave(hq, 1), attn_mask=(kv <= rows).to(device))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert (out - sdpa).abs().max() < tol


def test_plan_refuses_queries_that_do_not_fit():
    plan = SparsePlan.build(64, 2, [dense([0, 1], 64)], block_m=16, block_n=16, q_start=40)
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match="query rows"):
        sparse_attention(q, q[:, :1], q[:, :1], plan)
    with pytest.raises(ValueError, match="q_start"):
        row_table(64, 16, None, 64)


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
def test_row_lines_start_at_the_first_line_of_the_piece(device, dtype, n, block_m):
    """Row-line programs are counted for the piece's lines only, so they must begin at its
    first line (same absolute phase), not at the span's: every piece row on a line is
    written (the output is poisoned) and sees every earlier key."""
    hq, hkv, d = 2, 1, 64
    q_start = n // 2 + 1
    specs = [Grid([0, 1], start=3, end=n, stride=[2, 3], phase=[1, 2], lines="rows", sink=0,
                  window=0)]
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=31)
    plan, oracle = _plan_and_oracle(n, hq, specs, q_start, block_m=block_m, block_n=16,
                                    device=device)
    check(q[:, :, q_start:].contiguous(), k, v, plan, oracle)
    line = (torch.arange(q_start, n) - 3) % 2 == 1
    assert oracle[0, 0, line].sum(-1).tolist() == (torch.arange(q_start, n)[line] + 1).tolist()
