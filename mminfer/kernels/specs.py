"""Pattern specs: what one layer's sparse attention computes, per family, for sets of heads.

A spec gives one pattern family for a set of query heads (all heads at once; per-head values
are sequences or ``[B, H']`` tensors, never a Python loop per head in the hot path). The exact
pair set each family means is written once, as mask functions, in ``masks.py``; the plan
(``plan.py``) compiles specs into the arrays the kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

IntLike = Union[int, Sequence[int], torch.Tensor]


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
    plan's row table (``layout.row_table``); entries < 0 are padding."""
    heads: Sequence[int]
    key_blocks: torch.Tensor
    window: IntLike = 0
    qgroup: IntLike = -1
    kgroup: IntLike = -1


Spec = Union[AShape, Grid, VerticalSlash, Block]


@dataclass
class Fallback:
    """The heads of ``primary`` are computed by it, or, for each (request, head) where ``use``
    is true, by ``alternatives`` instead.

    ``use [B, len(primary.heads)]`` bool, in ``primary.heads`` order; it may live on the
    device (an online estimate decides it there) and is never read on the host. The
    alternatives hold each of the primary's heads exactly once, with the same query and key
    group. Both sides are planned; the plan's per-slot active mask switches the unused side
    off, so its programs exit at once."""
    primary: Spec
    alternatives: Sequence[Spec]
    use: torch.Tensor


def dense(heads: Sequence[int], n: int, qgroup: IntLike = -1, kgroup: IntLike = -1) -> AShape:
    return AShape(heads=heads, sink=0, window=n, qgroup=qgroup, kgroup=kgroup)
