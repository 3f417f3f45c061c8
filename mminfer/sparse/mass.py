"""Budgets by retained mass: how many verticals and slashes (vertical_slash) or key blocks
(block, per row block) a head keeps, chosen per head and per request from the proxy's mass.

The rule (FlexPrefill's cumulative-mass rule, on our proxy sums): what the pattern covers
anyway, the near window and the sinks, counts as covered first; the other candidates are
taken in descending estimated mass (vertical_slash: mass per cost, below) until the covered
mass reaches ``gamma`` of the total (the candidate that crosses it is kept); what is taken
is then clamped to a floor and a ceiling. A head whose mass sits on one sharp line stops
after a line or two; a head whose mass is spread over the whole video keeps adding until the
ceiling.

Everything stays on the device: the width of the id lists is the ceiling, a host int from
the config and the length; ids past a head's count are -1, which is how the plan takes
variable budgets (``kernels/plan.py`` sorts them away). Nothing here reads a tensor on the
host or copies one to the device: per-head numbers come in as device tensors, made by the
estimator (which owns how a host list reaches the device without a stream sync).

Estimated mass, exactly:

* vertical_slash: lines are taken by mass per cost, a vertical costing 1 key per row and a
  slash ``block_n`` (the kernel spends at least one key tile per row block on each slash,
  ``kernels/density.py``): taken by mass alone, a spread head's slashes cost more than a
  dense pass. Floor and ceiling bound that cost. The masses: ``col[j]`` (the proxy queries'
  softmax mass on key j) and ``diag[o]``
  (their mass on offset o = i - j). Near = ``sum diag[o <= window]``. A column's mass beyond
  the window is estimated as ``col[j] * f[j]``, f the share of proxy queries i with
  ``i - j > window`` (1 for a column before every query's window, 0 inside all of them;
  between, or when the proxy queries are not contiguous, as a q-boundary text region's
  question and system prompt are not, the column's mass is taken as even over its rows):
  sinks = that for ``j < sink``, vertical candidates = that for the other columns, slash
  candidates = the offsets beyond the window. Total = the proxy mass on the region's keys.
  A vertical and a slash meet in one pair per proxy query, counted in both: the covered
  estimate is high by at most those pairs.
* block: the row block's mean-pooled query against each key block's mean-pooled key,
  ``scale * qbar . kbar + log(keys in the block)``, softmax over the causal key blocks (of
  the region's keys), or with a ``stride`` the antidiagonal proxy's mass per key block
  (``estimate._antidiag_logmass``): near = the blocks in the near range, candidates the
  blocks beyond it. Floor and ceiling are shares of *the row block's own* causal key blocks
  (of the region), so a ceiling of 0.15 is about 0.15 of the causal triangle; as shares of
  the layer's keys, every row block in the first 15 % of the video would stay dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

NEG = float("-inf")


@dataclass
class MassChoice:
    """What the mass rule chose for a group of heads (device tensors ``[B, H']``)."""
    heads: list
    kind: str                     # "vertical_slash" | "block"
    qmod: Optional[str]
    kmod: Optional[str]
    count: torch.Tensor           # lines kept (block: mean key blocks per row block)
    density: torch.Tensor         # what the floor/ceiling clamp: the lines' cost / keys
    #                               (block: key blocks / key blocks of the layer)
    covered: torch.Tensor         # estimated mass covered / total (block: least row block)
    gamma: list                   # per head, host floats


def line_bounds(pats, n_keys: int) -> tuple[list, list]:
    """Floor and ceiling of each mass pattern for a region of ``n_keys`` keys (or key
    blocks): ``ceil(min_density * n)`` and ``floor(max_density * n)``, the floor never above
    the ceiling."""
    hi = [int(math.floor(p.max_density * n_keys + 1e-9)) for p in pats]
    lo = [min(int(math.ceil(p.min_density * n_keys - 1e-9)), h) for p, h in zip(pats, hi)]
    return lo, hi


def keep_by_mass(vals: torch.Tensor, need: torch.Tensor, floor: torch.Tensor,
                 ceil: torch.Tensor, cost: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``vals [..., w]``: candidate masses in the order they are taken (-inf: no
    candidate); ``need [...]``: mass still to cover; ``floor``/``ceil``: costs broadcastable
    to ``[..., 1]``; ``cost [..., w]`` each candidate's (default 1: then floor and ceiling
    are counts). Returns (keep ``[..., w]`` bool, a prefix; the mass kept ``[...]``).
    Candidates are kept while the mass before them is short of ``need`` and they add mass,
    and always while the cost before them is under the floor; never past the ceiling."""
    w = vals.shape[-1]
    finite = vals > NEG
    v = torch.where(finite, vals, torch.zeros_like(vals))
    before = torch.cumsum(v, dim=-1) - v
    if cost is None:
        spent = torch.arange(w, device=vals.device)            # cost before each candidate
        after = spent + 1
    else:
        after = torch.cumsum(cost, dim=-1)
        spent = after - cost
    keep = finite & (((before < need[..., None]) & (v > 0)) | (spent < floor)) & \
        (after <= ceil)
    return keep, (v * keep).sum(-1)


def lines_by_mass(col: torch.Tensor, diag: torch.Tensor, *, sink: torch.Tensor,
                  window: torch.Tensor, qpos: torch.Tensor, gamma: torch.Tensor,
                  floor: torch.Tensor, ceil: torch.Tensor, width: int,
                  slash_cost: float = 1.0, keys: torch.Tensor | None = None):
    """Verticals and slashes of a vertical_slash head by mass.

    ``col``/``diag [B, H, N]`` the proxy's column and diagonal sums (``diag`` over the
    region's keys), ``sink``/``window [H]`` int64 and ``gamma [H]`` float, ``qpos`` the proxy
    queries' positions (ascending int64), ``floor``/``ceil [H]`` int64 costs per head, all on
    the device; ``width`` the id list width (host: at least the largest ceiling); a vertical
    costs 1, a slash ``slash_cost`` (the kernel gives each slash at least one key tile per
    row block, so ``block_n`` keys of work for one key of the line); ``keys [N]`` bool: the
    region's keys (2D-boundary) or None.

    Lines are taken by mass per cost (verticals and slashes in one order), so the floor and
    ceiling bound the work the lines add, in keys per row.

    Returns ``(verticals [B, H, w], slashes [B, H, w], lines [B, H], cost [B, H],
    covered [B, H])``: -1 padded ids (sink columns not included: the caller forces them
    in), the lines kept and their cost, and the estimated covered fraction of the mass (near
    window and sinks included)."""
    B, H, N = col.shape
    dev = col.device
    j = torch.arange(N, device=dev)
    # share of the proxy queries for which column j lies beyond the window  [H, N]
    inside = torch.searchsorted(qpos, (j[None, :] + window[:, None]).contiguous(), right=True)
    frac = (qpos.numel() - inside).to(col.dtype) / max(qpos.numel(), 1)
    if keys is not None:
        frac = frac * keys[None, :]
        total = (col * keys).sum(-1)
    else:
        total = col.sum(-1)
    is_sink = j[None, :] < sink[:, None]
    near = (diag * (j[None, :] <= window[:, None])).sum(-1)
    far_mass = col * frac                                            # [B, H, N]
    base = near + (far_mass * is_sink).sum(-1)                       # [B, H]
    vcand = torch.where(((frac > 0) & ~is_sink)[None], far_mass, NEG)
    scand = torch.where((j[None, :] > window[:, None])[None], diag, NEG)
    width = min(width, 2 * N)
    if width <= 0:
        empty = torch.full((B, H, 0), -1, dtype=torch.long, device=dev)
        zero = torch.zeros(B, H, device=dev)
        return empty, empty, zero, zero, base / total.clamp(min=1e-30)
    cand = torch.cat([vcand, scand], dim=-1)                        # [B, H, 2N] masses
    ratio = cand if slash_cost == 1 else \
        torch.cat([vcand, scand / slash_cost], dim=-1)
    _, ids = torch.topk(ratio, width, dim=-1)
    vals = cand.gather(-1, ids)
    cost = torch.where(ids < N, 1.0, float(slash_cost)).to(col.dtype)
    need = gamma[None, :].to(total.dtype) * total - base
    keep, kept = keep_by_mass(vals, need, floor[None, :, None], ceil[None, :, None], cost)
    minus = torch.full_like(ids, -1)
    verticals = torch.where(keep & (ids < N), ids, minus)
    slashes = torch.where(keep & (ids >= N), ids - N, minus)
    covered = (base + kept) / total.clamp(min=1e-30)
    return verticals, slashes, keep.sum(-1).to(col.dtype), (cost * keep).sum(-1), covered


def blocks_by_mass(logits: torch.Tensor, far: torch.Tensor, near: torch.Tensor, *,
                   gamma: torch.Tensor, floor: torch.Tensor, ceil: torch.Tensor,
                   width: int):
    """Key blocks of block heads by mass, for a chunk of row blocks.

    ``logits [B, H, r, K]``: log estimated mass per key block (-inf where a block is not
    causal for the row block or holds none of the region's keys); ``far``/``near``
    (broadcastable to it) bool: the candidate blocks and the blocks the near range covers;
    ``gamma [H]`` float and ``floor``/``ceil [H, r]`` int64 key blocks per head and row
    block (shares of each row block's causal key blocks, made by the estimator), on the device;
    ``width`` the id list width (host: at least the largest ceiling, at most K).

    Returns ``(ids [B, H, r, width] -1 padded, count [B, H, r], covered [B, H, r])``."""
    B, H, r, K = logits.shape
    dev = logits.device
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(logits - m)                                       # 0 where -inf
    p = e / e.sum(-1, keepdim=True).clamp(min=1e-30)
    total = (p.sum(-1) > 0).to(p.dtype)                             # 1, or 0: no causal key
    base = (p * near).sum(-1)
    if width <= 0:
        return torch.full((B, H, r, 0), -1, dtype=torch.long, device=dev), \
            torch.zeros(B, H, r, device=dev), base / total.clamp(min=1e-30)
    cand = torch.where(far & (e > 0), p, NEG)
    vals, ids = torch.topk(cand, width, dim=-1)
    need = gamma[None, :, None].to(p.dtype) * total - base
    keep, kept = keep_by_mass(vals, need, floor[None, :, :, None], ceil[None, :, :, None])
    out = torch.where(keep, ids, torch.full_like(ids, -1))
    return out, keep.sum(-1).to(torch.float32), (base + kept) / total.clamp(min=1e-30)
