"""Live video's pieces against the one-shot prefill: the tiles their sparse plans visit, for
LongVILA-7B's shipped head patterns (issue 43: a 1.05M-token video ingested in one-minute
pieces cost 1.44x its one-shot prefill on an H100, the pieces' attention 2x per row).

A piece's plan takes its config's count budgets (1024 verticals, 64 slashes a head) from its
own last queries, and its rows, all after nearly every line, see all of them; a one-shot row
sees only the lines before it, half on average. Counted here from the plans (no launch,
``kernels/density.py``), on synthetic queries and keys of a random-weight model on similar
tokens: q_i = R(i)(mu_h + noise), k_j = R(j)(nu + noise) at LongVILA's RoPE base, so scores
follow i - j and selections spread over the history. One layer's first 7 heads (layer 2: a
k-boundary vertical_slash, three Q-boundary grids falling back to vertical_slash, an
A-shape), the first piece prefilled whole as the stream does, each later one planned at its
offset, with ``estimation.piece_lines`` at each ``--shares``.

    python3 lab/experiments/piece_tiles.py --frames 512 --piece-frames 120     # ~2 min, CPU

lab/NOTES.md §19 has what it gave.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "mminfer/models/configs/longvila_7b_1m.json"
HEAD, P = 44, 256                     # the prompt's text before the video, tokens per frame


def rope(x, pos, base):
    import torch
    D = x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None].double() * inv[None, :]
    c, s = torch.cos(ang).float().repeat(1, 2), torch.sin(ang).float().repeat(1, 2)
    return x * c + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * s


def inputs(n, heads, dim, seed=0, base=3.58e9):
    import torch
    g = torch.Generator().manual_seed(seed)
    mu, nu = torch.randn(heads, dim, generator=g) * 1.4, torch.randn(dim, generator=g) * 1.4
    pos = torch.arange(n)
    k = rope(nu + 0.7 * torch.randn(n, dim, generator=g), pos, base)[None, None]
    q = rope(mu[:, None] + 0.7 * torch.randn(heads, n, dim, generator=g), pos, base)[None]
    return q, k


def main() -> None:
    from mminfer.kernels import density
    from mminfer.sparse.estimate import estimate_layer
    from mminfer.sparse.modality import ModalityIndex
    from mminfer.sparse.patterns import HeadPatternConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=512)
    ap.add_argument("--piece-frames", type=int, default=120, help="LongVILA at 2 fps: 1 min")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32, help="head dim of the synthetic q/k")
    ap.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5])
    a = ap.parse_args()
    cfg = HeadPatternConfig.load(CONFIG)
    heads = cfg.layer(a.layer)[:7]
    fs = P + 1
    n = HEAD + a.frames * fs
    q, k = inputs(n, len(heads), a.dim)

    def tiles(q0, end, hs):
        idx = ModalityIndex.longvila(HEAD, (end - HEAD) // fs, P, 0)
        est = estimate_layer(q[:, :, q0:end], k[:, :, :end], idx, hs, block_m=128,
                             block_n=64, proxy="torch", q_start=q0)
        return int(density.counts(est.build_plan("cpu"), block_n_tile=128)["tiles"]
                   .get("vertical_slash", 0)), est

    t0 = time.time()
    one = tiles(0, n, heads)[0]
    bounds = list(range(HEAD + a.piece_frames * fs, n, a.piece_frames * fs)) + [n]
    print(f"{n} tokens, {len(bounds)} pieces; one-shot vertical_slash tiles {one} "
          f"({time.time() - t0:.0f} s)")
    for share in a.shares:
        cfg.estimation["piece_lines"] = share
        total = tiles(0, bounds[0], heads)[0] + sum(
            tiles(s, e, cfg.piece_layer(a.layer)[:7])[0] for s, e in zip(bounds, bounds[1:]))
        print(f"piece_lines {share}: pieces {total} tiles, {total / one:.2f}x the one-shot's "
              f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
