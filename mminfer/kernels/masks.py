"""The pattern families as mask functions, written from the specs: the exact mask of a plan a
chunk of rows at a time, which ``reference.plan_attention`` (the CPU engine: calibration and
``engine="reference"``) runs.

One function per family, attention-gym style: ``mask(P, b, s, q_idx, kv_idx) -> bool``,
elementwise over broadcastable index tensors, ``s`` a *slot* of the spec (the position of a
head in ``spec.heads``: a head may be listed several times, with different groups, and its
mask is the union of its slots'). The same functions are FlexAttention ``mask_mod``s in
``benchmarks/kernels.py``. ``P`` holds the token layout (row block and group of every query,
group of every key) and one spec's parameters per ``[b, s]``, built by ``spec_params``.

Nothing here reads a compiled plan: the row blocks come from a closed form over the row
groups, the parameters straight from the specs. The kernel tests' oracle
(``tests/kernels/oracle.py``) is written separately; these functions are tested against it.
The semantics (``plan.py``'s docstring):

* every family: causal ``kv <= q``; rows of the slot's query group, keys of its key group;
  the near range ``kv >= max(r0(q) - window, 0)``;
* a_shape: ``kv < sink``;
* grid: ``kv < sink``; column lines ``on(kv)``; row lines ``on(q)`` see every key, where
  ``on(x) = start <= x < end and (x - start) % stride == phase``;
* vertical_slash: ``kv`` a vertical; or an offset ``o`` with ``r0(q) - o <= kv < r1(q) - o``;
* block: key block ``kv // block_n`` listed for q's row block.
"""

from __future__ import annotations

import torch

from .layout import family_of
from .specs import Fallback

MAX_N = 8192


# ---------------------------------------------------------------------- layout
def layout_tensors(n: int, block_m: int, block_n: int = 64, row_groups=None,
                   device="cpu", q_start: int = 0) -> dict:
    """Per position: its row block's bounds ``row_start``/``row_end``, ``row_block`` (the
    index in row-table order), ``row_group``; per key: ``key_group``. With ``q_start`` the
    rows are ``[q_start, n)`` and the block holding ``q_start`` starts there
    (``layout.row_table``); the row fields of earlier positions mean nothing."""
    spans = [tuple(s) for s in row_groups] if row_groups else [(0, n, 0)]
    pos_ = 0
    for s, e, _ in spans:
        if s != pos_ or e <= s:
            raise ValueError(f"row groups must tile [0, {n}) in order; got span ({s}, {e})")
        pos_ = e
    if pos_ != n:
        raise ValueError(f"row groups end at {pos_}, expected {n}")
    starts = torch.tensor([s for s, _, _ in spans])
    ends = torch.tensor([e for _, e, _ in spans])
    groups = torch.tensor([g for _, _, g in spans])
    pos = torch.arange(n)
    span = torch.searchsorted(starts, pos, right=True) - 1
    s, e = starts[span], ends[span]
    r0 = s + (pos - s) // block_m * block_m
    per_span = (ends - starts + block_m - 1) // block_m
    first = torch.cumsum(per_span, 0) - per_span
    block = first[span] + (pos - s) // block_m
    dropped = int(block[q_start]) if n else 0      # whole blocks before the first query row
    out = {"n": n, "block_n": block_n, "n_row_blocks": int(per_span.sum()) - dropped,
           "row_start": torch.clamp(r0, min=q_start), "row_end": torch.minimum(r0 + block_m, e),
           "row_block": block - dropped, "row_group": groups[span],
           "key_group": groups[span]}
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _per_slot(x, n_slots, batch, name):
    """A spec's int / per-slot sequence / ``[B, S]`` value as ``[B, S]`` int64 (host)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu", torch.int64)
        t = t.expand(batch, n_slots) if t.dim() < 2 else t
    elif isinstance(x, int):
        t = torch.full((batch, n_slots), x, dtype=torch.int64)
    else:
        t = torch.tensor(list(x), dtype=torch.int64)[None, :].expand(batch, n_slots)
    if tuple(t.shape) != (batch, n_slots):
        raise ValueError(f"{name}: expected an int, {n_slots} values or [{batch}, {n_slots}]")
    return t


def spec_params(spec, L: dict, batch: int = 1, active=None) -> dict:
    """``P`` for one spec: the layout ``L`` plus the spec's parameters per slot, ``[B, S]``
    (and ``[B, S, ...]`` index lookups); slots switched off by ``active [B, S]`` (a
    Fallback's unused side) have ``mine`` false."""
    n, S = L["n"], len(spec.heads)
    mine = torch.ones(batch, S, dtype=torch.bool) if active is None else \
        active.detach().to("cpu", torch.bool).expand(batch, S)
    P = dict(L)
    P.update(mine=mine, qgroup=_per_slot(spec.qgroup, S, batch, "qgroup"),
             kgroup=_per_slot(spec.kgroup, S, batch, "kgroup"),
             window=_per_slot(spec.window, S, batch, "window"))
    fam = family_of(spec)
    if fam in ("a_shape", "grid"):
        P["sink"] = _per_slot(spec.sink, S, batch, "sink")
    if fam == "grid":
        for name in ("start", "end", "stride", "phase"):
            P[name] = _per_slot(getattr(spec, name), S, batch, name)
        lines = [spec.lines] * S if isinstance(spec.lines, str) else list(spec.lines)
        for name, kinds in (("cols", ("cols", "both")), ("rows", ("rows", "both"))):
            P[name] = torch.tensor([x in kinds for x in lines])[None, :].expand(batch, S)
    elif fam == "vertical_slash":
        v = spec.verticals.detach().to("cpu", torch.int64)
        v = torch.where((v < 0) | (v >= n), torch.full_like(v, n), v)
        P["vert"] = torch.zeros(batch, S, n + 1, dtype=torch.bool).scatter_(2, v, True)[..., :n]
        # scnt[b, s, x] = number of distinct offsets o < x (offsets beyond n can reach no key)
        o = spec.slashes.detach().to("cpu", torch.int64)
        o = torch.where((o < 0) | (o > n), torch.full_like(o, n + 1), o)
        has = torch.zeros(batch, S, n + 2, dtype=torch.bool).scatter_(2, o, True)
        scnt = torch.zeros(batch, S, n + 2, dtype=torch.int64)
        scnt[..., 1:] = has[..., :n + 1].to(torch.int64).cumsum(-1)
        P["scnt"] = scnt
    elif fam == "block":
        R, bn = L["n_row_blocks"], L["block_n"]
        nkb = (n + bn - 1) // bn
        kb = spec.key_blocks.detach().to("cpu", torch.int64)
        if tuple(kb.shape[:3]) != (batch, S, R):
            raise ValueError(f"block: key_blocks must be [B={batch}, H'={S}, R={R}, k], "
                             f"got {tuple(kb.shape)}")
        kb = torch.where((kb < 0) | (kb >= nkb), torch.full_like(kb, nkb), kb)
        P["chosen"] = torch.zeros(batch, S, R, nkb + 1, dtype=torch.bool).scatter_(3, kb, True)
    return P


# ---------------------------------------------------------------------- mask functions
def _common(P, b, h, q, kv):
    """(causal pair of this slot's rows and keys, in the near range); ``h`` is the slot."""
    qg, kg = P["qgroup"][b, h], P["kgroup"][b, h]
    rows = P["mine"][b, h] & ((qg < 0) | (P["row_group"][q] == qg))
    keys = (kg < 0) | (P["key_group"][kv] == kg)
    near = kv >= torch.clamp(P["row_start"][q] - P["window"][b, h], min=0)
    return (kv <= q) & rows & keys, near


def a_shape(P, b, h, q, kv):
    ok, near = _common(P, b, h, q, kv)
    return ok & (near | (kv < P["sink"][b, h]))


def _on_grid(P, b, h, x):
    start, end = P["start"][b, h], P["end"][b, h]
    stride, phase = P["stride"][b, h], P["phase"][b, h]
    return (x >= start) & (x < end) & (torch.remainder(x - start, stride) == phase)


def grid(P, b, h, q, kv):
    ok, near = _common(P, b, h, q, kv)
    return ok & (near | (kv < P["sink"][b, h]) | (P["cols"][b, h] & _on_grid(P, b, h, kv))
                 | (P["rows"][b, h] & _on_grid(P, b, h, q)))


def grid_row_lines(P, b, h, q, kv):
    """The pairs a grid's row lines alone give (a query on a line sees every key)."""
    ok, _ = _common(P, b, h, q, kv)
    return ok & P["rows"][b, h] & _on_grid(P, b, h, q)


def vertical_slash(P, b, h, q, kv):
    ok, near = _common(P, b, h, q, kv)
    n = P["n"]
    # offsets o with r0(q) - kv <= o < r1(q) - kv exist iff scnt differs at the two ends
    lo_o = torch.clamp(P["row_start"][q] - kv, min=0, max=n + 1)
    hi_o = torch.clamp(P["row_end"][q] - kv, min=0, max=n + 1)
    slash = P["scnt"][b, h, hi_o] > P["scnt"][b, h, lo_o]
    return ok & (near | P["vert"][b, h, kv] | slash)


def block(P, b, h, q, kv):
    ok, near = _common(P, b, h, q, kv)
    return ok & (near | P["chosen"][b, h, P["row_block"][q], kv // P["block_n"]])


MASKS = {"a_shape": a_shape, "grid": grid, "vertical_slash": vertical_slash, "block": block}


# ---------------------------------------------------------------------- masks by rows
def flat_specs(specs, batch: int = 1):
    """``(spec, active [B, S] or None)`` for every spec, a Fallback's sides included."""
    out = []
    for sp in specs:
        if isinstance(sp, Fallback):
            use = sp.use.detach().to("cpu", torch.bool)
            out.append((sp.primary, ~use))
            where = {h: i for i, h in enumerate(sp.primary.heads)}
            for alt in sp.alternatives:
                out.append((alt, use[:, [where[h] for h in alt.heads]]))
        else:
            out.append((sp, None))
    return out


def _or_into(out, heads, m):
    """``out[:, heads[s]] |= m[:, s]`` for every slot s; slots of one head OR together (an
    indexed ``|=`` with a repeated head keeps only its last slot)."""
    if len(set(heads)) == len(heads):
        out[:, torch.tensor(heads, dtype=torch.long)] |= m
    else:
        for s, h in enumerate(heads):
            out[:, h] |= m[:, s]


def spec_mask_rows(specs, n: int, num_heads: int, *, block_m: int, block_n: int = 64,
                   row_groups=None, batch: int = 1, rows: int = 1024, q_start: int = 0):
    """The exact mask of the specs, ``rows`` query rows at a time, at any N: yields
    ``(r0, mask [B, H, r1 - r0, N])``, ``r0`` absolute; the query rows are ``[q_start, n)``. Apart from causality and a grid's row lines, a
    query's pairs depend only on its row block (its start, end, group, chosen key blocks),
    so each family is evaluated once per row block (at the block's last row in the chunk:
    a causal superset), spread over the block's rows and cut causally row by row; grid row
    lines are added per row. Tested equal to the oracle (``tests/kernels/oracle.py``)."""
    L = layout_tensors(n, block_m, block_n, row_groups, q_start=q_start)
    b = torch.arange(batch)[:, None, None, None]
    kv = torch.arange(n)[None, None, None, :]
    params = []
    for sp, active in flat_specs(specs, batch):
        if len(sp.heads):
            fam = family_of(sp)
            P = spec_params(sp, L, batch, active)
            Pb = dict(P, rows=torch.zeros_like(P["rows"])) if fam == "grid" else P
            slots = torch.arange(len(sp.heads))[None, :, None, None]
            params.append((fam, P, Pb, list(sp.heads), slots))
    for r0 in range(q_start, n, rows):
        r1 = min(r0 + rows, n)
        q = torch.arange(r0, r1)
        rb = L["row_block"][r0:r1]
        step = torch.zeros(r1 - r0, dtype=torch.long)
        step[1:] = (rb[1:] != rb[:-1]).long()
        which = step.cumsum(0)                       # row -> its block among the chunk's
        last = torch.ones(r1 - r0, dtype=torch.bool)
        last[:-1] = step[1:].bool()
        qb = q[last][None, None, :, None]
        blocks = torch.zeros(batch, num_heads, int(last.sum()), n, dtype=torch.bool)
        for fam, P, Pb, heads, slots in params:
            _or_into(blocks, heads, MASKS[fam](Pb, b, slots, qb, kv))
        qr = q[None, None, :, None]
        out = blocks[:, :, which] & (kv <= qr)
        for fam, P, _, heads, slots in params:
            if fam == "grid" and bool(P["rows"].any()):
                _or_into(out, heads, grid_row_lines(P, b, slots, qr, kv))
        yield r0, out
