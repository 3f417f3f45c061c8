"""Launchers: one kernel launch per pattern family, for all heads of a layer at once."""

from __future__ import annotations

import os

import torch
import triton

from . import density as _density
from . import variants as _variants
from .layout import BLOCK, F_HEAD, VERTICAL_SLASH
from .plan import SparsePlan
from .runtime import (CPU_CONFIG, GPU_CONFIG, as_device, batch_stride,  # noqa: F401
                      compiled_gpu, tile_config)
from .sparse_attn_kernel import _sparse_attn_fwd


def _config(q, plan, config, family=None):
    """Tile config of a launch. The current kernel's tiles never exceed the plan's key block
    (density counts them so); a variant that asks for wider tiles gets them up to the row
    block, except for the block family, whose tiles must divide its key block."""
    cfg = tile_config(q.is_cuda, plan.block_m, plan.block_n, config)
    if config and "BLOCK_N" in config and family is not None and family != BLOCK:
        cfg["BLOCK_N"] = min(config["BLOCK_N"], plan.block_m)
    for key, default in _variants.SWITCHES.items():
        cfg.setdefault(key, default)
    cfg.setdefault("TAIL_STAGES", cfg["num_stages"])
    if family != VERTICAL_SLASH:
        cfg["SLASH_FLAT"] = cfg["VGATHER"] = False
    if family not in (VERTICAL_SLASH, BLOCK):
        cfg["EVEN_FAR"] = False
    return cfg


def _descriptors(k, v, cfg, D):
    """Tensor descriptors over K and V ``[B, Hkv, N, D]`` for full key tiles, or ``(None,
    None)`` where the copy engine cannot address them (a base or a row stride off 16 bytes):
    the launch then reads those tiles with plain loads."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    block = [1, 1, cfg["BLOCK_N"], max(16, triton.next_power_of_2(D))]
    descs = []
    for t in (k, v):
        es = t.element_size()
        if t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]):
            return None, None
        descs.append(TensorDescriptor(t, shape=list(t.shape), strides=list(t.stride()),
                                      block_shape=block))
    return tuple(descs)


def _gathered_verticals(k, v, fl, kv_group):
    """K and V rows of every slot's verticals, in its sorted order ``[B, S, nv_max, D]``:
    gathered once per launch, read by every row block of the slot as contiguous tiles."""
    B, _, N, _ = k.shape
    idx = fl.vidx.to(torch.long).clamp(max=N - 1)                      # [B, S, nv]
    kvh = (fl.params[:, :, F_HEAD].to(torch.long) // kv_group)[:, :, None]
    bi = torch.arange(B, device=k.device)[:, None, None]
    return k[bi, kvh, idx].contiguous(), v[bi, kvh, idx].contiguous()


def _check_inputs(q, k, v, plan):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, N, D]")
    B, Hq, N, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != N or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if Hq % k.shape[1]:
        raise ValueError(f"query heads {Hq} not a multiple of kv heads {k.shape[1]}")
    if (B, Hq, N) != (plan.batch, plan.num_heads, plan.n):
        raise ValueError(f"plan is for B={plan.batch}, H={plan.num_heads}, N={plan.n}; "
                         f"got {B}, {Hq}, {N}")
    if D not in (16, 32, 64, 80, 96, 128, 256):
        raise ValueError(f"head dim {D} not supported")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {q.dtype} not supported")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the last dim of q, k, v must be contiguous")


def _launch(q, k, v, out, lse, scratch, lse_s, tiles, plan: SparsePlan, name, fl, scale,
            write_lse, count, config):
    B, Hq, N, D = q.shape
    cfg = _config(q, plan, config, fl.family)
    dev = q.device
    dummy_i32 = torch.zeros(1, dtype=torch.int32, device=dev)
    dummy_i8 = torch.zeros(1, dtype=torch.int8, device=dev)
    R = plan.n_row_blocks
    n_programs = R + fl.n_rowline_programs
    S = fl.n_slots
    kg = plan.key_groups if plan.key_groups is not None else dummy_i32
    os_ = scratch if scratch is not None else out.unsqueeze(0)
    ls_ = lse_s if lse_s is not None else lse.unsqueeze(0)
    grid = (n_programs * B * S,) if cfg["SCHEDULE"] == 1 else (n_programs, B * S)
    kdesc = vdesc = None
    if cfg["TMA"] and not count:
        kdesc, vdesc = _descriptors(k, v, cfg, D)
    cfg["TMA"] = kdesc is not None
    if kdesc is None:
        kdesc = vdesc = q
    kvert = vvert = q
    if cfg["VGATHER"] and not count:
        kvert, vvert = _gathered_verticals(k, v, fl, Hq // k.shape[1])
    elif cfg["VGATHER"]:
        cfg["VGATHER"] = False
    _sparse_attn_fwd[grid](
        q, k, v, out, os_, lse, ls_, tiles if tiles is not None else dummy_i32,
        batch_stride(q), q.stride(1), q.stride(2), batch_stride(k), k.stride(1), k.stride(2),
        batch_stride(v), v.stride(1), v.stride(2), batch_stride(out), out.stride(1),
        out.stride(2), os_.stride(0) if scratch is not None else 0, batch_stride(os_, 1),
        os_.stride(2), os_.stride(3),
        lse.stride(0), lse.stride(1), ls_.stride(0), ls_.stride(1), ls_.stride(2),
        plan.table, R, n_programs, fl.params, S,
        fl.vidx if fl.vidx is not None else dummy_i32,
        fl.vcnt if fl.vcnt is not None else dummy_i32,
        fl.vflag if fl.vflag is not None else dummy_i8,
        fl.sidx if fl.sidx is not None else dummy_i32,
        fl.srange if fl.srange is not None else dummy_i32,
        fl.bidx if fl.bidx is not None else dummy_i32,
        fl.bcnt if fl.bcnt is not None else dummy_i32,
        kg, kvert, vvert, kdesc, vdesc,
        fl.vidx.shape[-1] if fl.vidx is not None else 0,
        fl.sidx.shape[-1] if fl.sidx is not None else 0,
        fl.bidx.shape[-1] if fl.bidx is not None else 0,
        N, Hq // k.shape[1], scale * 1.4426950408889634,
        HEAD_D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=plan.block_m,
        BLOCK_N=cfg["BLOCK_N"], FAMILY=fl.family, KEY_GROUPED=plan.key_groups is not None,
        WRITE_LSE=write_lse, COUNT=count, IEEE=q.dtype == torch.float32,
        BLOCK_K=plan.block_n, FAST=cfg["FAST"], DMASK=D != max(16, triton.next_power_of_2(D)),
        SCHEDULE=cfg["SCHEDULE"], EVEN_FAR=cfg["EVEN_FAR"], SLASH_FLAT=cfg["SLASH_FLAT"],
        VGATHER=cfg["VGATHER"], TAIL_STAGES=cfg["TAIL_STAGES"], TMA=cfg["TMA"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def sparse_attention(q, k, v, plan: SparsePlan, *, scale: float | None = None,
                     return_lse: bool = False, out: torch.Tensor | None = None, config=None,
                     variant: str | None = None):
    """Exact causal attention over the plan's pair set.

    q ``[B, Hq, N, D]``; k, v ``[B, Hkv, N, D]`` (GQA by head index, never repeated).
    ``out`` may be any ``[B, Hq, N, D]`` view (e.g. a transposed ``[B, N, Hq, D]`` buffer).
    Returns ``out`` (and the natural-log LSE ``[B, Hq, N]`` fp32 when ``return_lse``).
    ``variant``: a name of ``variants.VARIANTS`` (launch options under measurement);
    ``config`` entries override it. A launch that asks for neither runs
    ``MMINFER_KERNEL_VARIANT`` if set, else ``"fastest"``: each family's fastest variant
    (``variants.FAMILY_FASTEST``; on a compiled GPU only, the interpreter keeps its CPU
    tiles). ``variant="current"`` (or ``MMINFER_KERNEL_VARIANT=current``) is the kernel
    without options, the baseline ``benchmarks/run_variants_ab_h200.sh`` measures against.
    """
    _check_inputs(q, k, v, plan)
    if variant is None and config is None:
        variant = os.environ.get("MMINFER_KERNEL_VARIANT") or "fastest"
    fastest = variant == "fastest"
    if variant is not None and not fastest:
        config = {**_variants.options(variant), **(config or {})}
    B, Hq, N, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    need_lse = return_lse or bool(plan.heads_2d)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device) if need_lse else \
        torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    scratch = lse_s = None
    if plan.heads_2d:
        G, H2 = plan.n_key_groups, len(plan.heads_2d)
        scratch = torch.empty(G, B, H2, N, D, dtype=q.dtype, device=q.device)
        lse_s = torch.empty(G, B, H2, N, dtype=torch.float32, device=q.device)
    for name, fl in plan.launches.items():
        cfg = config
        if fastest and compiled_gpu(q.is_cuda):
            cfg = {**_variants.options(_variants.FAMILY_FASTEST.get(name)), **(config or {})}
        _launch(q, k, v, out, lse, scratch, lse_s, None, plan, name, fl, scale, need_lse,
                False, cfg)
    if plan.heads_2d:
        _merge_partials(out, lse, scratch, lse_s, plan.heads_2d)
    return (out, lse) if return_lse else out


def _merge_partials(out, lse, scratch, lse_s, heads_2d):
    """Combine the per-key-group partials of 2D-boundary heads through their LSE."""
    m = lse_s.max(dim=0).values                          # [B, H2, N]
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_s - m_safe[None])                  # [G, B, H2, N]
    denom = w.sum(0)
    o = (w[..., None] * scratch.float()).sum(0) / denom.clamp(min=1e-30)[..., None]
    idx = as_device(heads_2d, out.device, torch.long)
    out.index_copy_(1, idx, o.to(out.dtype))
    lse.index_copy_(1, idx, m_safe + torch.log(denom))


def count_plan(plan: SparsePlan) -> dict:
    """Run the kernels in count mode: the same report as ``plan.density()`` (which counts
    from the plan's arrays without a launch), measured by the kernel's own traversal."""
    dev = plan.table.device
    B, H, N = plan.batch, plan.num_heads, plan.n
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    q = torch.empty(B, H, N, 16, dtype=dtype, device=dev)
    kv = torch.empty(B, 1, N, 16, dtype=dtype, device=dev)
    counts = torch.zeros(B, H, N, dtype=torch.float32, device=dev)
    G = max(plan.n_key_groups, 1)
    counts_s = torch.zeros(G, B, max(len(plan.heads_2d), 1), N, dtype=torch.float32,
                           device=dev)
    pairs = torch.zeros(H, dtype=torch.float64, device=dev)
    tiles = torch.zeros(H, dtype=torch.int64, device=dev)
    tiles_by_family = {}
    for name, fl in plan.launches.items():
        n_prog = plan.n_row_blocks + fl.n_rowline_programs
        slot_tiles = torch.zeros(B * fl.n_slots, n_prog, dtype=torch.int32, device=dev)
        counts.zero_()
        counts_s.zero_()
        _launch(q, kv, kv, q, counts, None, counts_s if plan.heads_2d else None, slot_tiles,
                plan, name, fl, 1.0, True, True, None)
        pairs += counts.double().sum((0, 2))
        if plan.heads_2d:
            pairs.index_add_(0, torch.tensor(plan.heads_2d, device=dev),
                             counts_s.double().sum((0, 1, 3)))
        per_slot = slot_tiles.to(torch.int64).sum(1)
        tiles_by_family[name] = int(per_slot.sum())
        tiles.index_add_(0, fl.params[:, :, F_HEAD].reshape(-1).long(), per_slot)
    bn = _config(q, plan, None)["BLOCK_N"]
    return _density.summarise(plan, {
        "pairs_per_head": pairs.round().to(torch.int64), "tiles_per_head": tiles,
        "tiles": tiles_by_family, "block_n_tile": bn,
        "dense_tiles": _density.dense_tiles(plan.table, bn)})


def dense_flops(n: int, heads: int, d: int, batch: int = 1) -> float:
    """FLOPs of causal attention forward (two matmuls over the triangle)."""
    return 4.0 * batch * heads * d * n * (n + 1) / 2


def effective_tflops(density: float, n: int, heads: int, d: int, ms: float) -> float:
    return dense_flops(n, heads, d) * density / (ms * 1e-3) / 1e12


__all__ = ["sparse_attention", "count_plan", "dense_flops", "effective_tflops"]
