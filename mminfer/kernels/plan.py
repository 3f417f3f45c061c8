"""What one layer's sparse attention computes, compiled for the kernel: the plan.

``SparsePlan.build`` turns pattern specs (``specs.py``) into the compact device arrays the
kernel reads (the slot row and the row table are defined in ``layout.py``):

* the row-block table ``[R, 3]`` (start, end, group): blocks of ``block_m`` rows that never
  straddle a modality span when rows are grouped (Q-boundary / 2D-boundary), so every
  block holds rows of exactly one modality while rows stay at their original positions;
* per family one int32 parameter row per *slot* ``[B, S, NF]``;
* index arrays only for vertical-slash (sorted verticals, per-block counts, sorted slash
  offsets, per-block offset ranges) and block (per row block sorted key blocks).

Pattern semantics, exactly (``r0(i)``, ``r1(i)`` are the bounds of row i's block, all pairs
also causal ``j <= i`` on original positions); ``masks.py`` writes them as mask functions:

* near range, every family: ``j >= max(r0(i) - window, 0)``
* a_shape: ``j < sink``
* grid over span [start, end) with stride s, phase p: ``j < sink``; columns ``j`` in span
  with ``(j - start) % s == p``; rows ``i`` in span with ``(i - start) % s == p`` see every key
* vertical_slash: ``j`` a vertical; or an offset ``o`` with ``r0(i) - o <= j < r1(i) - o``
  (slash tiles are row-block granular, as in MInference)
* block: key block ``j // block_n`` listed for row i's block

A slot restricted to query group g covers only rows of that group; a slot restricted to key
group g (2D-boundary) sees only keys of that group, and its partial results are merged with
the head's other key groups through their log-sum-exp. A head may be listed by several slots
(of one spec or several): it gets the union of their pairs (a 2D-boundary head has one slot
per (query group, key group)). A ``Fallback`` plans both of its
sides; the slot row's ``active`` field (set on the device) says which one runs.

Queries at an offset (``q_start``): the keys are the whole prompt ``[0, n)``, the queries only
its rows ``[q_start, n)`` (a piece appended to a cached prompt, a chunk of a prefill). Every
position above is absolute (row ``i`` of the query tensor is position ``q_start + i``), so a
spec means the same pairs whether its rows are computed in one pass or in pieces; the row
table holds the query rows' blocks only (``layout.row_table``), and grid row lines start at
the first line at or after ``q_start``.

The plan is data: ``mask_rows()`` (from the specs) and ``density()`` (from the compiled
arrays) are functions of it, and neither launches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from . import density as _density
from . import masks as _masks
from .layout import (F_ACTIVE, F_DST, F_DSTHEAD, F_END, F_HEAD, F_KGROUP, F_LINES, F_PHASE,
                     F_QGROUP, F_SINK, F_START, F_STRIDE, F_WINDOW, FAMILIES, LINES,
                     LINES_ROWS, NF, family_of, key_groups, row_table)
from .runtime import to_device
from .specs import Block, Fallback, IntLike, VerticalSlash

_PAD = 1 << 30


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
    params: torch.Tensor                # [B, S, NF] int32 (layout.F_*)
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

    @property
    def active(self) -> torch.Tensor:
        """``[B, S]`` bool: which slots run (a Fallback's unused side does not)."""
        return self.params[:, :, F_ACTIVE] != 0


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
    specs: list = field(default_factory=list)      # as given (Fallbacks kept), index lists padded
    row_groups: list | None = None
    q_start: int = 0                        # the first query row (absolute); keys from 0

    @property
    def n_q(self) -> int:
        """Query rows: ``n - q_start``."""
        return self.n - self.q_start

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, n: int, num_heads: int, specs: Sequence, *, block_m: int = 128,
              block_n: int = 64, row_groups=None, batch: int = 1, device="cpu",
              max_row_lines: int | None = None, q_start: int = 0) -> "SparsePlan":
        """``specs``: pattern specs and ``Fallback``s; together they compute every (head,
        query group) exactly once (2D-boundary heads: once per key group), checked here.
        ``max_row_lines``: row-line programs per grid slot, when the strides live on the
        device (so that counting them would wait for it). ``q_start``: the queries are rows
        ``[q_start, n)`` (see the module doc); ``n`` counts every key."""
        device = torch.device(device)
        table_cpu = row_table(n, block_m, row_groups, q_start)
        R = table_cpu.shape[0]
        specs = _pad_index_lists(list(specs))
        # (family, spec, active [B, H'] or None, counts for coverage)
        slots = []
        for sp in specs:
            if isinstance(sp, Fallback):
                slots.extend(_fallback_slots(sp, batch, num_heads))
            else:
                slots.append((family_of(sp), sp, None, True))
        slot_meta = []
        for name, sp, _, counted in slots:
            h = torch.tensor(list(sp.heads), dtype=torch.int64)
            if h.numel() and (h.min() < 0 or h.max() >= num_heads):
                raise ValueError(f"{name}: head ids must be in [0, {num_heads})")
            qg = _per_slot(sp.qgroup, 1, len(h), "qgroup")[0]
            kg = _per_slot(sp.kgroup, 1, len(h), "kgroup")[0]
            slot_meta.append((name, sp, h, qg, kg, counted))

        groups = sorted({g for _, _, g in (row_groups or [(0, n, 0)])})
        kgroups_used = sorted({int(x) for *_, kg, _ in slot_meta for x in kg.tolist() if x >= 0})
        heads_2d = sorted({int(hh) for *_, h, _, kg, _ in slot_meta
                           for hh, k in zip(h.tolist(), kg.tolist()) if k >= 0})
        _check_coverage([m for m in slot_meta if m[-1]], num_heads, groups, kgroups_used,
                        heads_2d)
        if kgroups_used and (min(kgroups_used) < 0 or max(kgroups_used) >= len(groups)):
            raise ValueError("key groups must be the row-group ids 0..G-1")
        n_kg = len(groups) if heads_2d else 0
        pos_2d = {h: i for i, h in enumerate(heads_2d)}

        plan = cls(n=n, batch=batch, num_heads=num_heads, block_m=block_m, block_n=block_n,
                   table=to_device(table_cpu, device), heads_2d=heads_2d, n_key_groups=n_kg,
                   specs=specs, row_groups=[tuple(x) for x in row_groups] if row_groups
                   else None, q_start=int(q_start))
        if heads_2d:
            kgid, _ = key_groups(n, row_groups or [(0, n, 0)])
            plan.key_groups = to_device(kgid[None, :].expand(batch, n).contiguous(), device)

        by_family: dict[str, list] = {}
        for name, sp, active, _ in slots:
            by_family.setdefault(name, []).append((sp, active))
        r0 = to_device(table_cpu[:, 0].to(torch.int64), device)
        r1 = to_device(table_cpu[:, 1].to(torch.int64), device)
        for name, members in by_family.items():
            sps = [sp for sp, _ in members]
            params = torch.cat([_family_params(name, sp, active, batch, n, pos_2d, device,
                                               row_groups) for sp, active in members], dim=1)
            fl = FamilyLaunch(family=FAMILIES[name], params=params.to(torch.int32).contiguous())
            lo = torch.clamp(r0[None, None, :] - params[:, :, F_WINDOW, None], min=0)  # [B,S,R]
            if name == "grid":
                fl.n_rowline_programs = _rowline_programs(params, block_m, max_row_lines,
                                                          q_start)
            elif name == "vertical_slash":
                _vertical_slash_arrays(fl, sps, lo, r0, r1, batch, n, device)
            elif name == "block":
                _block_arrays(fl, sps, lo, batch, R, block_n, device)
            plan.launches[name] = fl
        return plan

    # ------------------------------------------------------------------ reporting
    @property
    def n_row_blocks(self) -> int:
        return self.table.shape[0]

    def masks(self) -> torch.Tensor:
        """Exact boolean mask ``[B, H, N - q_start, N]`` of every head (query rows by keys;
        small N only): :meth:`mask_rows`
        in one chunk. Only tests read it (the kernel tests' oracle is
        ``tests/kernels/oracle.py``, written apart from this)."""
        if self.n > _masks.MAX_N:
            raise ValueError(f"masks are for small N (got {self.n}); use density() at long N")
        return next(self.mask_rows(self.n_q))[1]

    def mask_rows(self, rows: int = 1024):
        """The exact mask of :meth:`masks`, ``rows`` query rows at a time at any N: yields
        ``(r0, mask [B, H, rows, N])``, ``r0`` absolute (``reference.plan_attention`` runs a
        plan so)."""
        return _masks.spec_mask_rows(self.specs, self.n, self.num_heads, block_m=self.block_m,
                                     block_n=self.block_n, row_groups=self.row_groups,
                                     batch=self.batch, rows=rows, q_start=self.q_start)

    def density(self) -> dict:
        """Logical pairs and visited tiles, counted from the compiled arrays along the
        kernel's own traversal (``density.py``): no launch, at any N."""
        return _density.plan_density(self)


def _fallback_slots(fb: Fallback, batch: int, num_heads: int):
    """The slots of a Fallback: its primary, active where ``use`` is false, and its
    alternatives, each head active where ``use`` is true; the alternatives must hold the
    primary's heads exactly once with the same groups (so coverage counts the primary only)."""
    prim = fb.primary
    if isinstance(prim, Fallback) or any(isinstance(a, Fallback) for a in fb.alternatives):
        raise TypeError("a Fallback's primary and alternatives are plain pattern specs")
    heads = list(prim.heads)
    where = {h: i for i, h in enumerate(heads)}
    if len(where) != len(heads):
        raise ValueError("Fallback: the primary lists a head twice")
    use = fb.use
    if not isinstance(use, torch.Tensor) or tuple(use.shape) != (batch, len(heads)):
        raise ValueError(f"Fallback.use must be a [{batch}, {len(heads)}] bool tensor, got "
                         f"{tuple(use.shape) if isinstance(use, torch.Tensor) else type(use)}")
    use = use.to(torch.bool)
    pq = _per_slot(prim.qgroup, 1, len(heads), "qgroup")[0].tolist()
    pk = _per_slot(prim.kgroup, 1, len(heads), "kgroup")[0].tolist()
    out = [(family_of(prim), prim, ~use, True)]
    seen = []
    for alt in fb.alternatives:
        ah = list(alt.heads)
        aq = _per_slot(alt.qgroup, 1, len(ah), "qgroup")[0].tolist()
        ak = _per_slot(alt.kgroup, 1, len(ah), "kgroup")[0].tolist()
        for h, q, k in zip(ah, aq, ak):
            if h not in where or (q, k) != (pq[where[h]], pk[where[h]]):
                raise ValueError(f"Fallback: alternative head {h} (query group {q}, key group "
                                 f"{k}) is not one of the primary's slots")
        idx = torch.tensor([where[h] for h in ah], dtype=torch.long)
        out.append((family_of(alt), alt, use[:, to_device(idx, use.device)], False))
        seen.extend(ah)
    if sorted(seen) != sorted(heads):
        raise ValueError(f"Fallback: the alternatives hold heads {sorted(seen)}, the primary "
                         f"{sorted(heads)}: each must appear exactly once")
    return out


def _pad_index_lists(specs):
    """Specs of one family are concatenated along the slot axis, so their index lists need
    one width: pad with -1 (padding) to the widest; any other shape mismatch is an error
    that names the spec."""
    def widen(t, width):
        if t.shape[-1] == width:
            return t
        pad = torch.full(t.shape[:-1] + (width - t.shape[-1],), -1, dtype=t.dtype,
                         device=t.device)
        return torch.cat([t, pad], dim=-1)

    flat = []
    for sp in specs:
        flat.extend([sp.primary, *sp.alternatives] if isinstance(sp, Fallback) else [sp])
    vs = [sp for sp in flat if isinstance(sp, VerticalSlash)]
    bl = [sp for sp in flat if isinstance(sp, Block)]
    for sp in vs:
        for name in ("verticals", "slashes"):
            t = getattr(sp, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[1] != len(sp.heads):
                raise ValueError(f"vertical_slash heads {list(sp.heads)}: {name} must be "
                                 f"[B, {len(sp.heads)}, k], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    for sp in bl:
        t = sp.key_blocks
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != len(sp.heads):
            raise ValueError(f"block heads {list(sp.heads)}: key_blocks must be "
                             f"[B, {len(sp.heads)}, R, k], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    if len(vs) < 2 and len(bl) < 2:
        return specs
    wv = max((sp.verticals.shape[-1] for sp in vs), default=0)
    ws = max((sp.slashes.shape[-1] for sp in vs), default=0)
    wb = max((sp.key_blocks.shape[-1] for sp in bl), default=0)

    def pad(sp):
        if isinstance(sp, VerticalSlash):
            return replace(sp, verticals=widen(sp.verticals, wv), slashes=widen(sp.slashes, ws))
        if isinstance(sp, Block):
            return replace(sp, key_blocks=widen(sp.key_blocks, wb))
        return sp

    return [Fallback(pad(sp.primary), [pad(a) for a in sp.alternatives], sp.use)
            if isinstance(sp, Fallback) else pad(sp) for sp in specs]


def _family_params(name, sp, active, batch, n, pos_2d, device, row_groups) -> torch.Tensor:
    """``[B, H', NF]`` int64 on ``device``. Everything but grid stride/phase and the active
    mask comes from the host, and is checked there: the per-layer hot path never waits on
    the device."""
    H = len(sp.heads)
    p = torch.zeros(batch, H, NF, dtype=torch.int64)
    heads = torch.tensor(list(sp.heads), dtype=torch.int64)
    p[:, :, F_HEAD] = heads
    p[:, :, F_QGROUP] = _per_slot(sp.qgroup, batch, H, "qgroup")
    kg = _per_slot(sp.kgroup, batch, H, "kgroup")
    p[:, :, F_KGROUP] = kg
    p[:, :, F_DST] = torch.where(kg >= 0, kg + 1, torch.zeros_like(kg))
    p[:, :, F_DSTHEAD] = torch.tensor([pos_2d.get(int(h), 0) for h in heads.tolist()],
                                      dtype=torch.int64)[None, :]
    p[:, :, F_WINDOW] = _per_slot(sp.window, batch, H, "window")
    p[:, :, F_ACTIVE] = 1
    if name in ("a_shape", "grid"):
        p[:, :, F_SINK] = _per_slot(sp.sink, batch, H, "sink")
    if (p[:, :, F_WINDOW] < 0).any() or (p[:, :, F_SINK] < 0).any():
        raise ValueError(f"{name}: sink and window must be >= 0")
    if name == "grid":
        lines = [sp.lines] * H if isinstance(sp.lines, str) else list(sp.lines)
        if len(lines) != H or any(x not in LINES for x in lines):
            raise ValueError(f"grid lines must be one of {sorted(LINES)} per head")
        p[:, :, F_START] = _per_slot(_host(sp.start), batch, H, "start")
        p[:, :, F_END] = _per_slot(_host(sp.end), batch, H, "end")
        p[:, :, F_LINES] = torch.tensor([LINES[x] for x in lines])[None, :]
        if ((p[:, :, F_START] < 0) | (p[:, :, F_END] > n) |
                (p[:, :, F_END] < p[:, :, F_START])).any():
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
    p = to_device(p, device)
    if name == "grid":
        p[:, :, F_STRIDE], p[:, :, F_PHASE] = stride.to(device), phase.to(device)
    if active is not None:
        p[:, :, F_ACTIVE] = active.to(device=device, dtype=torch.int64)
    return p


def _vertical_slash_arrays(fl, sps, lo, r0, r1, batch, n, device):
    S, R = fl.params.shape[1], lo.shape[-1]
    vs = torch.cat([_sorted_unique(sp.verticals.to(device)) for sp in sps], dim=1)
    ss = torch.cat([_sorted_unique(sp.slashes.to(device)) for sp in sps], dim=1)
    if vs.shape[:2] != (batch, S) or ss.shape[:2] != (batch, S):
        raise ValueError(f"vertical_slash: verticals/slashes must be [B={batch}, H', k], "
                         f"got {tuple(vs.shape)} / {tuple(ss.shape)} for {S} slots")
    if vs.shape[-1] == 0:
        vs = torch.full((batch, S, 1), _PAD, dtype=torch.int64, device=device)
    if ss.shape[-1] == 0:
        ss = torch.full((batch, S, 1), _PAD, dtype=torch.int64, device=device)
    fl.vidx = vs.clamp(max=_PAD).to(torch.int32).contiguous()
    fl.vcnt = torch.searchsorted(vs, lo.contiguous()).to(torch.int32).contiguous()
    flag = torch.zeros(batch, S, n + 1, dtype=torch.int8, device=device)
    flag.scatter_(2, vs.clamp(max=n), 1)
    fl.vflag = flag[:, :, :n].contiguous()
    fl.sidx = ss.to(torch.int32).contiguous()
    k_lo = torch.searchsorted(ss, (r0[None, None, :] - lo).contiguous(), right=True)
    k_hi = torch.searchsorted(
        ss, (r1[None, None, :] - 1).expand(batch, S, R).contiguous(), right=True)
    fl.srange = torch.stack([k_lo, torch.maximum(k_lo, k_hi)], -1).to(torch.int32).contiguous()


def _block_arrays(fl, sps, lo, batch, R, block_n, device):
    S = fl.params.shape[1]
    kb = torch.cat([_sorted_unique(sp.key_blocks.to(device)) for sp in sps], dim=1)
    if kb.shape[:3] != (batch, S, R):
        raise ValueError(f"block: key_blocks must be [B={batch}, H', R={R}, k], "
                         f"got {tuple(kb.shape)} for {S} slots")
    lim = (lo + block_n - 1) // block_n
    fl.bidx = kb.clamp(max=_PAD).to(torch.int32).contiguous()
    fl.bcnt = torch.searchsorted(kb, lim.unsqueeze(-1).contiguous()) \
        .squeeze(-1).to(torch.int32).contiguous()


def _host(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _rowline_programs(params, block_m, hint, q_start=0) -> int:
    rows = (params[:, :, F_LINES] & LINES_ROWS) != 0
    if hint is not None:
        return int(hint)
    if not bool(rows.any()):
        return 0
    span = (params[:, :, F_END] - torch.clamp(params[:, :, F_START], min=q_start)).clamp(min=0)
    n_lines = (span + params[:, :, F_STRIDE] - 1) // params[:, :, F_STRIDE]
    n_lines = torch.where(rows, n_lines, torch.zeros_like(n_lines))
    return int(((n_lines.max() + block_m - 1) // block_m).item())


def _check_grid_spans(params, row_groups):
    # Row-line programs store rows by position: the grid span must lie inside the slot's
    # query group, or those rows would be written by two slots.
    p = params[0]
    for qg, start, end, lines in zip(p[:, F_QGROUP].tolist(), p[:, F_START].tolist(),
                                     p[:, F_END].tolist(), p[:, F_LINES].tolist()):
        if qg < 0 or end <= start or not lines & LINES_ROWS:
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
    for name, _, h, qg, kg, _ in slot_meta:
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
