"""What one layer's sparse attention computes: pattern specs, the row-block table, the plan.

A *pattern spec* gives one pattern family for a set of query heads (all heads at once;
per-head values are sequences or tensors, never a Python loop per head in the hot path).
``SparsePlan.build`` turns the specs into the compact device arrays the kernel reads:

* the row-block table ``[R, 3]`` (start, end, group): blocks of ``block_m`` rows that never
  straddle a modality span when rows are grouped (Q-boundary / 2D-boundary), so every
  block holds rows of exactly one modality while rows stay at their original positions;
* per family one int32 parameter row per *slot* ``[B, S, 12]`` (head, query group, key
  group, destination, sink, window, grid span/stride/phase/lines);
* index arrays only for vertical-slash (sorted verticals, per-block counts, sorted slash
  offsets, per-block offset ranges) and block (per row block sorted key blocks).

Pattern semantics, exactly (``r0(i)``, ``r1(i)`` are the bounds of row i's block, all pairs
also causal ``j <= i`` on original positions):

* near range, every family: ``j >= max(r0(i) - window, 0)``
* a_shape: ``j < sink``
* grid over span [start, end) with stride s, phase p: ``j < sink``; columns ``j`` in span
  with ``(j - start) % s == p``; rows ``i`` in span with ``(i - start) % s == p`` see every key
* vertical_slash: ``j`` a vertical; or an offset ``o`` with ``r0(i) - o <= j < r1(i) - o``
  (slash tiles are row-block granular, as in MInference)
* block: key block ``j // block_n`` listed for row i's block

A slot restricted to query group g covers only rows of that group; a slot restricted to key
group g (2D-boundary) sees only keys of that group, and its partial results are merged with
the head's other key groups through their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from .sparse_attn_kernel import A_SHAPE, BLOCK, GRID, NF, VERTICAL_SLASH

IntLike = Union[int, Sequence[int], torch.Tensor]
_PAD = 1 << 30
FAMILIES = {"a_shape": A_SHAPE, "grid": GRID, "vertical_slash": VERTICAL_SLASH, "block": BLOCK}
_LINES = {"cols": 1, "rows": 2, "both": 3}


@dataclass
class AShape:
    """Sink tokens + local window. ``dense`` is ``window >= N``."""
    heads: Sequence[int]
    sink: IntLike = 64
    window: IntLike = 1024
    qgroup: IntLike = -1
    kgroup: IntLike = -1


@dataclass
class Grid:
    """Grid lines inside span [start, end): stride/phase per head (ints or ``[B, H']``)."""
    heads: Sequence[int]
    start: IntLike
    end: IntLike
    stride: IntLike
    phase: IntLike
    lines: Union[str, Sequence[str]] = "both"
    sink: IntLike = 64
    window: IntLike = 256
    qgroup: IntLike = -1
    kgroup: IntLike = -1


@dataclass
class VerticalSlash:
    """``verticals [B, H', nv]`` key columns and ``slashes [B, H', ns]`` diagonal offsets
    (0 = main diagonal); entries < 0 are padding."""
    heads: Sequence[int]
    verticals: torch.Tensor
    slashes: torch.Tensor
    window: IntLike = 64
    qgroup: IntLike = -1
    kgroup: IntLike = -1


@dataclass
class Block:
    """``key_blocks [B, H', R, k]``: key block ids (of ``block_n`` keys) per row block of the
    plan's table (see ``row_table``); entries < 0 are padding."""
    heads: Sequence[int]
    key_blocks: torch.Tensor
    window: IntLike = 0
    qgroup: IntLike = -1
    kgroup: IntLike = -1


def dense(heads: Sequence[int], n: int, qgroup: IntLike = -1, kgroup: IntLike = -1) -> AShape:
    return AShape(heads=heads, sink=0, window=n, qgroup=qgroup, kgroup=kgroup)


def row_table(n: int, block_m: int, row_groups=None) -> torch.Tensor:
    """Row blocks ``[R, 3]`` (start, end, group). ``row_groups``: ordered spans
    ``(start, end, group)`` covering [0, n); no block straddles two spans."""
    if row_groups is None:
        row_groups = [(0, n, 0)]
    rows, pos = [], 0
    for start, end, g in row_groups:
        if start != pos or end <= start:
            raise ValueError(f"row groups must tile [0, {n}) in order; got span ({start}, {end})")
        for a in range(start, end, block_m):
            rows.append((a, min(a + block_m, end), g))
        pos = end
    if pos != n:
        raise ValueError(f"row groups end at {pos}, expected {n}")
    return torch.tensor(rows, dtype=torch.int32)


def _per_slot(x: IntLike, batch: int, n_slots: int, name: str) -> torch.Tensor:
    """Broadcast an int, a per-head sequence or a ``[B, H']`` tensor to ``[B, S]`` int64."""
    if isinstance(x, torch.Tensor):
        t = x.to(torch.int64).cpu() if x.device.type == "cpu" else x.to(torch.int64)
        if t.dim() == 0:
            t = t.expand(batch, n_slots)
        elif t.dim() == 1:
            t = t[None, :].expand(batch, n_slots)
    elif isinstance(x, int):
        t = torch.full((batch, n_slots), x, dtype=torch.int64)
    else:
        t = torch.tensor(list(x), dtype=torch.int64)[None, :].expand(batch, n_slots)
    if tuple(t.shape) != (batch, n_slots):
        raise ValueError(f"{name}: expected an int, {n_slots} values or [{batch}, {n_slots}], "
                         f"got shape {tuple(t.shape)}")
    return t


def _sorted_unique(x: torch.Tensor) -> torch.Tensor:
    """Sort the last dim ascending with padding (< 0) last as _PAD, duplicates made padding."""
    x = torch.where(x < 0, torch.full_like(x, _PAD), x.to(torch.int64))
    x, _ = torch.sort(x, dim=-1)
    if x.shape[-1] > 1:
        dup = torch.zeros_like(x, dtype=torch.bool)
        dup[..., 1:] = x[..., 1:] == x[..., :-1]
        x = torch.where(dup, torch.full_like(x, _PAD), x)
        x, _ = torch.sort(x, dim=-1)
    return x


@dataclass
class FamilyLaunch:
    family: int
    params: torch.Tensor                # [B, S, NF] int32
    n_rowline_programs: int = 0
    vidx: torch.Tensor | None = None    # [B, S, nv] int32, sorted, padded with _PAD
    vcnt: torch.Tensor | None = None    # [B, S, R] int32: verticals below each block's lo
    vflag: torch.Tensor | None = None   # [B, S, N] int8: 1 where a key is a vertical
    sidx: torch.Tensor | None = None    # [B, S, ns] int32, sorted offsets
    srange: torch.Tensor | None = None  # [B, S, R, 2] int32: offsets that reach below lo
    bidx: torch.Tensor | None = None    # [B, S, R, k] int32, sorted key blocks
    bcnt: torch.Tensor | None = None    # [B, S, R] int32: key blocks below lo

    @property
    def n_slots(self) -> int:
        return self.params.shape[1]


@dataclass
class SparsePlan:
    n: int
    batch: int
    num_heads: int
    block_m: int
    block_n: int
    table: torch.Tensor                     # [R, 3] int32 (device)
    launches: dict = field(default_factory=dict)  # family name -> FamilyLaunch
    key_groups: torch.Tensor | None = None  # [B, N] int32 group per key (2D-boundary)
    heads_2d: list = field(default_factory=list)
    n_key_groups: int = 0
    specs: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, n: int, num_heads: int, specs: Sequence, *, block_m: int = 128,
              block_n: int = 64, row_groups=None, batch: int = 1, device="cpu",
              max_row_lines: int | None = None, check_coverage: bool = True) -> "SparsePlan":
        device = torch.device(device)
        table_cpu = row_table(n, block_m, row_groups)
        R = table_cpu.shape[0]
        by_family: dict[str, list] = {}
        for sp in specs:
            name = {AShape: "a_shape", Grid: "grid", VerticalSlash: "vertical_slash",
                    Block: "block"}.get(type(sp))
            if name is None:
                raise TypeError(f"unknown pattern spec {type(sp).__name__}")
            by_family.setdefault(name, []).append(sp)

        # Host metadata of every slot: (family, head, qgroup, kgroup) -> coverage and dst.
        slot_meta = []
        for name, sps in by_family.items():
            for sp in sps:
                h = torch.tensor(list(sp.heads), dtype=torch.int64)
                if h.numel() and (h.min() < 0 or h.max() >= num_heads):
                    raise ValueError(f"{name}: head ids must be in [0, {num_heads})")
                qg = _per_slot(sp.qgroup, 1, len(h), "qgroup")[0]
                kg = _per_slot(sp.kgroup, 1, len(h), "kgroup")[0]
                slot_meta.append((name, sp, h, qg, kg))

        groups = sorted({g for _, _, g in (row_groups or [(0, n, 0)])})
        kgroups_used = sorted({int(x) for *_, kg in slot_meta for x in kg.tolist() if x >= 0})
        heads_2d = sorted({int(hh) for *_, h, _, kg in slot_meta
                           for hh, k in zip(h.tolist(), kg.tolist()) if k >= 0})
        if check_coverage:
            _check_coverage(slot_meta, num_heads, groups, kgroups_used, heads_2d)
        if kgroups_used and (min(kgroups_used) < 0 or max(kgroups_used) >= len(groups)):
            raise ValueError("key groups must be the row-group ids 0..G-1")
        n_kg = len(groups) if heads_2d else 0
        pos_2d = {h: i for i, h in enumerate(heads_2d)}

        plan = cls(n=n, batch=batch, num_heads=num_heads, block_m=block_m, block_n=block_n,
                   table=table_cpu.to(device), heads_2d=heads_2d, n_key_groups=n_kg,
                   specs=by_family)
        if heads_2d:
            kgid = torch.empty(n, dtype=torch.int32)
            for s, e, g in row_groups:
                kgid[s:e] = g
            plan.key_groups = kgid[None, :].expand(batch, n).contiguous().to(device)

        r0 = table_cpu[:, 0].to(torch.int64).to(device)
        r1 = table_cpu[:, 1].to(torch.int64).to(device)
        for name, sps in by_family.items():
            parts = []
            for sp in sps:
                parts.append(_family_params(name, sp, batch, num_heads, n, pos_2d, device,
                                            row_groups))
            params = torch.cat(parts, dim=1)  # [B, S, NF] int64
            fl = FamilyLaunch(family=FAMILIES[name], params=params.to(torch.int32).contiguous())
            window = params[:, :, 6]
            lo = torch.clamp(r0[None, None, :] - window[:, :, None], min=0)  # [B, S, R]
            if name == "grid":
                fl.n_rowline_programs = _rowline_programs(params, block_m, max_row_lines)
            if name == "vertical_slash":
                vs = torch.cat([_sorted_unique(sp.verticals.to(device)) for sp in sps], dim=1)
                ss = torch.cat([_sorted_unique(sp.slashes.to(device)) for sp in sps], dim=1) \
                    if all(sp.slashes.shape[-1] for sp in sps) else None
                if ss is None:
                    ss = torch.full((batch, params.shape[1], 1), _PAD, dtype=torch.int64,
                                    device=device)
                if vs.shape[-1] == 0:
                    vs = torch.full((batch, params.shape[1], 1), _PAD, dtype=torch.int64,
                                    device=device)
                if vs.shape[:2] != params.shape[:2] or ss.shape[:2] != params.shape[:2]:
                    raise ValueError("vertical_slash: verticals/slashes must be [B, H', k]")
                S = params.shape[1]
                fl.vidx = vs.clamp(max=_PAD).to(torch.int32).contiguous()
                fl.vcnt = torch.searchsorted(vs, lo.contiguous()).to(torch.int32).contiguous()
                flag = torch.zeros(batch, S, n + 1, dtype=torch.int8, device=device)
                flag.scatter_(2, vs.clamp(max=n), 1)
                fl.vflag = flag[:, :, :n].contiguous()
                fl.sidx = ss.to(torch.int32).contiguous()
                k_lo = torch.searchsorted(ss, (r0[None, None, :] - lo).contiguous(), right=True)
                k_hi = torch.searchsorted(
                    ss, (r1[None, None, :] - 1).expand(batch, S, R).contiguous(), right=True)
                fl.srange = torch.stack([k_lo, torch.maximum(k_lo, k_hi)], -1) \
                    .to(torch.int32).contiguous()
            if name == "block":
                kb = torch.cat([_sorted_unique(sp.key_blocks.to(device)) for sp in sps], dim=1)
                if kb.shape[:3] != (batch, params.shape[1], R):
                    raise ValueError(f"block: key_blocks must be [B, H', R={R}, k], "
                                     f"got {tuple(kb.shape)}")
                lim = (lo + block_n - 1) // block_n
                fl.bidx = kb.clamp(max=_PAD).to(torch.int32).contiguous()
                fl.bcnt = torch.searchsorted(kb, lim.unsqueeze(-1).contiguous()) \
                    .squeeze(-1).to(torch.int32).contiguous()
            plan.launches[name] = fl
        return plan

    # ------------------------------------------------------------------ reporting
    @property
    def n_row_blocks(self) -> int:
        return self.table.shape[0]

    def masks(self) -> torch.Tensor:
        """Exact boolean mask ``[B, H, N, N]`` of every head (small N only), computed in plain
        torch from the pattern definitions: the oracle for the kernel tests."""
        from .reference import plan_masks
        return plan_masks(self)

    def density(self) -> dict:
        """Logical pairs and physical tiles as fractions of the causal triangle, counted by
        the kernel's own traversal (count mode), so it holds at any N."""
        from .launch import count_plan
        return count_plan(self)


def _family_params(name, sp, batch, num_heads, n, pos_2d, device, row_groups) -> torch.Tensor:
    """``[B, H', NF]`` int64 on ``device``. Everything but grid stride/phase comes from the
    host, and is checked there: the per-layer hot path never waits on the device."""
    H = len(sp.heads)
    p = torch.zeros(batch, H, NF, dtype=torch.int64)
    heads = torch.tensor(list(sp.heads), dtype=torch.int64)
    p[:, :, 0] = heads
    p[:, :, 1] = _per_slot(sp.qgroup, batch, H, "qgroup")
    kg = _per_slot(sp.kgroup, batch, H, "kgroup")
    p[:, :, 2] = kg
    p[:, :, 3] = torch.where(kg >= 0, kg + 1, torch.zeros_like(kg))
    p[:, :, 4] = torch.tensor([pos_2d.get(int(h), 0) for h in heads.tolist()],
                              dtype=torch.int64)[None, :]
    p[:, :, 6] = _per_slot(sp.window, batch, H, "window")
    if name in ("a_shape", "grid"):
        p[:, :, 5] = _per_slot(sp.sink, batch, H, "sink")
    if (p[:, :, 6] < 0).any() or (p[:, :, 5] < 0).any():
        raise ValueError(f"{name}: sink and window must be >= 0")
    if name != "grid":
        return p.to(device)
    lines = [sp.lines] * H if isinstance(sp.lines, str) else list(sp.lines)
    if len(lines) != H or any(x not in _LINES for x in lines):
        raise ValueError(f"grid lines must be one of {sorted(_LINES)} per head")
    p[:, :, 7] = _per_slot(_host(sp.start), batch, H, "start")
    p[:, :, 8] = _per_slot(_host(sp.end), batch, H, "end")
    p[:, :, 11] = torch.tensor([_LINES[x] for x in lines])[None, :]
    if ((p[:, :, 7] < 0) | (p[:, :, 8] > n) | (p[:, :, 8] < p[:, :, 7])).any():
        raise ValueError(f"grid span must lie in [0, {n}]")
    if row_groups is not None:
        _check_grid_spans(p, row_groups)
    stride = _per_slot(sp.stride, batch, H, "stride")
    phase = _per_slot(sp.phase, batch, H, "phase")
    if stride.device.type == "cpu":   # estimated on the device: trusted, never synced
        if (stride < 1).any():
            raise ValueError("grid stride must be >= 1")
        if ((phase < 0) | (phase >= stride)).any():
            raise ValueError("grid phase must be in [0, stride)")
    p = p.to(device)
    p[:, :, 9], p[:, :, 10] = stride.to(device), phase.to(device)
    return p


def _host(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _rowline_programs(params, block_m, hint) -> int:
    rows = (params[:, :, 11] & 2) != 0
    if hint is not None:
        return int(hint)
    if not bool(rows.any()):
        return 0
    span = (params[:, :, 8] - params[:, :, 7]).clamp(min=0)
    n_lines = (span + params[:, :, 9] - 1) // params[:, :, 9]
    n_lines = torch.where(rows, n_lines, torch.zeros_like(n_lines))
    return int(((n_lines.max() + block_m - 1) // block_m).item())


def _check_grid_spans(params, row_groups):
    # Row-line programs store rows by position: the grid span must lie inside the slot's
    # query group, or those rows would be written by two slots.
    p = params[0]
    for qg, start, end, lines in zip(p[:, 1].tolist(), p[:, 7].tolist(), p[:, 8].tolist(),
                                     p[:, 11].tolist()):
        if qg < 0 or end <= start or not lines & 2:
            continue
        if not any(s <= start and end <= e and g == qg for s, e, g in row_groups):
            raise ValueError(f"grid span [{start}, {end}) with row lines is not inside one "
                             f"span of query group {qg}")


def _check_coverage(slot_meta, num_heads, groups, kgroups_used, heads_2d):
    """Every (head, query group) is computed by exactly one slot (or, for 2D heads, one slot
    per key group): no row is written twice or left unwritten."""
    G = max(groups) + 1
    K = G + 1
    cover = torch.zeros(num_heads, G, K, dtype=torch.int64)
    for name, _, h, qg, kg in slot_meta:
        q_idx = torch.where(qg[:, None] < 0, torch.ones(len(h), G, dtype=torch.bool),
                            torch.arange(G)[None, :] == qg[:, None])
        k_idx = (kg + 1).clamp(min=0)
        cover.index_put_((h[:, None].expand(-1, G)[q_idx],
                          torch.arange(G)[None, :].expand(len(h), -1)[q_idx],
                          k_idx[:, None].expand(-1, G)[q_idx]),
                         torch.ones(int(q_idx.sum()), dtype=torch.int64), accumulate=True)
    cover = cover[:, groups]
    is2d = torch.zeros(num_heads, dtype=torch.bool)
    is2d[heads_2d] = True
    want = torch.zeros_like(cover)
    want[~is2d, :, 0] = 1
    if kgroups_used:
        want[is2d, :, 1:] = 0
        for g in range(len(groups)):
            want[is2d, :, g + 1] = 1
    bad = (cover != want).nonzero()
    if len(bad):
        h, gi, k = bad[0].tolist()
        what = "all keys" if k == 0 else f"key group {k - 1}"
        raise ValueError(f"head {h}, query group {groups[gi]}, {what}: covered by "
                         f"{int(cover[h, gi, k])} pattern slots, expected {int(want[h, gi, k])}")
