"""Every launch variant (``kernels/variants.py``) computes exactly what the current kernel
computes: the same exactness checks as ``test_kernels.py`` (fp32/fp16 under the interpreter
against the spec-built oracle; bf16/fp16 on a GPU with ``-m gpu``), strictness unchanged."""

import pytest
import torch

from mminfer.kernels import (AShape, Block, Grid, VerticalSlash, dense, row_table,
                             sparse_attention)
from mminfer.kernels import launch as L
from mminfer.kernels.variants import VARIANTS, affects, options

from test_kernels import CASES, _blocks, _inputs, _layout, _mixed_specs, _vs, build, check

NAMES = [v for v in VARIANTS if v != "current"]


def _variant_check(q, k, v, plan, oracle, variant):
    return check(q, k, v, plan, oracle, variant=variant)


def _family_spec(family, n, hq, block_m, device):
    heads = list(range(hq))
    if family == "a_shape":
        return AShape(heads, sink=[1, 5, 9, 0], window=[block_m, 3, 40, 2 * block_m + 7])
    if family.startswith("grid"):
        return Grid(heads, start=[5, 0, 11, 20], end=[n - 3, n, n - 20, n],
                    stride=[7, 13, 5, 31], phase=[3, 0, 4, 30], lines=family.split("_")[1],
                    sink=[4, 0, 2, 8], window=[16, 0, 33, 5])
    if family == "vertical_slash":
        # Enough verticals for full (unmasked) gathered tiles at the interpreter's tiles,
        # and dense slashes so that clipped (partly empty) slash tiles occur.
        vert, sl = _vs(1, hq, n, 41, 23, device)
        return VerticalSlash(heads, vert, sl, window=[0, 8, block_m, 3 * block_m])
    if family == "block":
        r = row_table(n, block_m).shape[0]
        return Block(heads, _blocks(1, hq, r, n, 32, 5, device), window=[0, 5, 16, 40])
    return dense(heads, n)


FAMILIES = ["a_shape", "grid_both", "grid_rows", "vertical_slash", "block", "dense"]


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
@pytest.mark.parametrize("variant", NAMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_variant_pattern_exact(device, dtype, n, block_m, variant, family):
    fam = {"grid_both": "grid", "grid_rows": "grid", "dense": "a_shape"}.get(family, family)
    if not affects(variant, fam):
        pytest.skip(f"{variant} does not change the {fam} kernel")
    hq, hkv, d = 4, 2, 64
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device)
    spec = _family_spec(family, n, hq, block_m, device)
    plan, oracle = build(n, hq, [spec], block_m=block_m, block_n=32, device=device)
    _, out = _variant_check(q, k, v, plan, oracle, variant)
    # The current kernel on the same plan: same pairs, so the same result up to the order
    # of the online softmax's tiles.
    cur = sparse_attention(q, k, v, plan).cpu()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert (out.float() - cur.float()).abs().max() <= tol


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
@pytest.mark.parametrize("variant", NAMES)
def test_variant_mixed_plan_gqa_and_key_groups(device, dtype, n, block_m, variant):
    """Q- and 2D-boundary slots (key-grouped tiles keep their masks), a Fallback, batch 2,
    GQA 2, head dim 80 (masked head dim)."""
    hq, hkv, d, batch = 4, 2, 80, 2
    spans, specs = _mixed_specs(n, block_m, device, batch)
    q, k, v = _inputs(batch, hq, hkv, n, d, dtype, device, seed=13)
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans,
                         batch=batch, device=device)
    _variant_check(q, k, v, plan, oracle, variant)


@pytest.mark.parametrize("device,dtype,n,block_m", CASES)
@pytest.mark.parametrize("variant", ["vgather", "combined", "combined_bn128"])
def test_variant_gqa_7(device, dtype, n, block_m, variant):
    hkv, ratio, d = 1, 7, 128
    hq = hkv * ratio
    q, k, v = _inputs(1, hq, hkv, n, d, dtype, device, seed=ratio + d)
    r = row_table(n, block_m).shape[0]
    vert, sl = _vs(1, 3, n, 37, 9, device, seed=ratio)
    specs = [AShape([0, 4], sink=3, window=block_m),
             Grid([1, 5], start=4, end=n, stride=9, phase=2, lines="both", sink=2, window=8),
             VerticalSlash([2, 6, 3], vert, sl, window=4)]
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, device=device)
    assert r == plan.n_row_blocks
    _variant_check(q, k, v, plan, oracle, variant)


def test_variant_names_and_switches():
    with pytest.raises(ValueError, match="unknown kernel variant"):
        options("nope")
    q = torch.zeros(1, 1, 64, 16)
    plan = build(64, 1, [AShape([0])], block_m=16, block_n=16)[0]
    # Switches of other families never reach a launch (one compiled kernel per family).
    cfg = L._config(q, plan, options("combined"), 0)
    assert (cfg["SLASH_FLAT"], cfg["VGATHER"], cfg["EVEN_FAR"], cfg["SCHEDULE"]) == \
        (False, False, False, 1)
    # Wider tiles than the plan's key block only where the family allows it.
    cfg = L._config(q, plan, {"BLOCK_N": 128}, 0)
    assert cfg["BLOCK_N"] == 16
    plan = build(64, 1, [AShape([0])], block_m=32, block_n=16)[0]
    assert L._config(q, plan, {"BLOCK_N": 128}, 0)["BLOCK_N"] == 32
    assert L._config(q, plan, {"BLOCK_N": 128}, 3)["BLOCK_N"] == 16
    assert L._config(q, plan, None, 0)["BLOCK_N"] == 16
