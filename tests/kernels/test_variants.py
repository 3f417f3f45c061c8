"""Every launch variant (``kernels/variants.py``) computes exactly what the current kernel
computes: the same exactness checks as ``test_kernels.py`` (fp32/fp16 under the interpreter
against the spec-built oracle; bf16/fp16 on a GPU with ``-m gpu``), strictness unchanged."""

import os

import pytest
import torch

from mminfer.kernels import (AShape, Block, Grid, VerticalSlash, dense, row_table,
                             sparse_attention)
from mminfer.kernels import launch as L
from mminfer.kernels.variants import VARIANTS, affects, options

from test_kernels import (CPU_CASES, GPU_CASES, HAS_CUDA, _blocks, _inputs, _mixed_specs, _vs,
                          build, check)

NAMES = [v for v in VARIANTS if v != "current"]
# On a GPU each (variant, family, shape) is a compile of its own: there the variants that
# hold every switch together run, in bf16 (each switch alone runs under the interpreter, and
# benchmarks/kernels.py --variants compares every variant's output with the current one).
GPU_NAMES = ["combined", "combined_bn128_s3", "combined_tma_bn128"]
# Under the interpreter the whole sweep (every variant x family x dtype) takes ~25 min on two
# cores, so `make test` runs the two variants that hold every switch between them, at 64- and
# 128-key tiles, one dtype each; MMINFER_ALL_VARIANTS=1 runs every variant in both dtypes.
ALL_CPU = os.environ.get("MMINFER_ALL_VARIANTS") == "1"
CPU_NAMES = {"combined": CPU_CASES[0], "combined_tma_bn128": CPU_CASES[1]}


def _cases(names):
    if HAS_CUDA:
        cpu = []
    elif ALL_CPU:
        cpu = [(v, *c) for v in names for c in CPU_CASES]
    else:
        cpu = [(v, *CPU_NAMES[v]) for v in names if v in CPU_NAMES]
    gpu = [pytest.param(v, *GPU_CASES[0].values, marks=GPU_CASES[0].marks,
                        id=f"{v}-cuda-bf16") for v in names if v in GPU_NAMES]
    return cpu + gpu


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


@pytest.mark.parametrize("variant,device,dtype,n,block_m", _cases(NAMES))
@pytest.mark.parametrize("family", FAMILIES)
def test_variant_pattern_exact(variant, device, dtype, n, block_m, family):
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
    cur = sparse_attention(q, k, v, plan).cpu().float()
    # fp32: summation order only; half types: one rounding of the output apart (2 ulps)
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * cur.abs().max()
    assert (out.float() - cur).abs().max() <= tol


@pytest.mark.parametrize("variant,device,dtype,n,block_m", _cases(NAMES))
def test_variant_mixed_plan_gqa_and_key_groups(variant, device, dtype, n, block_m):
    """Q- and 2D-boundary slots (key-grouped tiles keep their masks), a Fallback, batch 2,
    GQA 2, head dim 80 (masked head dim)."""
    hq, hkv, d, batch = 4, 2, 80, 2
    spans, specs = _mixed_specs(n, block_m, device, batch)
    q, k, v = _inputs(batch, hq, hkv, n, d, dtype, device, seed=13)
    plan, oracle = build(n, hq, specs, block_m=block_m, block_n=16, row_groups=spans,
                         batch=batch, device=device)
    _variant_check(q, k, v, plan, oracle, variant)


@pytest.mark.parametrize("variant,device,dtype,n,block_m",
                         _cases(["vgather", "tma", "combined", "combined_tma_bn128"]))
def test_variant_gqa_7(variant, device, dtype, n, block_m):
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


def test_descriptors_only_where_the_copy_engine_can_address():
    """TMA needs a 16-byte aligned base and row strides: otherwise the launch falls back to
    plain loads (and still computes the same result)."""
    k = torch.randn(1, 2, 40, 64)
    cfg = {"BLOCK_N": 16}
    kd, vd = L._descriptors(k, k, cfg, 64)
    assert kd is not None and list(kd.block_shape) == [1, 1, 16, 64]
    odd = torch.randn(1, 2, 40, 65)[..., 1:]          # base 4 bytes off, row stride 260 B
    assert L._descriptors(odd, odd, cfg, 64) == (None, None)
    n = 64
    q = torch.randn(1, 2, n, 65)[..., 1:]
    plan, oracle = build(n, 2, [AShape([0, 1], sink=3, window=16)], block_m=16, block_n=16)
    check(q, q, q, plan, oracle, variant="tma")


def test_the_default_is_each_familys_fastest_and_env_picks_the_variant(monkeypatch):
    """The dispatch only (no kernel runs): compiled, a launch that names nothing (or
    ``variant="fastest"``, or MMINFER_KERNEL_VARIANT=fastest) gives each family's launch
    variants.FAMILY_FASTEST's options; ``current`` (argument or environment) the kernel
    without options; explicit configs win over the environment; under the interpreter
    nothing is laid over the CPU tiles."""
    from mminfer.kernels.variants import FAMILY_FASTEST
    n, hq = 300, 4
    specs = [AShape([0], sink=2, window=16),
             Grid([1], start=4, end=n, stride=9, phase=2, lines="both", sink=2, window=8),
             VerticalSlash([2], *_vs(1, 1, n, 7, 3, "cpu"), window=4),
             Block([3], _blocks(1, 1, row_table(n, 16).shape[0], n, 32, 3, "cpu"), window=5)]
    plan, _ = build(n, hq, specs, block_m=16, block_n=32, device="cpu")
    q, k, v = _inputs(1, hq, 2, n, 64, torch.float32, "cpu")
    seen = {}
    monkeypatch.setattr(L, "_launch", lambda *a: seen.__setitem__(a[9], a[-1]))
    families = {"a_shape", "grid", "vertical_slash", "block"}
    for gpu in (True, False):
        monkeypatch.setattr(L, "compiled_gpu", lambda is_cuda, gpu=gpu: gpu)
        for how in ("unset", "arg", "env"):
            monkeypatch.delenv("MMINFER_KERNEL_VARIANT", raising=False)
            seen.clear()
            if how == "env":
                monkeypatch.setenv("MMINFER_KERNEL_VARIANT", "fastest")
            sparse_attention(q, k, v, plan, **({"variant": "fastest"} if how == "arg" else {}))
            assert set(seen) == families
            for name, cfg in seen.items():
                assert cfg == (options(FAMILY_FASTEST[name]) if gpu else None), (how, name)
        for how in ("arg", "env"):
            monkeypatch.delenv("MMINFER_KERNEL_VARIANT", raising=False)
            seen.clear()
            if how == "env":
                monkeypatch.setenv("MMINFER_KERNEL_VARIANT", "current")
            sparse_attention(q, k, v, plan, **({"variant": "current"} if how == "arg" else {}))
            assert set(seen) == families and all(c == {} for c in seen.values()), how
        seen.clear()
        sparse_attention(q, k, v, plan, config={"num_warps": 4})     # env set, config wins
        assert all(cfg == {"num_warps": 4} for cfg in seen.values())
        monkeypatch.setenv("MMINFER_KERNEL_VARIANT", "bn128")
        seen.clear()
        sparse_attention(q, k, v, plan)
        assert all(cfg == options("bn128") for cfg in seen.values())
