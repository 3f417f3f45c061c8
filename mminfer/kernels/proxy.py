"""Launcher of the estimation proxy kernels (``proxy_kernel.py``)."""

from __future__ import annotations

import torch
import triton

from .proxy_kernel import _proxy_lse_kernel, _proxy_mass_kernel
from .runtime import as_device, batch_stride, compiled_gpu

BLOCK_Q = 64          # the estimator's last_q: one query run per launch
GPU_BLOCK_N, CPU_BLOCK_N = 64, 16
# kb_per: key blocks per log-sum-exp program (x G query heads each); programs_per_sm: of
# the persistent mass kernel; warps per kernel.
# Measured on the H200 (BENCHMARKS.md section 7): these defaults are the best of 2-8 warps,
# 2-16 programs per SM and 4-32 key blocks per program; a mass pass laid out like the
# log-sum-exp pass (heads outer, key blocks inner) was 3-5 % slower and was dropped.
TUNING = {"kb_per": 8, "programs_per_sm": 4, "lse_warps": 4, "mass_warps": 4}


def proxy_stats(q: torch.Tensor, k: torch.Tensor, q0: int, nq: int, scale: float, *,
                diag: bool = True, kgroup: torch.Tensor | None = None,
                targets: tuple = (), config: dict | None = None) -> tuple:
    """Column and diagonal sums of softmax(q[:, :, q0:q0+nq] kᵀ · scale) under the causal
    mask (keys 0 .. q0 + nq - 1), fp32, for queries at the contiguous positions q0.. .

    q ``[B, Hq, N, D]``, k ``[B, Hkv, N, D]`` (GQA by index). Returns ``(col, diag,
    diag_k)``: ``col[b, h, j]`` the mass of key j summed over the queries, ``diag[b, h, o]``
    the mass at offset o = query - key (None unless ``diag``), and ``diag_k[g]`` the same
    counting only keys whose ``kgroup`` is g, for every g in ``targets``. ``config``
    overrides ``TUNING`` (``benchmarks/estimate.py --tune-proxy`` measures them)."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    if not 1 <= nq <= BLOCK_Q or q0 < 0 or q0 + nq > N:
        raise ValueError(f"query run {q0}..{q0 + nq} must hold 1..{BLOCK_Q} positions of {N}")
    if Hq % Hkv or k.shape[0] != B or k.shape[2] != N or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("the last dim of q and k must be contiguous")
    if targets and kgroup is None:
        raise ValueError("targets need kgroup")
    dev = q.device
    gpu = compiled_gpu(q.is_cuda)
    BN = GPU_BLOCK_N if gpu else CPU_BLOCK_N
    BD = max(16, triton.next_power_of_2(D))
    kend = q0 + nq
    n_kb = triton.cdiv(kend, BN)
    BH = B * Hq
    common = (batch_stride(q), q.stride(1), q.stride(2), batch_stride(k), k.stride(1), k.stride(2),
              Hq, Hkv, Hq // Hkv, D)
    cfg = {**TUNING, **(config or {})}
    kb_per = cfg["kb_per"]

    n_chunks = triton.cdiv(n_kb, kb_per)
    m = torch.empty(BH, n_chunks, BLOCK_Q, device=dev, dtype=torch.float32)
    l = torch.empty_like(m)
    _proxy_lse_kernel[(B * Hkv, n_chunks)](
        q, k, m, l, q0, nq, kend, n_chunks, float(scale), *common,
        BLOCK_Q=BLOCK_Q, BLOCK_N=BN, BLOCK_D=BD, KB_PER=kb_per, num_warps=cfg["lse_warps"])
    mx = m.amax(1, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    lse = (mx.squeeze(1) + torch.log((l * torch.exp(m - mx)).sum(1)))
    # padded rows (r >= nq) have no keys: any finite lse keeps their p at exactly 0
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).contiguous()

    n_diag = (1 if diag else 0) + len(targets)
    col = torch.zeros(BH, N, device=dev, dtype=torch.float32)
    dg = torch.zeros(max(n_diag, 1), BH, N, device=dev, dtype=torch.float32)
    n_tiles = B * Hkv * n_kb
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if gpu else 2
    n_prog = max(1, min(n_tiles, sms * cfg["programs_per_sm"]))
    kg = kgroup.to(device=dev, dtype=torch.int32).contiguous() if kgroup is not None else \
        torch.zeros(1, device=dev, dtype=torch.int32)
    # diagonal slots: [the plain one if asked for, then one per target key group]
    tg = as_device(list(targets) or [0], dev, torch.int32)
    _proxy_mass_kernel[(n_prog,)](
        q, k, lse, col, dg, kg, tg, q0, nq, kend, N, n_kb, n_tiles, BH,
        float(scale), *common, BLOCK_Q=BLOCK_Q, BLOCK_N=BN, BLOCK_D=BD,
        SKEW_W=triton.next_power_of_2(BLOCK_Q + BN - 1), N_DIAG=n_diag, PLAIN=int(diag),
        num_warps=cfg["mass_warps"])
    col = col.view(B, Hq, N)
    out_diag = dg[0].view(B, Hq, N) if diag else None
    first = 1 if diag else 0
    diag_k = {g: dg[first + i].view(B, Hq, N) for i, g in enumerate(targets)}
    return col, out_diag, diag_k
