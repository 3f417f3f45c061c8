"""Launchers: one kernel launch per pattern family, for all heads of a layer at once."""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .layout import BLOCK, F_HEAD, FAMILIES
from .plan import SparsePlan
from .runtime import as_device, batch_stride, dot_precision, tile_config
from .sparse_attn_kernel import _sparse_attn_fwd

_FAMILY_NAME = {v: k for k, v in FAMILIES.items()}


def _descriptors(k, v, cfg, D):
    """Tensor descriptors over K and V ``[B, Hkv, N, D]`` for full key tiles, or ``(None,
    None)`` where the copy engine cannot address them (a base or a row stride off 16 bytes):
    the launch then reads those tiles with plain loads."""
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
    B, Hq, Nq, D = q.shape
    N = k.shape[2]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if Hq % k.shape[1]:
        raise ValueError(f"query heads {Hq} not a multiple of kv heads {k.shape[1]}")
    if (B, Hq, N, Nq) != (plan.batch, plan.num_heads, plan.n, plan.n_q):
        raise ValueError(f"plan is for B={plan.batch}, H={plan.num_heads}, {plan.n} keys and "
                         f"{plan.n_q} query rows from {plan.q_start}; got {B}, {Hq}, {N} "
                         f"keys and {Nq} query rows")
    if D not in (16, 32, 64, 80, 96, 128, 256):
        raise ValueError(f"head dim {D} not supported")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {q.dtype} not supported")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the last dim of q, k, v must be contiguous")


def _launch(q, k, v, out, lse, scratch, lse_s, plan: SparsePlan, fl, scale, write_lse,
            config):
    B, Hq, _, D = q.shape
    N = k.shape[2]
    family = _FAMILY_NAME[fl.family]
    cfg = tile_config(q.is_cuda, family, plan.block_m, plan.block_n, config)
    dev = q.device
    dummy_i32 = torch.zeros(1, dtype=torch.int32, device=dev)
    dummy_i8 = torch.zeros(1, dtype=torch.int8, device=dev)
    R = plan.n_row_blocks
    n_programs = R + fl.n_rowline_programs
    S = fl.n_slots
    kg = plan.key_groups if plan.key_groups is not None else dummy_i32
    os_ = scratch if scratch is not None else out.unsqueeze(0)
    ls_ = lse_s if lse_s is not None else lse.unsqueeze(0)
    # The block family reads its full tiles through the copy engine (TMA) where it can.
    kdesc = vdesc = None
    if fl.family == BLOCK:
        kdesc, vdesc = _descriptors(k, v, cfg, D)
    tma = kdesc is not None
    if not tma:
        kdesc = vdesc = q
    kvert = vvert = q
    if fl.vidx is not None:
        kvert, vvert = _gathered_verticals(k, v, fl, Hq // k.shape[1])
    BD = max(16, triton.next_power_of_2(D))
    _sparse_attn_fwd[(n_programs * B * S,)](
        q, k, v, out, os_, lse, ls_,
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
        N, plan.q_start, Hq // k.shape[1], scale * 1.4426950408889634,
        HEAD_D=D, BLOCK_D=BD, BLOCK_M=plan.block_m, BLOCK_N=cfg["BLOCK_N"], FAMILY=fl.family,
        KEY_GROUPED=plan.key_groups is not None, WRITE_LSE=write_lse,
        PRECISION=dot_precision(q.dtype), BLOCK_K=plan.block_n, DMASK=D != BD, TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def sparse_attention(q, k, v, plan: SparsePlan, *, scale: float | None = None,
                     return_lse: bool = False, out: torch.Tensor | None = None, config=None):
    """Exact causal attention over the plan's pair set.

    q ``[B, Hq, Nq, D]``; k, v ``[B, Hkv, N, D]`` (GQA by head index, never repeated), with
    ``Nq = N - plan.q_start``: query row i is position ``plan.q_start + i`` and sees keys up
    to it (``Nq == N`` for a whole prefill). ``out`` may be any ``[B, Hq, Nq, D]`` view (e.g.
    a transposed ``[B, Nq, Hq, D]`` buffer). Returns ``out`` (and the natural-log LSE
    ``[B, Hq, Nq]`` fp32 when ``return_lse``).
    ``config``: tile overrides (``BLOCK_N``, ``num_warps``, ``num_stages``) laid over
    ``runtime.tile_config``'s, for a tile sweep (``benchmarks/kernels.py --tune``).
    """
    _check_inputs(q, k, v, plan)
    B, Hq, N, D = q.shape           # N: query rows
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
    for fl in plan.launches.values():
        _launch(q, k, v, out, lse, scratch, lse_s, plan, fl, scale, need_lse, config)
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


def dense_flops(n: int, heads: int, d: int, batch: int = 1) -> float:
    """FLOPs of causal attention forward (two matmuls over the triangle)."""
    return 4.0 * batch * heads * d * n * (n + 1) / 2


def effective_tflops(density: float, n: int, heads: int, d: int, ms: float) -> float:
    return dense_flops(n, heads, d) * density / (ms * 1e-3) / 1e12


__all__ = ["sparse_attention", "dense_flops", "effective_tflops"]
