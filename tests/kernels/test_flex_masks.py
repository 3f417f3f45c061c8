"""benchmarks/kernels.py gives FlexAttention the runtime's mask functions (kernels/masks.py)
as mask_mods and a BlockMask built from our block lists: both must say exactly what the
oracle (tests/kernels/oracle.py) says, on the CPU (FlexAttention itself runs in the
benchmark, on the GPU)."""

import pytest
import torch

from mminfer.kernels import masked_attention
from conftest import load_script
from oracle import spec_masks


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/kernels.py", "bench_kernels")


def _blocks(bm, R):
    """[Rq, Rk] partial and full block booleans of a BlockMask (batch 0, head 0)."""
    def dense(num, idx):
        out = torch.zeros(R, R, dtype=torch.bool)
        for r in range(R):
            out[r, idx[0, 0, r, :num[0, 0, r]].long()] = True
        return out
    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks,
                                                         bm.full_kv_indices)


@pytest.mark.parametrize("kind,density", [("a_shape", 0.4), ("grid", 0.3), ("block", 0.3)])
def test_flex_block_mask_and_mask_mod_are_the_oracle(bench, kind, density):
    n, B = 1280, 128
    R = n // B
    if kind == "a_shape":
        specs, prm = bench.a_shape_spec(n, density)
        block_n = 64
    elif kind == "grid":
        specs, prm = bench.grid_spec(n, density, start=200)
        block_n = 64
    else:
        specs, prm = bench.block_spec(n, density, "cpu")
        block_n = 128
    bm, perm, tiles = bench.flex_mask(kind, prm, n, "cpu", specs[0])
    want = spec_masks(specs, n, bench.HQ, block_m=bench.BM, block_n=block_n)[0, 0]
    if perm is not None:          # FlexAttention sees rows and keys permuted
        want = want[perm[0]][:, perm[1]]
    # the mask_mod, evaluated everywhere, is the oracle
    idx = torch.arange(n)
    got = bm.mask_mod(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])
    assert torch.equal(got, want)
    # every block with a pair is visited; full blocks (mask_mod skipped) are all pairs
    partial, full = _blocks(bm, R)
    has = want.view(R, B, R, B).any(3).any(1)
    every = want.view(R, B, R, B).all(3).all(1)
    assert not (partial & full).any()
    assert bool((partial | full)[has].all())
    assert bool(every[full].all())
    assert tiles == int((partial | full).sum()) and tiles < R * (R + 1) // 2


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_eager_with_the_oracle_mask_mod(bench):
    """The mask_mod through FlexAttention's own vmap (eager, CPU) equals masked attention
    over the oracle."""
    from torch.nn.attention.flex_attention import flex_attention
    n, H, D = 512, 2, 32
    specs, prm = bench.grid_spec(n, 0.4, start=100)
    bm, perm, _ = bench.flex_mask("grid", prm, n, "cpu", specs[0])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=g) for _ in range(3))
    qp, kp, vp = q[:, :, perm[0]], k[:, :, perm[1]], v[:, :, perm[1]]
    out = flex_attention(qp, kp, vp, block_mask=bm)
    want = spec_masks(specs, n, bench.HQ, block_m=bench.BM)[:, :H]
    ref, _ = masked_attention(qp, kp, vp, want[:, :, perm[0]][:, :, :, perm[1]])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
