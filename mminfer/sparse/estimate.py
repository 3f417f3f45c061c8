"""Online estimation: one layer's q, k + the ModalityIndex -> kernel specs for every head.

All heads at once. Heads are grouped by (query region, key region, pattern kind); each group
is one batched computation, so the work per layer does not grow a Python loop per head.

The proxy is softmax(Q[last queries] · Kᵀ · scale) in fp32 under the causal mask, for the
last ``last_q`` queries of the sequence (none/k-boundary heads) or of one modality
(q/2d-boundary heads). It is reduced on the fly over key chunks in two passes (log-sum-exp,
then normalised mass), so no ``[H, last_q, N]`` matrix exists at long N:

* column sums -> verticals (vertical_slash) and phase sums (grid);
* diagonal sums -> slash offsets (vertical_slash);
* block heads use mean-pooled q/k per block instead (no proxy).

A query set's sums are computed only for the heads whose patterns read them (a-shape,
block and dense heads read none; a grid head reads the column sums, and the diagonal sums
only when its fallback is vertical_slash); on a GPU every set of the layer goes to the
fused kernels in one launch per pass (``kernels/proxy.proxy_sets``).

Grid: for every candidate stride of the layout (``index.grid_strides()``) the phase sums of
the column mass over the visual keys give, per phase, the *lift* = phase mass / the phase's
uniform share, both without the phase's heaviest column (one column is not a grid). The best
phase per stride, then the best stride among those that count: the keys in the histogram
must hold ``MIN_PERIODS`` periods of it, its lift must be significant for the number of keys
its phase holds (above the noise of the best of its phases), and a multiple of a smaller
candidate counts only if the divisor's phase mass above uniform sits in one of its sub-phases
(else every multiple of the true stride would tie or win by noise, at a fraction of the
recall). A best lift below ``min_lift`` switches the head to its fallback pattern, decided
on the device: the grid spec and its fallback specs go to the plan as one ``Fallback`` whose
``use`` mask is that decision, the plan switches the losing side off, so nothing waits for
the GPU.

Queries at an offset (``q_start``: a live stream's appended piece): q holds only the rows
``[q_start, N)`` and k every key; the query sets are the last queries *of the piece* (per
modality for boundary heads), scored against every key, and every spec is in absolute
positions, so grid lines keep their stride and phase across pieces and the modality groups
are those of the whole prompt. A query region with no row in the piece computes nothing: its
slot is planned dense (no row block runs it) and nothing is estimated for it.

Nothing in the hot path reads a device tensor on the host (no ``.item()``/``.tolist()``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from mminfer.errors import ConfigError
from mminfer.kernels import AShape, Block, Fallback, Grid, SparsePlan, VerticalSlash
from mminfer.kernels.layout import key_groups, row_blocks, row_table
from mminfer.kernels.proxy import QuerySet, proxy_sets
from mminfer.kernels.runtime import as_device, to_device
from .mass import MassChoice, blocks_by_mass, line_bounds, lines_by_mass
from .modality import ModalityIndex
from .patterns import HeadPattern, Pattern

RUNNER_UP = 0.2           # stride multiples: max runner-up sub-phase share (see grid())
MIN_PERIODS = 4           # grid: periods of a stride the phase histogram must hold
MIN_Z_MARGIN = 2.0        # grid: lift significance above the noise of the best of s phases
_CHUNK_ELEMS = 1 << 26    # fp32 elements per chunk of the estimates (256 MiB)
_PROXY_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 26}   # fp32 proxy scores per key chunk
# Which proxy computes the column and diagonal sums. "triton": the fused proxy kernels
# (kernels/proxy.py), every query set of the layer (runs of at most 64 queries) in one
# launch per pass, each set only for the heads whose patterns read it (a set no pattern
# reads, should one be asked for, takes the PyTorch passes); "torch": the chunked PyTorch
# passes below; "auto": triton on a GPU (measured on the H200: 1.4-1.7x less estimation time
# at 128K-256K than torch, and 1.5-1.7x less again than one launch pair per query run; lab/
# NOTES.md, "Fused proxy kernels" and "Kernel variants and the query-set estimator"), torch on
# the CPU (where only the slow interpreter runs Triton).
PROXIES = ("auto", "torch", "triton")


@dataclass
class GridChoice:
    """What the grid estimate chose for a group of heads (device tensors ``[B, H']``)."""
    heads: list
    qmod: Optional[str]
    kmod: Optional[str]
    start: int
    end: int
    stride: torch.Tensor
    phase: torch.Tensor
    lift: torch.Tensor
    fallback: torch.Tensor        # bool: the fallback pattern is used


@dataclass
class LayerEstimate:
    n: int
    batch: int
    num_heads: int
    block_m: int
    block_n: int
    specs: list                   # every head exactly once per query (and 2D key) group;
    #                               a grid group with its fallbacks is one kernels.Fallback
    row_groups: Optional[list]    # None when no head uses a boundary
    row_line_programs: int = 0    # grid row-line programs per slot (plan hint, no sync)
    q_start: int = 0              # the first query row (absolute): q holds [q_start, n)
    grids: list = field(default_factory=list)   # GridChoice per grid group
    device: torch.device = torch.device("cpu")
    masses: list = field(default_factory=list)  # MassChoice per group with a mass budget

    def build_plan(self, device=None) -> SparsePlan:
        """The kernel plan. A grid group and its fallback are both planned; the plan's
        active mask (the estimate's device-side choice) says which one runs per head."""
        device = device if device is not None else self.device
        return SparsePlan.build(self.n, self.num_heads, self.specs, block_m=self.block_m,
                                block_n=self.block_n, row_groups=self.row_groups,
                                batch=self.batch, device=device,
                                max_row_lines=self.row_line_programs, q_start=self.q_start)

    def summary(self) -> dict:
        """Per-head grid choices as host values (synchronises: for reports and tests)."""
        out = {}
        for g in self.grids:
            for i, h in enumerate(g.heads):
                out.setdefault(h, []).append({
                    "region": g.qmod or "all", "keys": g.kmod or "all",
                    "stride": g.stride[:, i].tolist(), "phase": g.phase[:, i].tolist(),
                    "lift": [round(x, 3) for x in g.lift[:, i].tolist()],
                    "fallback": g.fallback[:, i].tolist()})
        return out

    def mass_summary(self) -> dict:
        """Per-head mass-budget choices as host values (synchronises: for reports and
        tests): head -> [{region, keys, kind, gamma, count, density, covered} per group],
        each value a list over the batch."""
        out = {}
        for m in self.masses:
            for i, h in enumerate(m.heads):
                out.setdefault(h, []).append({
                    "region": m.qmod or "all", "keys": m.kmod or "all", "kind": m.kind,
                    "gamma": m.gamma[i], "count": [round(x, 3) for x in m.count[:, i].tolist()],
                    "density": [round(x, 6) for x in m.density[:, i].tolist()],
                    "covered": [round(x, 4) for x in m.covered[:, i].tolist()]})
        return out


def estimate_layer(q: torch.Tensor, k: torch.Tensor, index: ModalityIndex,
                   heads: Sequence[HeadPattern], *, block_m: int = 128, block_n: int = 64,
                   last_q: int = 64, chunk: int | None = None,
                   scale: float | None = None, proxy: str = "auto",
                   spread_q: int = 0, q_start: int = 0) -> LayerEstimate:
    """Kernel specs for all heads of one layer. q ``[B, Hq, N - q_start, D]`` (the query rows
    from ``q_start``; see the module doc), k ``[B, Hkv, N, D]``;
    ``heads[h]`` is the HeadPattern of (local) head h. ``block_m``/``block_n`` must be the
    plan's (block heads list key blocks of ``block_n`` per row block of ``block_m``);
    ``chunk`` is the key chunk of the proxy (default: about 256 MiB of fp32 scores);
    ``proxy`` one of ``PROXIES`` (see there); ``spread_q`` queries spread evenly over the
    query set's positions past the first eighth of the sequence join its last ``last_q``
    (the config's ``estimation.spread_queries``; the fused proxy reads a larger query set as
    sets of at most 64 and adds their sums)."""
    if proxy not in PROXIES:
        raise ConfigError(f"proxy must be one of {', '.join(PROXIES)}, not {proxy!r}")
    B, Hq, Nq, D = q.shape
    N = k.shape[2]
    if len(heads) != Hq:
        raise ValueError(f"{len(heads)} head patterns for {Hq} query heads")
    if index.n != N:
        raise ValueError(f"modality index is for {index.n} tokens, k has {N}")
    if k.shape[0] != B or Nq != N - q_start or Hq % k.shape[1] or not 0 <= q_start < N:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} from row "
                         f"{q_start}")
    scale = D ** -0.5 if scale is None else scale
    mods = index.modalities()
    multi = len(mods) > 1
    # query modalities with rows among the queries (all of them, without an offset)
    has_rows = {s.modality for s in index.spans if s.end > q_start}

    # Host bookkeeping over the config (ints and strings only): head -> regions -> groups.
    groups: dict[tuple, list] = {}
    for h, hp in enumerate(heads):
        b = hp.boundary if multi else "none"
        if b in ("none", "k"):
            regions = [(None, None, hp.for_region(mods[0], mods[0]))]
        elif b == "q":
            regions = [(m, None, hp.for_region(m)) for m in mods]
        else:
            regions = [(qm, km, hp.for_region(qm, km)) for qm in mods for km in mods]
            if all(_dense_at(p, N) for *_, p in regions):
                # Every region is every causal pair: one dense slot, not one sweep of the
                # whole near range per key group (G times the work for the same pairs).
                b, regions = "none", [(None, None, Pattern("dense"))]
        for qm, km, p in regions:
            if qm is not None and qm not in has_rows:
                p = Pattern("dense")        # no query row of this region: nothing runs
            groups.setdefault((qm, km, p.kind, b == "k"), []).append((h, p))

    # Which diagonal sums each query set needs (None: over all keys; a modality: 2D keys).
    # Per head as well (``reads``: query modality -> head -> the diagonals it reads; a head
    # listed reads the column sums): a set's sums are computed only for its readers.
    needs: dict = {}
    reads: dict = {}
    for (qm, km, kind, _), members in groups.items():
        if kind == "vertical_slash" or (kind == "grid" and any(
                p.fallback.kind == "vertical_slash" for _, p in members)):
            needs.setdefault(qm, set()).add(km)
        for h, p in members:
            if kind == "vertical_slash" or (kind == "grid" and p.fallback.kind == "vertical_slash"):
                reads.setdefault(qm, {}).setdefault(h, set()).add(km)
            elif kind == "grid":
                reads.setdefault(qm, {}).setdefault(h, set())

    # Row blocks never straddle a modality span when the input has several, whatever this
    # layer's heads are: a head's tiles (and so its mask) then depend on its own pattern and
    # the token layout only, not on which other heads share the launch (tensor-parallel
    # ranks hold different heads and must compute what one process does).
    row_groups = index.row_groups() if multi else None
    est = _Estimator(q, k, index, block_m, block_n, last_q, chunk, scale, multi, row_groups,
                     needs, proxy, reads, spread_q, q_start)
    out = LayerEstimate(n=N, batch=B, num_heads=Hq, block_m=block_m, block_n=block_n,
                        specs=[], row_groups=row_groups, device=q.device, q_start=q_start)
    for (qm, km, kind, ksplit), members in groups.items():
        hs = [h for h, _ in members]
        pats = [p for _, p in members]
        if kind == "grid":
            est.grid(out, hs, pats, qm, km, ksplit)
        else:
            out.specs.append(est.spec(kind, hs, pats, qm, km, ksplit))
    out.masses = est.masses
    return out


def _dense_at(p: Pattern, n: int) -> bool:
    """True when ``p`` computes every causal pair of its region at length ``n``: its near
    range reaches key 0 from every row."""
    return p.kind == "dense" or (p.window is not None and p.window >= n - 1)


class _Estimator:
    """Per-call state: the proxy statistics of each query set, computed once, shared by all
    groups that read them."""

    def __init__(self, q, k, index, block_m, block_n, last_q, chunk, scale, multi, row_groups,
                 needs, proxy, reads=None, spread_q=0, q_start=0):
        self.q, self.k, self.index = q, k, index
        self.q_start = q_start
        self.spread_q = spread_q
        self._qpos_cache: dict = {}
        self.proxy = proxy if proxy != "auto" else ("triton" if q.is_cuda else "torch")
        self.block_m, self.block_n, self.last_q = block_m, block_n, last_q
        self.chunk, self.scale, self.multi = chunk, scale, multi
        self.row_groups = row_groups
        self.dev = q.device
        self.B, self.Hq, _, _ = q.shape
        self.N = k.shape[2]                  # keys; the query rows are [q_start, N)
        self._stats: dict = {}
        self.masses: list = []     # MassChoice of every group with a mass budget
        # Query sets by position: "text" and "all" are often the same last 64 tokens.
        self.needs: dict = {}
        for qm, kms in needs.items():
            self.needs.setdefault(tuple(self._qpos(qm)), set()).update(kms)
        self.reads: dict = {}          # query positions (<= 64) -> head -> diagonals read
        self._parts: dict = {}         # a larger query set -> its sets of <= 64 positions
        for qm, by_head in (reads or {}).items():
            pos = tuple(self._qpos(qm))
            # the fused proxy takes sets of at most 64 queries: a larger one (spread
            # queries) is read as several, whose sums add up (each row's softmax is its own)
            parts = [pos[i:i + 64] for i in range(0, len(pos), 64)]
            self._parts[pos] = parts
            for part in parts:
                mine = self.reads.setdefault(part, {})
                for h, kms in by_head.items():
                    mine.setdefault(h, set()).update(kms)
        self._sets: dict = {}          # query positions -> (heads, col, diags) (fused sets)

    # ------------------------------------------------------------------ helpers
    def _group(self, mod):
        return -1 if mod is None or not self.multi else self.index.group_of(mod)

    def _heads(self, hs):
        return _const(hs, self.dev, torch.long)

    def _ints(self, xs):
        return _const(xs, self.dev, torch.long)

    def _floats(self, xs):
        return _const(xs, self.dev, torch.float32)

    def _qpos(self, qmod):
        key = qmod if self.multi else None
        if key not in self._qpos_cache:
            q0 = self.q_start            # only rows of q can be read
            if key is None:
                last = list(range(max(q0, self.N - self.last_q), self.N))
                spans = [(q0, self.N)]
            else:
                last = [p for p in self.index.last_positions(qmod, self.last_q) if p >= q0]
                spans = [(max(s.start, q0), s.end) for s in self.index.spans_of(qmod)
                         if s.end > q0]
            if self.spread_q > 0 and last:
                last = sorted(set(last) | set(_spread(spans, self.N // 8, last[0],
                                                      self.spread_q)))
            self._qpos_cache[key] = last
        return self._qpos_cache[key]

    def stats(self, qmod, kmod, hs):
        """(col [B, H', N], diag [B, H', N] or None) of the query set of ``qmod`` for the
        heads ``hs``; with ``kmod`` the diagonal sums count only keys of that modality
        (2D-boundary)."""
        pos = tuple(self._qpos(qmod))
        parts = self._parts.get(pos)
        if self.proxy == "triton" and parts and all(p in self.reads for p in parts):
            col, diag = self._set_stats(parts[0], kmod, hs)
            for p in parts[1:]:
                c, d = self._set_stats(p, kmod, hs)
                col = col + c
                diag = None if diag is None else diag + d
            return col, diag
        col, diag = self._all_heads(pos, kmod)
        hidx = self._heads(hs)
        return col[:, hidx], (diag[:, hidx] if diag is not None else None)

    def _set_stats(self, pos, kmod, hs):
        if not self._sets:
            # Every query set of the layer in one fused call, each for its readers only.
            keys = sorted(self.reads)
            sets = []
            for p in keys:
                by_head = self.reads[p]
                heads = tuple(sorted(by_head))
                diags = tuple(tuple(sorted({None if km is None else self.index.group_of(km)
                                            for km in by_head[h]},
                                           key=lambda d: -1 if d is None else d))
                              for h in heads)
                sets.append(QuerySet(tuple(_runs(p)), heads, diags))
            kg = _key_groups(self.index, self.dev)[0] if any(
                d is not None for s in sets for ds in s.diags for d in ds) else None
            for p, s, (col, dg) in zip(keys, sets, proxy_sets(self.q, self.k, sets, self.scale,
                                                                kgroup=kg,
                                                                q_start=self.q_start)):
                self._sets[p] = (s.heads, col, dg)
        heads, col, dg = self._sets[pos]
        d = None if kmod is None else self.index.group_of(kmod)
        diag = dg.get(d)
        rows = tuple(heads.index(h) for h in hs)
        if rows == tuple(range(len(heads))):
            return col, diag
        idx = self._ints(rows)
        return col[:, idx], (diag[:, idx] if diag is not None else None)

    def _all_heads(self, pos, kmod):
        """(col, diag) ``[B, Hq, N]`` of the query positions ``pos`` for every head."""
        if pos not in self._stats:
            want = self.needs.get(pos, set())
            kg, _ = _key_groups(self.index, self.dev)
            kmasks = [(km, kg == self.index.group_of(km)) for km in want if km is not None]
            self._stats[pos] = _proxy_stats(self.q, self.k, list(pos), self.scale,
                                            self.chunk, None in want, kmasks, self.q_start)
        col, diag, diag_k = self._stats[pos]
        return col, (diag_k[kmod] if kmod is not None else diag)

    # ------------------------------------------------------------------ specs
    def spec(self, kind, hs, pats, qmod, kmod, ksplit=False):
        qg, kg = self._group(qmod), self._group(kmod)
        if kind == "dense":
            return AShape(heads=hs, sink=0, window=self.N, qgroup=qg, kgroup=kg)
        if kind == "a_shape":
            return AShape(heads=hs, sink=[p.sink for p in pats], window=[p.window for p in pats],
                          qgroup=qg, kgroup=kg)
        if kind == "vertical_slash":
            return self._vertical_slash(hs, pats, qmod, kmod, ksplit)
        if kind == "block":
            return self._block(hs, pats, qmod, kmod)
        raise ValueError(f"unknown pattern kind {kind!r}")

    # ------------------------------------------------------------------ selection
    def _vertical_slash(self, hs, pats, qmod, kmod, ksplit):
        """Heads with count budgets keep their counts; heads with a mass budget (gamma)
        get theirs from the mass rule (``mass.py``); a group holding both is one spec."""
        by_mass = [i for i, p in enumerate(pats) if p.mass]
        if not by_mass:
            return self._vertical_slash_counts(hs, pats, qmod, kmod, ksplit)
        if len(by_mass) == len(pats):
            return self._vertical_slash_mass(hs, pats, qmod, kmod)
        by_count = [i for i, p in enumerate(pats) if not p.mass]
        a = self._vertical_slash_counts([hs[i] for i in by_count], [pats[i] for i in by_count],
                                        qmod, kmod, ksplit)
        b = self._vertical_slash_mass([hs[i] for i in by_mass], [pats[i] for i in by_mass],
                                      qmod, kmod)
        parts = [(by_count, a), (by_mass, b)]
        return VerticalSlash(heads=hs, verticals=self._merge(parts, "verticals", len(hs)),
                             slashes=self._merge(parts, "slashes", len(hs)),
                             window=[p.window for p in pats], qgroup=self._group(qmod),
                             kgroup=self._group(kmod))

    def _merge(self, parts, name, n_heads):
        """One id tensor ``[B, H', ...]`` (-1 padded to the widest) from specs of subsets of
        the heads: ``parts`` = [(positions in the group, spec)]."""
        ts = [getattr(sp, name) for _, sp in parts]
        width = max(t.shape[-1] for t in ts)
        out = torch.full((self.B, n_heads) + ts[0].shape[2:-1] + (width,), -1,
                         dtype=torch.long, device=self.dev)
        for (pos, _), t in zip(parts, ts):
            out[:, self._ints(pos), ..., :t.shape[-1]] = t
        return out

    def _vertical_slash_mass(self, hs, pats, qmod, kmod):
        N, dev = self.N, self.dev
        col, diag = self.stats(qmod, kmod, hs)                      # [B, H', N]
        sink = self._ints([p.sink for p in pats])
        keys, n_keys = None, N
        if kmod is not None and self.multi:
            kgroups, counts = _key_groups(self.index, dev)
            g = self.index.group_of(kmod)
            keys, n_keys = kgroups == g, counts[g]
        floor, ceil = line_bounds(pats, n_keys)
        top, slashes, count, cost, covered = lines_by_mass(
            col, diag, sink=sink, window=self._ints([p.window for p in pats]),
            qpos=self._ints(sorted(self._qpos(qmod))),
            gamma=self._floats([p.gamma for p in pats]), floor=self._ints(floor),
            ceil=self._ints(ceil), width=max(ceil), slash_cost=float(self.block_n), keys=keys)
        max_sink = min(max(p.sink for p in pats), N)
        sinks = torch.arange(max_sink, device=dev)[None, None, :].expand(self.B, len(hs), -1)
        sinks = torch.where(sinks < sink[None, :, None], sinks, torch.full_like(sinks, -1))
        self.masses.append(MassChoice(hs, "vertical_slash", qmod, kmod, count,
                                      cost / max(n_keys, 1), covered,
                                      [p.gamma for p in pats]))
        return VerticalSlash(heads=hs, verticals=torch.cat([sinks, top], dim=-1),
                             slashes=slashes, window=[p.window for p in pats],
                             qgroup=self._group(qmod), kgroup=self._group(kmod))

    def _vertical_slash_counts(self, hs, pats, qmod, kmod, ksplit):
        N, dev = self.N, self.dev
        col, diag = self.stats(qmod, kmod, hs)                      # [B, H', N]
        sink = self._ints([p.sink for p in pats])
        window = self._ints([p.window for p in pats])
        j = torch.arange(N, device=dev)
        neg = float("-inf")

        # Verticals: sinks forced in, the rest by column mass (restricted to 2D key group).
        score = torch.where(j[None, None, :] < sink[None, :, None], neg, col)
        kgroups, counts = _key_groups(self.index, dev)
        if kmod is not None and self.multi:
            score = torch.where(kgroups == self.index.group_of(kmod), score, neg)
        nv = [p.n_vertical for p in pats]
        if ksplit and self.multi:
            # K-boundary: the budget split across key modalities (a modality with fewer
            # keys than its share hands the rest to the largest one).
            M = len(counts)
            nv_t = torch.tensor(nv)
            share = torch.minimum((nv_t // M)[:, None], torch.tensor(counts)[None, :])
            big = max(range(M), key=lambda m: counts[m])
            share[:, big] = torch.clamp(share[:, big] + nv_t - share.sum(1), max=counts[big])
            parts = []
            for m in range(M):
                sm = torch.where(kgroups == m, score, neg)
                parts.append(_topk_ids(sm, share[:, m].tolist(), dev))
            top = torch.cat(parts, dim=-1)
        else:
            top = _topk_ids(score, nv, dev)
        max_sink = min(max(p.sink for p in pats), N)
        sinks = torch.arange(max_sink, device=dev)[None, None, :].expand(self.B, len(hs), -1)
        sinks = torch.where(sinks < sink[None, :, None], sinks, torch.full_like(sinks, -1))
        verticals = torch.cat([sinks, top], dim=-1)

        # Slashes: diagonals within the window are the near range already.
        dscore = torch.where(j[None, None, :] <= window[None, :, None], neg, diag)
        slashes = _topk_ids(dscore, [p.n_slash for p in pats], dev)
        return VerticalSlash(heads=hs, verticals=verticals, slashes=slashes,
                             window=[p.window for p in pats], qgroup=self._group(qmod),
                             kgroup=self._group(kmod))

    def _block(self, hs, pats, qmod, kmod):
        q, k, dev = self.q, self.k, self.dev
        B, Hq, Nq, D = q.shape
        N = self.N
        group = Hq // k.shape[1]
        bn = self.block_n
        table, rb = _row_blocks(N, self.block_m, self.row_groups, dev, self.q_start)
        R = table.shape[0]
        hidx = self._heads(hs)
        kvidx = self._heads([h // group for h in hs])
        step = max(1, _CHUNK_ELEMS // max(1, B * len(hs) * D))
        # Heads with a stride rank key blocks by antidiagonal scores (_antidiag_logmass), the
        # others by mean-pooled queries and keys.
        strides = sorted({p.stride for p in pats if p.stride})
        by_stride = {st: [i for i, p in enumerate(pats) if p.stride == st] for st in strides}
        pooled = any(not p.stride for p in pats)
        nkb = -(-N // bn)
        if pooled:
            # Mean-pooled queries per row block and keys per key block, in fp32, chunked.
            qbar = torch.zeros(B, len(hs), R, D, dtype=torch.float32, device=dev)
            for a in range(0, Nq, step):
                b = min(a + step, Nq)
                qbar.index_add_(2, rb[a:b], q[:, hidx, a:b].float())
            qbar /= (table[:, 1] - table[:, 0]).to(torch.float32)[None, None, :, None]
            kbar = torch.empty(B, k.shape[1], nkb, D, dtype=torch.float32, device=dev)
            kstep = max(bn, (_CHUNK_ELEMS // max(1, B * k.shape[1] * D)) // bn * bn)
            for a in range(0, N, kstep):
                b = min(a + kstep, N)
                kc = k[:, :, a:b].float()
                full = (b - a) // bn
                if full:
                    kbar[:, :, a // bn:a // bn + full] = \
                        kc[:, :, :full * bn].reshape(B, k.shape[1], full, bn, D).mean(3)
                if full * bn < b - a:
                    kbar[:, :, a // bn + full] = kc[:, :, full * bn:].mean(2)
            kbar = kbar[:, kvidx]                              # [B, H', NKB, D] (pooled)

        window = self._ints([p.window for p in pats])
        cstart = torch.arange(nkb, device=dev) * bn
        ok_k = torch.ones(nkb, dtype=torch.bool, device=dev)
        if kmod is not None and self.multi:
            kg, _ = _key_groups(self.index, dev)
            hit = torch.zeros(nkb + 1, dtype=torch.int32, device=dev)
            hit.index_add_(0, torch.arange(N, device=dev) // bn,
                           (kg == self.index.group_of(kmod)).to(torch.int32))
            ok_k = hit[:nkb] > 0
        lognk = torch.clamp(N - cstart, max=bn).to(torch.float32).log()    # log keys per block
        # Heads with count budgets (top_k) and with mass budgets (gamma) select apart.
        by_count = [i for i, p in enumerate(pats) if not p.mass]
        by_mass = [i for i, p in enumerate(pats) if p.mass]
        top_k = [pats[i].top_k for i in by_count]
        kmax = min(max(top_k), nkb) if by_count else 0
        if by_mass:
            mpats = [pats[i] for i in by_mass]
            _, widest = line_bounds(mpats, nkb)
            mwidth = min(max(widest), nkb)
            gamma = self._floats([p.gamma for p in mpats])
            # per row block, of its own causal key blocks (below): a share of the layer's
            # keys would leave every row block before it dense
            dmin = self._floats([p.min_density for p in mpats])[:, None]
            dmax = self._floats([p.max_density for p in mpats])[:, None]
            logn = torch.where(ok_k, lognk, float("-inf"))
            m_count = torch.zeros(B, len(by_mass), R, device=dev)
            m_cover = torch.zeros(B, len(by_mass), R, device=dev)
        else:
            mwidth = 0
        out = torch.full((B, len(hs), R, max(kmax, mwidth)), -1, dtype=torch.long, device=dev)
        rstep = max(1, _CHUNK_ELEMS // max(1, B * len(hs) * nkb))
        ad = {}
        if strides:
            # the antidiagonal scores of a row block are [block_m / S, N / S] per head
            rstep = max(1, min(rstep, _CHUNK_ELEMS // max(
                1, B * len(hs) * -(-self.block_m // min(strides)) * -(-N // min(strides)))))
            for st, idx in by_stride.items():
                hi = self._ints(idx)
                S = math.gcd(st, bn)
                G = -(-N // S)
                kp = torch.nn.functional.pad(k[:, kvidx[hi]], (0, 0, 0, G * S - N))
                ad[st] = (hi, hidx[hi], kp.reshape(B, len(idx), G, S * D))
        budget = _const(top_k, dev, torch.long)[None, :, None, None]
        rank = torch.arange(kmax, device=dev)
        cpos, mpos = self._ints(by_count), self._ints(by_mass)
        whole = not by_mass
        for a in range(0, R, rstep):
            b = min(a + rstep, R)
            s = torch.matmul(qbar[:, :, a:b], kbar.transpose(-1, -2)) if pooled else \
                torch.empty(B, len(hs), b - a, nkb, device=dev)            # [B, H', r, NKB]
            for st, (hi, hq, kr) in ad.items():
                lm = _antidiag_logmass(q, hq, kr, table[a:b], st, self.block_m, bn, nkb,
                                       self.scale, ok_k, self.q_start)
                # in pooled-score units, so the rules below read both kinds alike
                s[:, hi] = (lm - lognk) / self.scale
            lo = torch.clamp(table[a:b, 0][None, :] - window[:, None], min=0)  # [H', r]
            far = (cstart[None, None, :] < lo[:, :, None]) & ok_k
            if by_count:
                sc = s if whole else s[:, cpos]
                fc = far if whole else far[cpos]
                sc = torch.where(fc[None], sc, float("-inf"))
                vals, ids = torch.topk(sc, kmax, dim=-1)
                keep = (rank < budget) & torch.isfinite(vals)
                ids = torch.where(keep, ids, torch.full_like(ids, -1))
                if whole:
                    out[:, :, a:b] = ids
                else:
                    out[:, cpos, a:b, :kmax] = ids
            if by_mass:
                only = not by_count
                sm, fm = (s, far) if only else (s[:, mpos], far[mpos])
                causal = cstart[None, :] < table[a:b, 1][:, None]               # [r, NKB]
                logits = torch.where(causal, sm * self.scale + logn, float("-inf"))
                nc = (causal & ok_k).sum(-1).to(torch.float32)[None, :]        # [1, r]
                ceil = torch.floor(dmax * nc + 1e-6).long()                   # [H', r]
                floor = torch.minimum(torch.ceil(dmin * nc - 1e-6).long(), ceil)
                ids, cnt, cov = blocks_by_mass(logits, fm[None], ~fm[None], gamma=gamma,
                                               floor=floor, ceil=ceil, width=mwidth)
                if only:
                    out[:, :, a:b] = ids
                else:
                    out[:, mpos, a:b, :mwidth] = ids
                m_count[:, :, a:b], m_cover[:, :, a:b] = cnt, cov
        if by_mass:
            # Reported over the row blocks this slot computes (its query group's).
            rows = table[:, 2] == self._group(qmod) if qmod is not None and self.multi \
                else torch.ones(R, dtype=torch.bool, device=dev)
            mean = (m_count * rows).sum(-1) / rows.sum().clamp(min=1)
            least = torch.where(rows, m_cover, torch.ones_like(m_cover)).amin(-1)
            self.masses.append(MassChoice([hs[i] for i in by_mass], "block", qmod, kmod, mean,
                                          mean / nkb, least, [p.gamma for p in mpats]))
        sinks = [-(-(p.sink or 0) // bn) for p in pats]          # key blocks per head
        if max(sinks):
            # appended for every row block: the plan drops duplicates and those its near
            # range covers, so a sink block the ranking also chose is computed once
            ns = min(max(sinks), nkb)
            j = torch.arange(ns, device=dev)
            ids = torch.where((j[None, :] < self._ints(sinks)[:, None]) & ok_k[None, :ns],
                              j[None, :], -1)
            out = torch.cat([out, ids[None, :, None, :].expand(B, len(hs), R, ns)], -1)
        return Block(heads=hs, key_blocks=out, window=[p.window for p in pats],
                     qgroup=self._group(qmod), kgroup=self._group(kmod))

    # ------------------------------------------------------------------ grid
    def grid(self, est: LayerEstimate, hs, pats, qmod, kmod, ksplit=False):
        span, lines_ok = self._grid_span(qmod, kmod)
        strides = [s for s in self.index.grid_strides() if span and 2 * s <= span[1] - span[0]]
        if not strides:
            # No visual span these rows may carry lines in (text rows, text keys, no
            # video): the fallback is the pattern, decided by the layout alone.
            by_kind: dict[str, list] = {}
            for h, p in zip(hs, pats):
                by_kind.setdefault(p.fallback.kind, []).append((h, p.fallback))
            for kind, mem in by_kind.items():
                est.specs.append(self.spec(kind, [h for h, _ in mem], [p for _, p in mem],
                                           qmod, kmod, ksplit))
            return
        start, end = span
        col, _ = self.stats(qmod, kmod, hs)
        window = self._ints([p.window for p in pats])
        qmin = min(self._qpos(qmod))
        L = end - start
        # Phase sums over the span's keys outside the proxy queries' near window (the
        # window is covered anyway, and its local mass would swamp the phase histogram).
        # Zero-padded by the largest stride once, so that every stride's fold is a view
        # (a pad per stride copied the [B, H', L] mass each time: 75 MB at 1M keys).
        smax = max(strides)
        pos = start + torch.arange(L, device=self.dev)
        vis = pos[None, :] < (qmin - window)[:, None]                     # [H', L]
        if kmod is not None and self.multi:
            kg, _ = _key_groups(self.index, self.dev)
            vis = vis & (kg[start:end] == self.index.group_of(kmod))[None, :]
        mass_buf = torch.zeros(self.B, len(hs), L + smax, device=self.dev)
        vis_buf = torch.zeros(len(hs), L + smax, device=self.dev)
        vis_buf[:, :L] = vis
        mass = mass_buf[..., :L]
        torch.mul(col[:, :, start:end], vis_buf[:, :L], out=mass)     # [B, H', L]
        total = mass.sum(-1)                                              # [B, H']
        ntot = vis.sum(-1).to(torch.float32)                              # [H']
        mean = total / ntot.clamp(min=1)[None]
        sd = ((mass * mass).sum(-1) / ntot.clamp(min=1)[None] - mean * mean).clamp(min=0).sqrt()
        # Every stride's phase sums in one [.., C, smax] buffer (phases past a stride's own
        # count are padding: lift -1), so the statistics below are one op each for
        # all strides, not one per stride (the host enqueues every op; at 128K estimation
        # is host-bound).
        C, H_ = len(strides), len(hs)
        stride_t = _const(strides, self.dev, torch.long)
        fold = torch.zeros(self.B, H_, C, smax, device=self.dev)
        top = torch.zeros(self.B, H_, C, smax, device=self.dev)
        cnt = torch.zeros(H_, C, smax, device=self.dev)
        for i, s in enumerate(strides):
            Ls = -(-L // s) * s
            cols = mass_buf[..., :Ls].view(self.B, H_, -1, s)
            torch.sum(cols, 2, out=fold[:, :, i, :s])
            torch.amax(cols, 2, out=top[:, :, i, :s])
            torch.sum(vis_buf[:, :Ls].view(H_, -1, s), 1, out=cnt[:, i, :s])
        mean4 = mean[..., None, None]
        share = mean4 * cnt[None]
        # Lift and its significance without the phase's heaviest column: one column (a
        # sink, a vertical, a noise spike) is not a grid, and with few keys per phase it
        # would give a large lift by itself.
        rest = fold - top
        c1 = (cnt - 1).clamp(min=0)[None]
        pad = torch.arange(smax, device=self.dev)[None, :] >= stride_t[:, None]   # [C, smax]
        lift_all = torch.where(c1 > 0, rest / (mean4 * c1).clamp(min=1e-30), 0.0)
        lift_all = lift_all.masked_fill(pad, -1.0)       # never a phase past the stride
        z = (rest - mean4 * c1) / (sd[..., None, None] * c1.sqrt()).clamp(min=1e-30)
        lift, phase = lift_all.max(-1)                                    # [B, H', C]
        signif = z.gather(-1, phase[..., None])[..., 0]
        excess = (fold - share) / total.clamp(min=1e-30)[..., None, None]   # [B, H', C, smax]
        # A stride counts only with MIN_PERIODS periods in the keys actually counted (else
        # its phases hold a key or two each), and with a lift significant for the number of
        # keys its phase holds: above the largest of its phases' noise (max of s normal
        # deviates, about sqrt(2 ln s)) by a margin.
        z_min = torch.sqrt(2 * torch.log(stride_t.to(torch.float32))) + MIN_Z_MARGIN
        valid = (ntot[None, :, None] >= MIN_PERIODS * stride_t) & (signif >= z_min)
        # A multiple s_i = m * s_j of a smaller candidate is a real structure only if one of
        # the m sub-phases of the s_j phase holds its excess mass: a true s_j structure
        # spreads it over all m (so the runner-up sub-phase is about as heavy).
        for i, si in enumerate(strides):
            for j, sj in enumerate(strides[:i]):
                if si % sj == 0:
                    sub = (phase[..., i] % sj)[..., None] + \
                        sj * torch.arange(si // sj, device=self.dev)
                    top2 = excess[..., i, :].gather(-1, sub).topk(2, dim=-1).values
                    valid[..., i] &= (top2[..., 0] > 0) & \
                        (top2[..., 1] <= RUNNER_UP * top2[..., 0])
        score = torch.where(valid, lift, torch.zeros_like(lift))
        pick = score.argmax(-1, keepdim=True)
        g_stride = stride_t[pick[..., 0]]                                 # [B, H']
        g_phase = phase.gather(-1, pick)[..., 0]
        g_lift = score.gather(-1, pick)[..., 0]       # 0 when no candidate is valid
        min_lift = self._floats([p.min_lift for p in pats])
        fire = g_lift < min_lift[None, :]

        lines = [p.lines if lines_ok else "cols" for p in pats]
        qg, kg_ = self._group(qmod), self._group(kmod)
        primary = Grid(heads=hs, start=start, end=end, stride=g_stride, phase=g_phase,
                       lines=lines, sink=[p.sink for p in pats],
                       window=[p.window for p in pats], qgroup=qg, kgroup=kg_)
        if any(x != "cols" for x in lines):
            # a piece holds the lines from its first row on (row-line programs start there)
            n_lines = -(-(end - max(start, self.q_start)) // min(strides))
            est.row_line_programs = max(est.row_line_programs, -(-n_lines // self.block_m))
        est.grids.append(GridChoice(hs, qmod, kmod, start, end, g_stride, g_phase, g_lift, fire))
        by_kind: dict[str, list] = {}
        for i, p in enumerate(pats):
            by_kind.setdefault(p.fallback.kind, []).append(i)
        alternatives = [self.spec(kind, [hs[i] for i in pos_list],
                                  [pats[i].fallback for i in pos_list], qmod, kmod, ksplit)
                        for kind, pos_list in by_kind.items()]
        est.specs.append(Fallback(primary, alternatives, use=fire))

    def _grid_span(self, qmod, kmod):
        """(start, end) of the lines and whether row lines are allowed there. Slots of one
        query group need their lines inside one span of that group (row lines are stored
        by position); whole-head slots span all visual tokens, columns only if that range
        holds text too."""
        vis = self.index.visual_spans()
        if not vis:
            return None, False
        if kmod is not None and self.multi and kmod != qmod:
            return None, False   # lines in the query modality's span, keys of another: none
        if qmod is not None and self.multi:
            own = [s for s in vis if s.modality == qmod]
            if not own:
                return None, False
            s = own[-1]
            return (s.start, s.end), True
        if len(vis) == 1:
            return (vis[0].start, vis[0].end), True
        return (vis[0].start, vis[-1].end), False


# ---------------------------------------------------------------------- proxy
def _antidiag_logmass(q, hq, kr, rows, S, block_m, bn, nkb, scale, ok_k, q_start=0):
    """Log attention mass per key block for a chunk of row blocks, by XAttention's
    antidiagonal proxy: per group of S consecutive rows of a row block and S consecutive
    keys, the mean score along the group's antidiagonal (q[r0 + S-1-t] . k[c0 + t]: every
    row and every key read once, 1/S of QK^T); a softmax per row group over the causal key
    groups; summed per row block and key block. A landmark key keeps its own score, where
    mean-pooled keys dilute it ``block_n``-fold.

    q ``[B, Hq, N - q_start, D]`` (all heads, the rows from ``q_start``; ``hq`` the ones to
    score), ``kr [B, H', G, S*D]`` their
    keys in groups of S (zero-padded); ``rows [r, 3]`` (start, end, group) of the row blocks
    (at most ``block_m`` rows); ``ok_k [NKB]`` the key blocks holding the region's keys.
    Returns ``[B, H', r, NKB]`` fp32 (-inf: no mass)."""
    B, _, N, D = q.shape
    H, G = kr.shape[1], kr.shape[2]
    dev = q.device
    S = math.gcd(S, bn)
    J = -(-block_m // S)                                         # row groups per row block
    t = torch.arange(S, device=dev)
    start, end = rows[:, 0], rows[:, 1]
    g0 = start[:, None] + torch.arange(J, device=dev)[None, :] * S          # [r, J]
    valid = g0 < end[:, None]
    idx = torch.minimum(g0[..., None] + (S - 1 - t), end[:, None, None] - 1)  # reversed rows
    qr = q[:, hq[:, None], idx.reshape(-1)[None, :] - q_start].reshape(B, H, -1, S * D)
    sc = torch.matmul(qr, kr.transpose(-1, -2)).float() * (scale / S)         # [B, H, rJ, G]
    last = torch.minimum(g0 + S - 1, end[:, None] - 1).reshape(-1)           # a group's last row
    kg_ok = ok_k.repeat_interleave(bn // S)[:G]
    allowed = (torch.arange(G, device=dev)[None, :] * S <= last[:, None]) & kg_ok[None, :]
    sc = sc.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(sc, -1).nan_to_num(0.0) * valid.reshape(-1, 1)
    p = torch.nn.functional.pad(p, (0, nkb * (bn // S) - G))
    mass = p.reshape(B, H, len(rows), J, nkb, bn // S).sum((3, 5))
    return mass.log()


def _proxy_stats(q, k, pos, scale, chunk, want_diag, kmasks, q_start=0):
    """Column and diagonal sums of softmax(q[pos] kᵀ · scale) (causal, fp32), two passes over
    key chunks; ``pos`` absolute, q's rows from ``q_start``. GQA by index: the query heads of
    one kv head are stacked as rows of one matmul against that kv head's keys. Returns (col,
    diag, {kmod: diag over its keys})."""
    B, Hq, _, D = q.shape
    N = k.shape[2]
    Hkv = k.shape[1]
    g = Hq // Hkv
    nq = len(pos)
    dev = q.device
    pos_t = torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True)
    qs = (q[:, :, pos_t - q_start] * scale).reshape(B, Hkv, g * nq, D)   # [B, Hkv, g*nq, D]
    kend, qmin = pos[-1] + 1, pos[0]
    if chunk is None:
        budget = _PROXY_ELEMS["cuda" if q.is_cuda else "cpu"]
        chunk = max(1024, budget // max(1, B * Hq * nq))
    spans = [(a, min(a + chunk, kend)) for a in range(0, kend, chunk)]

    def scores(a, b):
        s = torch.matmul(qs, k[:, :, a:b].transpose(-1, -2)).float().view(B, Hq, nq, b - a)
        if b - 1 > qmin:
            j = torch.arange(a, b, device=dev)
            s = s.masked_fill(j[None, :] > pos_t[:, None], float("-inf"))
        return s

    # One chunk (up to ~150K keys for 28 heads on a GPU): keep the scores for pass two.
    kept = scores(*spans[0]) if len(spans) == 1 else None
    lse = torch.full((B, Hq, nq), float("-inf"), device=dev)
    for a, b in spans:
        lse = torch.logaddexp(lse, torch.logsumexp(
            kept if kept is not None else scores(a, b), dim=-1))
    col = torch.zeros(B, Hq, N, device=dev)
    diag = torch.zeros(B, Hq, N, device=dev) if want_diag else None
    diag_k = {km: torch.zeros(B, Hq, N, device=dev) for km, _ in kmasks}
    # Query positions as contiguous runs (a modality's last queries can sit in several
    # spans): each run takes the skew path; a scatter_add over rows × keys would pile up
    # atomics on the same few thousand offsets (measured: most of the index time at 256K).
    runs, r = [], 0
    for i in range(1, nq + 1):
        if i == nq or pos[i] != pos[i - 1] + 1:
            runs.append((r, i, pos[r]))
            r = i
    for a, b in spans:
        p = kept if kept is not None else scores(a, b)
        p = p.sub_(lse[..., None]).exp_()                             # [B, Hq, nq, C]
        col[:, :, a:b] = p.sum(2)
        targets = ([(diag, p)] if diag is not None else []) + \
            [(diag_k[km], p * mask[a:b]) for km, mask in kmasks]
        for out, x in targets:
            for r0, r1, q0 in runs:
                _diag_add(out, x[:, :, r0:r1], q0, a)
    return col, diag, diag_k


def _spread(spans, lo: int, hi: int, n: int) -> list:
    """``n`` positions evenly spread over the parts of ``spans`` (``[(start, end)]``) that
    lie in ``[lo, hi)``: rows from the whole sequence, not only its end, so a key that only
    earlier queries attend to (content that the question does not point at) still shows in
    the column sums. The first eighth is left out: its rows see few keys, and each row's
    mass sums to one, so they would pile weight on the first keys."""
    parts = [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]
    total = sum(b - a for a, b in parts)
    if total <= 0:
        return []
    out = []
    for i in range(min(n, total)):
        t = (2 * i + 1) * total // (2 * min(n, total))
        for a, b in parts:
            if t < b - a:
                out.append(a + t)
                break
            t -= b - a
    return out


def _runs(pos):
    """``(first, length)`` of every contiguous run of the sorted positions ``pos``."""
    out, r = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            out.append((pos[r], i - r))
            r = i
    return out


def _diag_add(out, p, q0, a):
    """``out[..., o] += sum of p[..., r, c]`` over ``o = (q0 + r) - (a + c)``, for queries at
    the contiguous positions q0.. and keys from a: a skew (each row r shifted left by r
    through a strided view of a padded copy) turns diagonals into columns, so there is no
    scatter and no atomics."""
    B, H, nq, C = p.shape
    W = C + nq
    # Row r of p goes to flat r * W + nq of a zeroed buffer; read back with rows of W + 1,
    # skew[r, c] = p[r, c + r - nq]: column c is offset q0 - a + nq - c.
    buf = torch.zeros(B, H, nq * (W + 1), dtype=p.dtype, device=p.device)
    buf.as_strided((B, H, nq, C), (H * nq * (W + 1), nq * (W + 1), W, 1),
                   buf.storage_offset() + nq).copy_(p)
    skew = buf.view(B, H, nq, W + 1)
    s = skew.sum(2).flip(-1)                                  # s[t]: offset q0 - a - C + t
    lo = q0 - a - C
    t0, t1 = max(0, -lo), min(W + 1, out.shape[-1] - lo)
    if t1 > t0:
        out[..., lo + t0:lo + t1] += s[..., t0:t1]


def _topk_ids(score, budgets, dev):
    """Top ``budgets[h]`` ids of ``score [B, H', N]`` per head, ``-1`` padded (also where the
    score is -inf: masked-out candidates are never chosen)."""
    kmax = min(max(budgets) if budgets else 0, score.shape[-1])
    if kmax <= 0:
        return torch.full(score.shape[:2] + (0,), -1, dtype=torch.long, device=dev)
    vals, ids = torch.topk(score, kmax, dim=-1)
    budget = _const(budgets, dev, torch.long)
    keep = (torch.arange(kmax, device=dev)[None, None, :] < budget[None, :, None]) \
        & (vals > float("-inf"))
    return torch.where(keep, ids, torch.full_like(ids, -1))


# ---------------------------------------------------------------------- layout caches
def _const(values, device, dtype):
    """A short host list (head ids, windows, budgets) as a device tensor, uploaded once per
    value: every layer of a request, and every request, reads the same few lists, and each
    upload is a host-side copy and a device transfer. The tensors are shared: never write
    into them."""
    return _const_cached(tuple(values), torch.device(device), dtype)


@functools.lru_cache(maxsize=4096)
def _const_cached(values, device, dtype):
    return as_device(values, device, dtype)



# The layout is the same for every layer of a request: build its device tensors once.
@functools.lru_cache(maxsize=16)
def _key_groups_cached(n, row_groups, device):
    gid, counts = key_groups(n, [tuple(x) for x in row_groups])
    return to_device(gid, device), counts


def _key_groups(index: ModalityIndex, device):
    """Group id per key ``[N]`` (device) and key count per group (host), the groups being
    the row groups of ``index.row_groups()`` (the ids the plan's slots use)."""
    return _key_groups_cached(index.n, tuple(index.row_groups()), torch.device(device))


@functools.lru_cache(maxsize=16)
def _row_blocks_cached(n, block_m, row_groups, device, q_start):
    table = row_table(n, block_m, [tuple(x) for x in row_groups] if row_groups else None,
                      q_start)
    return to_device(table.to(torch.long), device), to_device(row_blocks(table), device)


def _row_blocks(n, block_m, row_groups, device, q_start=0):
    """The plan's row table ``[R, 3]`` and the row block of every query row ``[N - q_start]``."""
    return _row_blocks_cached(n, block_m, tuple(map(tuple, row_groups)) if row_groups else None,
                              torch.device(device), q_start)


def full_budget(heads: Sequence[HeadPattern], n: int) -> list:
    """The same head patterns with every budget >= n (their plans are dense): for tests and
    for checking a configuration end to end."""
    def big(p: Pattern) -> Pattern:
        if p.kind == "a_shape":
            return Pattern("a_shape", sink=n, window=n)
        if p.kind == "vertical_slash":
            return Pattern("vertical_slash", n_vertical=n, n_slash=n, window=n, sink=n)
        if p.kind == "block":
            return Pattern("block", top_k=n, window=n)
        if p.kind == "grid":
            return Pattern("grid", lines=p.lines, sink=n, window=n, min_lift=p.min_lift,
                           fallback=big(p.fallback))
        return p
    return [HeadPattern(hp.boundary, {k: big(p) for k, p in hp.patterns.items()})
            for hp in heads]

