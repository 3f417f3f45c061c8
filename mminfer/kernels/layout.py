"""The contract between the plan and the kernel: the slot parameter row, the family ids, the
spec type of each family, the row-block table and the key groups.

One *slot* is one query head, optionally restricted to one query group (Q-boundary) and one
key group (2D-boundary). Each family's launch reads one int32 row of ``NF`` fields per slot
(``params [B, S, NF]``); every reader (plan, density, estimator, kernel) uses the names below,
the kernel as ``tl.constexpr`` copies of them.
"""

from __future__ import annotations

import torch

from .specs import AShape, Block, Grid, VerticalSlash

# ---------------------------------------------------------------------- slot row
F_HEAD = 0      # query head
F_QGROUP = 1    # query group of the rows it computes, -1: every row
F_KGROUP = 2    # key group of the keys it sees, -1: every key (2D-boundary slots: >= 0)
F_DST = 3       # 0: writes the output; g + 1: the partial of key group g (merged by LSE)
F_DSTHEAD = 4   # index of the head among the 2D-boundary heads (its partials' slot)
F_SINK = 5      # keys [0, sink) (a_shape, grid)
F_WINDOW = 6    # near range: keys from (row block start - window)
F_START = 7     # grid span [start, end)
F_END = 8
F_STRIDE = 9    # grid stride and phase (possibly estimated on the device)
F_PHASE = 10
F_LINES = 11    # grid lines: LINES_COLS | LINES_ROWS
F_ACTIVE = 12   # 0: switched off (a Fallback's unused side); its programs return at once
NF = 13
FIELDS = ("head", "qgroup", "kgroup", "dst", "dsthead", "sink", "window", "start", "end",
          "stride", "phase", "lines", "active")

LINES_COLS, LINES_ROWS = 1, 2
LINES = {"cols": LINES_COLS, "rows": LINES_ROWS, "both": LINES_COLS | LINES_ROWS}

# ---------------------------------------------------------------------- families
A_SHAPE, GRID, VERTICAL_SLASH, BLOCK = 0, 1, 2, 3
FAMILIES = {"a_shape": A_SHAPE, "grid": GRID, "vertical_slash": VERTICAL_SLASH,
            "block": BLOCK}
SPEC_FAMILY = {AShape: "a_shape", Grid: "grid", VerticalSlash: "vertical_slash",
               Block: "block"}


def family_of(spec) -> str:
    """Family name of a pattern spec (``"a_shape"``, ``"grid"``, ...)."""
    try:
        return SPEC_FAMILY[type(spec)]
    except KeyError:
        raise TypeError(f"unknown pattern spec {type(spec).__name__}") from None


# ---------------------------------------------------------------------- rows and keys
def row_table(n: int, block_m: int, row_groups=None, q_start: int = 0) -> torch.Tensor:
    """Row blocks ``[R, 3]`` int32 (start, end, group). ``row_groups``: ordered spans
    ``(start, end, group)`` covering [0, n); no block straddles two spans.

    ``q_start``: only rows ``[q_start, n)`` are queries (a piece appended to a cached prompt,
    a chunk of a prefill). Their blocks are the whole prompt's blocks, the one holding
    ``q_start`` cut to start there, so a row's block (and its near range, its slash tiles)
    does not depend on where the piece began, except in the piece's first block."""
    if row_groups is None:
        row_groups = [(0, n, 0)]
    if q_start and not 0 < q_start < n:
        raise ValueError(f"q_start {q_start} must lie in [0, {n})")
    rows, pos = [], 0
    for start, end, g in row_groups:
        if start != pos or end <= start:
            raise ValueError(f"row groups must tile [0, {n}) in order; got span ({start}, {end})")
        for a in range(start, end, block_m):
            z = min(a + block_m, end)
            if z > q_start:
                rows.append((max(a, q_start), z, g))
        pos = end
    if pos != n:
        raise ValueError(f"row groups end at {pos}, expected {n}")
    return torch.tensor(rows, dtype=torch.int32)


def row_blocks(table: torch.Tensor) -> torch.Tensor:
    """Row block of every query row ``[N - q_start]`` int64 (on the table's device)."""
    lens = (table[:, 1] - table[:, 0]).to(torch.long)
    return torch.repeat_interleave(torch.arange(table.shape[0], device=table.device), lens)


def key_groups(n: int, row_groups) -> tuple[torch.Tensor, list[int]]:
    """Group of every key ``[N]`` int32 and the number of keys per group (host ints), from
    the same ``(start, end, group)`` spans as the rows."""
    gid = torch.empty(n, dtype=torch.int32)
    n_groups = max(g for _, _, g in row_groups) + 1
    counts = [0] * n_groups
    for s, e, g in row_groups:
        gid[s:e] = g
        counts[g] += e - s
    return gid, counts
