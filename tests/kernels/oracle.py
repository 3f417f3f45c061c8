"""The test oracle: the exact boolean mask of pattern specs, written from the documented
semantics (``mminfer/kernels/plan.py``'s docstring) and nothing else of the package.

It reads the specs only: no compiled plan, no row table, no mask function of
``mminfer.kernels.masks`` (which the runtime's CPU engine uses and which is tested against
this). It is plain and slow on purpose: one ``[N, N]`` mask per (request, slot), a Python loop
over slots and slash offsets; small N only.

Semantics, per slot (one listed head of a spec, with its own parameters and groups; a head
listed by several slots gets the union of their pairs):

* every family: causal ``kv <= q``; rows of the slot's query group, keys of its key group;
  the near range ``kv >= max(r0(q) - window, 0)``, ``r0(q)``/``r1(q)`` the bounds of q's
  row block (blocks of ``block_m`` rows inside each row-group span);
* a_shape: ``kv < sink``;
* grid: ``kv < sink``; column lines ``on(kv)``; row lines ``on(q)`` see every key, where
  ``on(x) = start <= x < end and (x - start) % stride == phase``;
* vertical_slash: ``kv`` a vertical; or an offset ``o`` with ``r0(q) - o <= kv < r1(q) - o``;
* block: key block ``kv // block_n`` listed for q's row block;
* Fallback: per (request, head) the primary's pairs where ``use`` is false, else those of
  the alternative that lists the head;
* queries at an offset ``q_start``: the rows are ``[q_start, N)``, every position absolute;
  the block holding ``q_start`` is cut to start there.
"""

from __future__ import annotations

import torch

from mminfer.kernels import AShape, Block, Fallback, Grid, VerticalSlash


def _value(x, b: int, s: int) -> int:
    """Slot s's value for request b of an int / per-slot sequence / [B, S] tensor."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dim() == 0:
            return int(t)
        return int(t[s]) if t.dim() == 1 else int(t[b, s])
    if isinstance(x, int):
        return x
    return int(list(x)[s])


def _rows(n: int, block_m: int, row_groups, q_start: int = 0):
    """Per position: its row block's start, end and index, and its group (keys too);
    positions before ``q_start`` are no rows (-1)."""
    spans = row_groups or [(0, n, 0)]
    r0 = torch.full((n,), -1, dtype=torch.long)
    r1 = torch.full((n,), -1, dtype=torch.long)
    rb = torch.full((n,), -1, dtype=torch.long)
    grp = torch.empty(n, dtype=torch.long)
    i = 0
    for s, e, g in spans:
        grp[s:e] = g
        for a in range(s, e, block_m):
            z = min(a + block_m, e)
            if z <= q_start:
                continue
            a = max(a, q_start)
            r0[a:z], r1[a:z], rb[a:z] = a, z, i
            i += 1
    return r0, r1, rb, grp


def _slots(specs, batch: int):
    """``(spec, slot, head, on [B] bool)`` for every slot, a Fallback's sides included."""
    out = []
    for sp in specs:
        if isinstance(sp, Fallback):
            use = sp.use.detach().cpu().bool()
            where = {h: i for i, h in enumerate(sp.primary.heads)}
            out += [(sp.primary, s, h, ~use[:, s]) for s, h in enumerate(sp.primary.heads)]
            for alt in sp.alternatives:
                out += [(alt, s, h, use[:, where[h]]) for s, h in enumerate(alt.heads)]
        else:
            out += [(sp, s, h, torch.ones(batch, dtype=torch.bool))
                    for s, h in enumerate(sp.heads)]
    return out


def spec_masks(specs, n: int, num_heads: int, *, block_m: int, block_n: int = 64,
               row_groups=None, batch: int = 1, q_start: int = 0) -> torch.Tensor:
    """The exact mask ``[B, H, N - q_start, N]`` (bool, CPU) of the specs: query rows
    ``[q_start, N)`` by keys ``[0, N)``."""
    if n > 8192:
        raise ValueError(f"the oracle is for small N, not {n}")
    r0, r1, rb, grp = _rows(n, block_m, row_groups, q_start)
    q = torch.arange(n)[:, None]
    kv = torch.arange(n)[None, :]
    causal = kv <= q
    out = torch.zeros(batch, num_heads, n, n, dtype=torch.bool)
    for sp, s, h, on in _slots(specs, batch):
        for b in range(batch):
            if not bool(on[b]):
                continue
            qg, kg = _value(sp.qgroup, b, s), _value(sp.kgroup, b, s)
            rows = (grp[:, None] == qg) if qg >= 0 else torch.ones(n, 1, dtype=torch.bool)
            keys = (grp[None, :] == kg) if kg >= 0 else torch.ones(1, n, dtype=torch.bool)
            ok = (kv >= (r0[:, None] - _value(sp.window, b, s)).clamp(min=0))
            if isinstance(sp, (AShape, Grid)):
                ok = ok | (kv < _value(sp.sink, b, s))
            if isinstance(sp, Grid):
                start, end = _value(sp.start, b, s), _value(sp.end, b, s)
                stride, phase = _value(sp.stride, b, s), _value(sp.phase, b, s)
                lines = sp.lines if isinstance(sp.lines, str) else list(sp.lines)[s]

                def on_line(x):
                    return (x >= start) & (x < end) & ((x - start) % stride == phase)
                if lines in ("cols", "both"):
                    ok = ok | on_line(kv)
                if lines in ("rows", "both"):
                    ok = ok | on_line(q)
            if isinstance(sp, VerticalSlash):
                for j in sp.verticals[b, s].tolist():
                    if 0 <= j < n:
                        ok = ok | (kv == j)
                for o in set(sp.slashes[b, s].tolist()):
                    if o >= 0:
                        ok = ok | ((kv >= r0[:, None] - o) & (kv < r1[:, None] - o))
            if isinstance(sp, Block):
                chosen = torch.zeros(int(rb.max()) + 1, (n + block_n - 1) // block_n + 1,
                                     dtype=torch.bool)
                kb = sp.key_blocks[b, s].detach().cpu().long()        # [R, k]
                for r, row in enumerate(kb.tolist()):
                    for c in row:
                        if 0 <= c < chosen.shape[1]:
                            chosen[r, c] = True
                ok = ok | chosen[rb[:, None], kv // block_n]
            out[b, h] |= ok & rows & keys & causal
    return out[:, :, q_start:]


def plan_masks(plan) -> torch.Tensor:
    """The oracle of a plan's own specs (the plan keeps them as given)."""
    return spec_masks(plan.specs, plan.n, plan.num_heads, block_m=plan.block_m,
                      block_n=plan.block_n, row_groups=plan.row_groups, batch=plan.batch,
                      q_start=plan.q_start)


# ---------------------------------------------------------------------- the tile replay
def _tail(a: int, b: int, bn: int) -> int:
    return len(range(a, b, bn))


def _cdiv(a: int, b: int) -> int:
    return -((-a) // b)


def replay_tiles(plan):
    """The tiles ``plan.density()`` counts, replayed loop by loop in plain Python from the
    arrays the kernel reads (each far range in ``ceil(len / tile)`` tiles of
    ``density.COUNT_TILE`` keys, the row lines' own programs). Returns (tiles per head
    ``[H]`` int64, tiles per family, tiles of a dense pass over the same row blocks)."""
    from mminfer.kernels import layout as Y
    from mminfer.kernels.density import COUNT_TILE
    from mminfer.kernels.runtime import compiled_gpu

    dev = plan.table.device
    BM, BK = plan.block_m, plan.block_n
    BN = min(COUNT_TILE["gpu" if compiled_gpu(dev.type == "cuda") else "cpu"], BM, BK)
    table = plan.table.cpu().tolist()
    per_head = torch.zeros(plan.num_heads, dtype=torch.int64)
    by_family = {}

    def near(lo, r0, r1):
        nf = (r0 - lo) // BN
        return nf + _tail(lo + nf * BN, r1, BN)

    for name, fl in plan.launches.items():
        total = 0
        params = fl.params.cpu().tolist()
        cpu = {k: None if getattr(fl, k) is None else getattr(fl, k).cpu().tolist()
               for k in ("vcnt", "sidx", "srange", "bcnt")}
        for b, row in enumerate(params):
            for s, p in enumerate(row):
                if not p[Y.F_ACTIVE]:
                    continue
                t = 0
                sink, window = p[Y.F_SINK], p[Y.F_WINDOW]
                start, end, stride, phase = (p[Y.F_START], p[Y.F_END], p[Y.F_STRIDE],
                                             p[Y.F_PHASE])
                for r, (r0, r1, rg) in enumerate(table):
                    if p[Y.F_QGROUP] >= 0 and rg != p[Y.F_QGROUP]:
                        continue
                    lo = max(r0 - window, 0)
                    t += near(lo, r0, r1)
                    if name in ("a_shape", "grid"):
                        s_end = min(sink, lo)
                        nf = max(s_end, 0) // BN
                        t += nf + _tail(nf * BN, s_end, BN)
                    if name == "grid" and p[Y.F_LINES] & Y.LINES_COLS:
                        c_lo, c_hi = max(sink, start), min(end, lo)
                        skip = max(c_lo - start - phase, 0)
                        j0 = start + phase + _cdiv(skip, stride) * stride
                        t += _cdiv(max(_cdiv(c_hi - j0, stride), 0), BN)
                    if name == "vertical_slash":
                        t += _cdiv(cpu["vcnt"][b][s][r], BN)
                        k_lo, k_hi = cpu["srange"][b][s][r]
                        o_prev = -(1 << 30)
                        for kk in range(k_lo, k_hi):
                            o = cpu["sidx"][b][s][kk]
                            t += _tail(max(r0 - o, 0), min(r1 - o, r0 - o_prev, lo), BN)
                            o_prev = o
                    if name == "block":
                        t += cpu["bcnt"][b][s][r] * (BK // BN)
                if name == "grid" and p[Y.F_LINES] & Y.LINES_ROWS:
                    first = start + phase
                    while first < plan.q_start:
                        first += stride
                    for u in range(fl.n_rowline_programs):
                        r0 = first + u * BM * stride
                        if r0 >= end:
                            continue
                        rows = [x for x in (first + (u * BM + i) * stride for i in range(BM))
                                if x < end]
                        t += near(0, r0 + 1, min(max(rows) + 1, plan.n))
                per_head[p[Y.F_HEAD]] += t
                total += t
        by_family[name] = total
    dense = sum(near(0, r0, r1) for r0, r1, _ in table)
    return per_head, by_family, dense
