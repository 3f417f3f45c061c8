"""How much a plan computes, counted from its compiled arrays: no kernel launch, at any N.

This is the one place a plan's work is counted: ``plan.density()`` is ``plan_density``, and
``sparsity`` sums the plans of a prefill's layers (what an answer reports).

The counts follow the kernel's own traversal (``sparse_attn_kernel.py``) in closed form per
(slot, row block): the near range from ``lo = max(r0 - window, 0)``, the far streams (sink
segment, grid columns, verticals, slash ranges, key blocks), the grid row-line programs.
Tiles are counted ``COUNT_TILE`` keys wide (at most the row block and key block, as the
kernel's): 64 on a GPU, the width every figure in BENCHMARKS.md was counted at, though the
H200 kernel reads 128-key tiles for every family but block; 16 under the interpreter, the
kernel's own width there.

* ``logical``: the pairs computed, over the causal triangle (each pair once: ``<= 1``; with
  queries from ``q_start``, over the causal pairs of those rows);
* ``physical``: the kernel's tile work (tiles visited x ``block_m`` x ``BLOCK_N``) over the
  tile work of a dense causal pass on the same row blocks and tiles, so a dense plan is
  exactly 1.0. It is work, not a set: a 2D-boundary head runs its near range once per key
  group and grid row-line rows are computed again by their row block (and discarded), so
  a plan can cost more than dense (short inputs); that is reported, never clipped.
* ``tile_pairs``: the tile work itself (pairs, masked ones included): what a benchmark
  divides by time for effective TFLOP/s.
"""

from __future__ import annotations

import torch

from .layout import (F_ACTIVE, F_END, F_HEAD, F_KGROUP, F_LINES, F_PHASE, F_QGROUP, F_SINK,
                     F_START, F_STRIDE, F_WINDOW, LINES_COLS, LINES_ROWS)
from .runtime import CPU_CONFIG, compiled_gpu

COUNT_TILE = {"gpu": 64, "cpu": CPU_CONFIG["BLOCK_N"]}
_PAD = 1 << 30
_CHUNK = 1 << 22   # (slot, row block, index) elements per step of the index-list counts


def _cdiv(a, b):
    return -((-a) // b)


class _Keys:
    """Key counts of a slot: ``count(kg, x)`` = keys below x it may see (``kg`` the slot's
    key group, -1: every key), ``prefix(kg, y)`` = sum of ``count(kg, x)`` over x < y."""

    def __init__(self, plan):
        n, dev = plan.n, plan.table.device
        rows = [torch.arange(n + 1, device=dev, dtype=torch.int64)[None].expand(plan.batch, -1)]
        self.gid = plan.key_groups
        if plan.key_groups is not None:
            kg = plan.key_groups.to(torch.int64)
            for g in range(plan.n_key_groups):
                c = (kg == g).to(torch.int64).cumsum(-1)
                rows.append(torch.nn.functional.pad(c, (1, 0)))
        self.c = torch.stack(rows, 1)                              # [B, G+1, N+1]
        self.sc = torch.nn.functional.pad(self.c.cumsum(-1), (1, 0))  # [B, G+1, N+2]
        self.n = n
        self.spans = plan.row_groups or [(0, n, 0)]

    def _at(self, table, kg, x):
        b = torch.arange(kg.shape[0], device=kg.device).view(-1, *([1] * (x.dim() - 1)))
        g = (kg + 1).clamp(min=0)
        while g.dim() < x.dim():
            g = g.unsqueeze(-1)
        return table[b, g, x]

    def count(self, kg, x):
        return self._at(self.c, kg, x.clamp(0, self.n))

    def prefix(self, kg, y):
        return self._at(self.sc, kg, y.clamp(0, self.n + 1))

    def group_of(self, pos, kg):
        """1 where key ``pos`` (any shape ``[B, ...]``) is visible to key group ``kg``."""
        if self.gid is None:
            return torch.ones_like(pos)
        b = torch.arange(pos.shape[0], device=pos.device).view(-1, *([1] * (pos.dim() - 1)))
        g = self.gid.to(torch.int64)[b, pos.clamp(0, self.n - 1)]
        k = kg
        while k.dim() < pos.dim():
            k = k.unsqueeze(-1)
        return ((k < 0) | (g == k)).to(torch.int64)

    def on_progression(self, kg, j0, step, count):
        """Keys of group ``kg`` (broadcastable to the others) among ``j0 + t * step`` for
        t < count (grid columns)."""
        if self.gid is None:
            return count
        out = torch.zeros_like(count)
        for a, e, g in self.spans:
            t_a = torch.minimum(_cdiv(a - j0, step).clamp(min=0), count)
            t_e = torch.minimum(_cdiv(e - j0, step).clamp(min=0), count)
            out += torch.where(kg == g, (t_e - t_a).clamp(min=0), 0)
        return torch.where(kg < 0, count, out)


def counts(plan, block_n_tile: int | None = None) -> dict:
    """Raw counts: ``pairs_per_head [H]`` and ``tiles_per_head [H]`` (int64, device),
    ``tiles`` per family (host ints), and ``dense_tiles`` (tiles of a dense causal pass per
    head and request)."""
    dev = plan.table.device
    BM, BK = plan.block_m, plan.block_n
    BN = block_n_tile or min(COUNT_TILE["gpu" if compiled_gpu(dev.type == "cuda") else "cpu"],
                             BM, BK)
    t = plan.table.to(torch.int64)
    r0, r1, rg = t[:, 0], t[:, 1], t[:, 2]
    keys = _Keys(plan)
    pairs = torch.zeros(plan.num_heads, dtype=torch.int64, device=dev)
    tiles = torch.zeros(plan.num_heads, dtype=torch.int64, device=dev)
    by_family = {}
    for name, fl in plan.launches.items():
        p = fl.params.to(torch.int64)                                   # [B, S, NF]
        f = {k: p[:, :, i, None] for k, i in (
            ("qg", F_QGROUP), ("kg", F_KGROUP), ("sink", F_SINK), ("window", F_WINDOW),
            ("start", F_START), ("end", F_END), ("stride", F_STRIDE), ("phase", F_PHASE),
            ("lines", F_LINES))}
        on = (p[:, :, F_ACTIVE] != 0)[..., None]
        kg = p[:, :, F_KGROUP]
        act = on & ((f["qg"] < 0) | (rg[None, None, :] == f["qg"]))     # [B, S, R]
        lo = torch.clamp(r0 - f["window"], min=0)
        rows = r1 - r0
        # near range [lo, r1): full tiles below r0, then causal tiles
        nf = (r0 - lo) // BN
        t_near = nf + _cdiv(r1 - (lo + nf * BN), BN)
        near = keys.prefix(kg, (r1 + 1).expand_as(lo)) - keys.prefix(kg, (r0 + 1).expand_as(lo)) \
            - rows * keys.count(kg, lo)
        far_keys, far_tiles = _far(name, fl, f, kg, lo, r0, r1, keys, BN, BK)
        n_line = torch.zeros_like(lo)
        if name == "grid":
            rowlines = (f["lines"] & LINES_ROWS) != 0
            first = f["start"] + f["phase"]

            def lines_below(x):
                return _cdiv(torch.minimum(x, f["end"]) - first, f["stride"]).clamp(min=0)

            n_line = torch.where(rowlines, lines_below(r1) - lines_below(r0), n_line)
        # Rows on grid lines are stored by their row-line program, which sees every key
        # below them: near_i + count(lo) each, so their block's far keys are not theirs.
        slot_pairs = torch.where(act, (rows - n_line) * far_keys + near
                                 + n_line * keys.count(kg, lo), 0).sum(-1)       # [B, S]
        slot_tiles = torch.where(act, t_near + far_tiles, 0).sum(-1)
        if name == "grid" and fl.n_rowline_programs:
            slot_tiles = slot_tiles + _rowline_tiles(f, on, fl.n_rowline_programs, BM, BN,
                                                     plan.n, plan.q_start)
        heads = p[:, :, F_HEAD].reshape(-1)
        pairs.index_add_(0, heads, slot_pairs.reshape(-1))
        tiles.index_add_(0, heads, slot_tiles.reshape(-1))
        by_family[name] = slot_tiles.sum()
    return {"pairs_per_head": pairs, "tiles_per_head": tiles, "block_n_tile": BN,
            "tiles": {k: int(v) for k, v in by_family.items()},
            "dense_tiles": dense_tiles(plan.table, BN)}


def dense_tiles(table: torch.Tensor, BN: int) -> int:
    """Tiles a dense causal pass visits over these row blocks (keys [0, r1) from each)."""
    t = table.to(torch.int64)
    nf = t[:, 0] // BN
    return int((nf + _cdiv(t[:, 1] - nf * BN, BN)).sum())


def _far(name, fl, f, kg, lo, r0, r1, keys, BN, BK):
    """Far keys per row (the same for every row of a block) and far tiles, ``[B, S, R]``."""
    if name in ("a_shape", "grid"):
        s_end = torch.minimum(f["sink"], lo)
        far_keys = keys.count(kg, s_end)
        far_tiles = _cdiv(s_end, BN)
        if name == "grid":
            cols = (f["lines"] & LINES_COLS) != 0
            s, start = f["stride"].clamp(min=1), f["start"]
            c_lo = torch.maximum(f["sink"], start)
            c_hi = torch.minimum(f["end"], lo)
            skip = (c_lo - start - f["phase"]).clamp(min=0)
            j0 = start + f["phase"] + _cdiv(skip, s) * s
            n_cols = torch.where(cols, _cdiv(c_hi - j0, s).clamp(min=0), 0)
            far_keys = far_keys + keys.on_progression(f["kg"], j0, s, n_cols)
            far_tiles = far_tiles + _cdiv(n_cols, BN)
        return far_keys, far_tiles
    B, S, R = lo.shape
    far_keys = torch.zeros_like(lo)
    far_tiles = torch.zeros_like(lo)
    if name == "vertical_slash":
        vidx = fl.vidx.to(torch.int64)                                   # [B, S, nv]
        # visible verticals among the first m of the sorted list
        vis = torch.nn.functional.pad(keys.group_of(vidx, kg) * (vidx < keys.n), (1, 0))
        vcum = vis.cumsum(-1)                                            # [B, S, nv + 1]
        n_v = fl.vcnt.to(torch.int64)
        far_keys += vcum.gather(-1, n_v)
        far_tiles += _cdiv(n_v, BN)
        sidx = fl.sidx.to(torch.int64)                                   # [B, S, ns]
        ns = sidx.shape[-1]
        prev = torch.nn.functional.pad(sidx, (1, 0), value=-_PAD)[..., :ns]
        kk = torch.arange(ns, device=lo.device)
        step = max(1, _CHUNK // max(1, B * S * ns))
        for a in range(0, R, step):
            b = min(a + step, R)
            k_lo = fl.srange[:, :, a:b, 0].to(torch.int64)[..., None]   # [B, S, r, 1]
            k_hi = fl.srange[:, :, a:b, 1].to(torch.int64)[..., None]
            use = (kk >= k_lo) & (kk < k_hi)                             # [B, S, r, ns]
            o = sidx[:, :, None, :]
            o_prev = torch.where(kk == k_lo, torch.full_like(o, -_PAD), prev[:, :, None, :])
            q0, q1 = r0[a:b, None], r1[a:b, None]
            ks = (q0 - o).clamp(min=0)
            ke = torch.minimum(torch.minimum(q1 - o, q0 - o_prev), lo[:, :, a:b, None])
            ln = torch.where(use, (ke - ks).clamp(min=0), 0)
            ke = ks + ln
            far_tiles[:, :, a:b] += _cdiv(ln, BN).sum(-1)
            flat = (B, S, -1)
            v_in = vcum.gather(-1, torch.searchsorted(vidx, ke.reshape(flat))) \
                - vcum.gather(-1, torch.searchsorted(vidx, ks.reshape(flat)))
            got = keys.count(kg, ke.reshape(flat)) - keys.count(kg, ks.reshape(flat)) - v_in
            far_keys[:, :, a:b] += torch.where(use, got.view_as(ln), 0).sum(-1)
    else:  # block
        bidx = fl.bidx.to(torch.int64)                                   # [B, S, R, k]
        nb = fl.bcnt.to(torch.int64)
        far_tiles += nb * (BK // BN)
        k = bidx.shape[-1]
        kk = torch.arange(k, device=lo.device)
        step = max(1, _CHUNK // max(1, B * S * k))
        for a in range(0, R, step):
            b = min(a + step, R)
            c = bidx[:, :, a:b]
            use = kk < nb[:, :, a:b, None]
            c0 = torch.where(use, c, 0) * BK
            c1 = torch.minimum(c0 + BK, lo[:, :, a:b, None])
            flat = (B, S, -1)
            got = keys.count(kg, c1.reshape(flat)) - keys.count(kg, c0.reshape(flat))
            far_keys[:, :, a:b] += torch.where(use, got.view_as(c0), 0).sum(-1)
    return far_keys, far_tiles


def _rowline_tiles(f, on, n_programs, BM, BN, n, q_start=0):
    """Tiles of the grid row-line programs per slot ``[B, S]``: program t holds lines
    t * BM .. (t + 1) * BM - 1 (from the first at or after ``q_start``) and sweeps keys
    [0, its last row]."""
    t = torch.arange(n_programs, device=on.device)
    s = f["stride"].clamp(min=1)
    first = f["start"] + f["phase"]
    first = first + _cdiv(q_start - first, s).clamp(min=0) * s
    n_lines = _cdiv(f["end"] - first, s).clamp(min=0)
    r0 = first + t * BM * s
    live = on & ((f["lines"] & LINES_ROWS) != 0) & (r0 < f["end"])
    last = torch.minimum((t + 1) * BM, n_lines) - 1
    r1 = torch.minimum(first + last * s + 1, torch.full_like(r0, n))
    nf = (r0 + 1) // BN
    cnt = nf + _cdiv(r1 - nf * BN, BN).clamp(min=0)
    return torch.where(live, cnt, 0).sum(-1)


def summarise(plan, raw: dict) -> dict:
    """Fractions from raw counts (``counts``)."""
    B, H, N, q0 = plan.batch, plan.num_heads, plan.n, plan.q_start
    tri = (N * (N + 1) - q0 * (q0 + 1)) / 2      # causal pairs of the query rows
    area = plan.block_m * raw["block_n_tile"]
    # on the host: CUDA divides a tensor by a scalar as a multiplication by its reciprocal
    # (one ulp off the quotient), so the same plan would report other fractions on a GPU
    pairs = raw["pairs_per_head"].cpu().double()
    tiles = raw["tiles_per_head"].cpu().double()
    dense = float(raw["dense_tiles"])
    return {"logical": float(pairs.sum()) / (B * H * tri),
            "physical": float(tiles.sum()) / (B * H * dense),
            "tiles": dict(raw["tiles"]), "pairs": float(pairs.sum()),
            "tile_pairs": float(tiles.sum()) * area,
            "logical_per_head": pairs / (B * tri),
            "physical_per_head": tiles / (B * dense)}


def plan_density(plan) -> dict:
    """What ``plan`` computes, counted from its arrays (no launch, any N): ``logical`` (pairs
    over the causal triangle), ``physical`` (tile work over a dense pass's), ``tiles`` per
    family, ``pairs``, ``tile_pairs``, and both fractions per head (see the module's head)."""
    return summarise(plan, counts(plan))


def sparsity(plans: dict) -> dict | None:
    """What the sparse layers of one prefill computed, counted from their plans (no launch):
    ``plans`` maps layer -> ``SparsePlan`` (or an already counted ``plan_density`` dict, or a
    bare logical density). None without plans.

    ``mean_density`` / ``per_layer`` (with ``layers``): the pairs computed over the causal
    triangle, each pair once, so never above 1. ``mean_tile_work`` / ``per_layer_tile_work``:
    the kernels' tile work over a dense pass's (``physical``): what the time follows. It is
    work, not a share, and goes above 1 where a plan costs more than dense (on short prompts
    a 2D-boundary head sweeps its near range once per key group); reported as it is."""
    if not plans:
        return None
    per_layer, tiles = {}, {}
    for layer, plan in sorted(plans.items()):
        d = plan_density(plan) if hasattr(plan, "launches") else plan
        if isinstance(d, dict):
            per_layer[layer] = float(d["logical"])
            if "physical" in d:
                tiles[layer] = float(d["physical"])
        else:
            per_layer[layer] = float(d)
    out = {"mean_density": sum(per_layer.values()) / len(per_layer),
           "per_layer": [round(v, 6) for v in per_layer.values()],
           "layers": list(per_layer)}
    if tiles:
        out["mean_tile_work"] = sum(tiles.values()) / len(tiles)
        out["per_layer_tile_work"] = [round(v, 6) for v in tiles.values()]
    return out
