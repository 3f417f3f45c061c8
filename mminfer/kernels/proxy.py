"""Launcher of the estimation proxy kernels (``proxy_kernel.py``): every query set of a layer
in one launch per pass (``proxy_sets``)."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton

from .proxy_kernel import (_fold_lse_kernel, _sets_lse_kernel, _sets_mass_chunk_kernel,
                           _sets_mass_kernel)
from .runtime import batch_stride, compiled_gpu, to_device

BLOCK_Q = 64          # the estimator's last_q: the most positions of one query run
GPU_BLOCK_N, CPU_BLOCK_N = 64, 16
# kb_per: key blocks per log-sum-exp program (x G query heads each); programs_per_sm: of
# the persistent mass kernel; warps per kernel.
# Measured on the H200 (lab/NOTES.md, "Estimation without host waits"): these defaults are the
# best of 2-8 warps, 2-16 programs per SM and 4-32 key blocks per program; a mass pass laid out
# like the log-sum-exp pass (heads outer, key blocks inner) is 3-5 % slower.
# mass_layout: "persistent" (one program per SM share of key tiles), "chunks" (key blocks in
# order, the diagonal gather halved) or "auto": chunks from ``chunks_from`` keys on. On the
# H200 (one run, lab/NOTES.md "Kernel variants and the query-set estimator") persistent is
# 1.40x faster at 262K keys and chunks 1.15x faster at 1.05M; the switch sits between the two
# measured lengths, unmeasured there.
TUNING = {"kb_per": 8, "programs_per_sm": 4, "lse_warps": 4, "mass_warps": 4,
          "mass_layout": "auto", "chunks_from": 1 << 19}


@contextmanager
def mass_layout(layout: str):
    """Every launch in the block takes the mass pass ``layout`` ("persistent" or "chunks"),
    whatever its length: the warm-up compiles the chunked one, which only requests of
    ``chunks_from`` keys and more run. Not for use while requests run."""
    was = TUNING["mass_layout"]
    TUNING["mass_layout"] = layout
    try:
        yield
    finally:
        TUNING["mass_layout"] = was


@dataclass(frozen=True)
class QuerySet:
    """One query set of a layer's estimate: its contiguous ``runs`` ((q0, nq), at most
    ``BLOCK_Q`` positions each), the query ``heads`` whose sums are wanted (ascending), and
    per head the diagonal sums it needs: ``diags[i]`` a tuple of key groups, ``None`` meaning
    the diagonal over every key."""
    runs: tuple
    heads: tuple
    diags: tuple


def _pairs(sets, Hq, Hkv):
    """Host tables of the pairs (run x head) grouped by KV head, the slots, and the
    diagonal outputs: every int the kernels read, in one int32 tensor (one upload)."""
    G = Hq // Hkv
    outs = sorted({d for s in sets for ds in s.diags for d in ds}, key=lambda d: (d is not None, d or 0))
    dslot = {d: t for t, d in enumerate(outs)}
    pairs, slot0 = [], 0
    for s in sets:
        for i, h in enumerate(s.heads):
            bits = sum(1 << dslot[d] for d in s.diags[i])
            for q0, nq in s.runs:
                pairs.append((h // G, q0, nq, h, slot0 + i, bits))
        slot0 += len(s.heads)
    pairs.sort(key=lambda p: p[0])                 # stable: a slot's runs stay in order
    kv = [0] * (Hkv + 1)
    for p in pairs:
        kv[p[0] + 1] += 1
    for i in range(Hkv):
        kv[i + 1] += kv[i]
    cols = list(zip(*pairs)) if pairs else [()] * 6
    dgroup = [-1 if d is None else int(d) for d in outs] or [-1]
    flat = kv + [x for c in cols[1:] for x in c] + dgroup
    return flat, len(pairs), slot0, outs


@functools.lru_cache(maxsize=64)
def _pair_table(sets, Hq, Hkv, device):
    """The pair table on the device, uploaded once per (sets, heads): consecutive layers
    with the same patterns and layout reuse it."""
    flat, n_pairs, n_slots, outs = _pairs(sets, Hq, Hkv)
    return to_device(torch.tensor(flat, dtype=torch.int32), device), n_pairs, n_slots, outs


def proxy_sets(q: torch.Tensor, k: torch.Tensor, sets, scale: float, *,
               kgroup: torch.Tensor | None = None, config: dict | None = None,
               q_start: int = 0) -> list:
    """``proxy_stats`` for every query set of a layer in one launch per pass, each set only
    for its heads. ``sets`` a sequence of ``QuerySet``. Returns per set ``(col, diags)``:
    ``col [B, len(heads), N]`` fp32 and ``diags`` {d: ``[B, len(heads), N]``} for every d
    some head of the set asked for (rows of heads that did not ask for d are zero).
    ``q_start``: q holds the rows ``[q_start, N)`` of the N keys' positions (a piece
    appended to a cached prompt); the runs' positions stay absolute."""
    B, Hq, Nq, D = q.shape
    N = k.shape[2]
    Hkv = k.shape[1]
    sets = tuple(sets)
    if Hq % Hkv or k.shape[0] != B or Nq != N - q_start or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} from row "
                         f"{q_start}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("the last dim of q and k must be contiguous")
    for s in sets:
        if len(s.diags) != len(s.heads) or list(s.heads) != sorted(set(s.heads)):
            raise ValueError(f"query set heads {s.heads} must be ascending, one diags entry each")
        for q0, nq in s.runs:
            if not 1 <= nq <= BLOCK_Q or q0 < q_start or q0 + nq > N:
                raise ValueError(f"query run {q0}..{q0 + nq} must hold 1..{BLOCK_Q} positions of {N}")
    dev = q.device
    table, n_pairs, n_slots, outs = _pair_table(sets, Hq, Hkv, dev)
    by_group = any(d is not None for d in outs)
    if by_group and kgroup is None:
        raise ValueError("diagonals over a key group need kgroup")
    gpu = compiled_gpu(q.is_cuda)
    cfg = {**TUNING, **(config or {})}
    # the chunked mass pass pairs key blocks with query blocks (BLOCK_N == BLOCK_Q), on the
    # CPU too, where the interpreter otherwise takes smaller tiles
    kend = max((q0 + nq for s in sets for q0, nq in s.runs), default=0)
    layout = cfg["mass_layout"]
    if layout == "auto":
        layout = "chunks" if kend >= cfg["chunks_from"] else "persistent"
    if layout not in ("persistent", "chunks"):
        raise ValueError(f"mass_layout {layout!r}: one of 'auto', 'persistent', 'chunks'")
    BN = BLOCK_Q if layout == "chunks" else (GPU_BLOCK_N if gpu else CPU_BLOCK_N)
    BD = max(16, triton.next_power_of_2(D))
    kb_per = cfg["kb_per"]
    results = []
    col = torch.zeros(B, n_slots, N, device=dev, dtype=torch.float32)
    dg = torch.zeros(max(len(outs), 1), B, n_slots, N, device=dev, dtype=torch.float32)
    if n_pairs:
        H1 = Hkv + 1
        kv, q0s, nqs, heads, slots, bits = (table[:H1],) + tuple(
            table[H1 + i * n_pairs:H1 + (i + 1) * n_pairs] for i in range(5))
        dgroup = table[H1 + 5 * n_pairs:]
        common = (batch_stride(q), q.stride(1), q.stride(2), batch_stride(k), k.stride(1),
                  k.stride(2), Hkv, D, q_start)
        n_kb = triton.cdiv(kend, BN)
        n_chunks = triton.cdiv(n_kb, kb_per)
        m = torch.empty(B, n_pairs, n_chunks, BLOCK_Q, device=dev, dtype=torch.float32)
        l = torch.empty_like(m)
        _sets_lse_kernel[(B * Hkv, n_chunks)](
            q, k, m, l, kv, q0s, nqs, heads, n_pairs, n_chunks, float(scale), *common,
            BLOCK_Q=BLOCK_Q, BLOCK_N=BN, BLOCK_D=BD, KB_PER=kb_per, num_warps=cfg["lse_warps"])
        lse = torch.empty(B, n_pairs, BLOCK_Q, device=dev, dtype=torch.float32)
        _fold_lse_kernel[(B * n_pairs,)](m, l, lse, n_chunks, BLOCK_Q=BLOCK_Q,
                                         BLOCK_C=16, num_warps=4)
        n_tiles = B * Hkv * n_kb
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if gpu else 2
        n_prog = max(1, min(n_tiles, sms * cfg["programs_per_sm"]))
        kg = kgroup.to(device=dev, dtype=torch.int32).contiguous() if by_group else dgroup
        if layout == "chunks":
            if BN != BLOCK_Q:
                raise ValueError("the chunked mass pass needs BLOCK_N == BLOCK_Q")
            _sets_mass_chunk_kernel[(B * Hkv, n_chunks)](
                q, k, lse, col, dg, kg, dgroup, kv, q0s, nqs, heads, slots, bits,
                n_pairs, n_slots, N, n_chunks, B, float(scale), *common,
                BLOCK_Q=BLOCK_Q, BLOCK_D=BD, KB_PER=kb_per, N_DIAG=len(outs),
                ND_P2=triton.next_power_of_2(max(len(outs), 1)), BY_GROUP=by_group,
                num_warps=cfg["mass_warps"])
        else:
            _sets_mass_kernel[(n_prog,)](
                q, k, lse, col, dg, kg, dgroup, kv, q0s, nqs, heads, slots, bits,
                n_pairs, n_slots, N, n_kb, n_tiles, B, float(scale), *common,
                BLOCK_Q=BLOCK_Q, BLOCK_N=BN, BLOCK_D=BD,
                SKEW_W=triton.next_power_of_2(BLOCK_Q + BN - 1), N_DIAG=len(outs),
                BY_GROUP=by_group, num_warps=cfg["mass_warps"])
    slot0 = 0
    for s in sets:
        a, b = slot0, slot0 + len(s.heads)
        want = {d for ds in s.diags for d in ds}
        results.append((col[:, a:b], {d: dg[t, :, a:b] for t, d in enumerate(outs) if d in want}))
        slot0 = b
    return results
