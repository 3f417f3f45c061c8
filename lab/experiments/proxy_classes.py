"""Which pieces of a live stream met a new Triton specialisation of the estimator's kernels.

Why: the ingest run at `a3b2cbe` on an H100
(benchmarks/results/2026-12-06-stream-ingest-h100-a3b2cbe/) had five pieces of the 35 of a
1.05M-token LongVILA stream take 0.7-1.0 s more than their neighbours (6, 8, 13, 17, 30), and
the stream KV's geometric growth, the first suspect, happens at pieces 2, 4, 7, 11, 17 and 26.
Triton compiles a kernel again for each new class of an integer argument (1, a multiple of
16, anything else). This replays, from the run's own piece lengths, the integers that
``mminfer.kernels.proxy.proxy_sets`` passed at `a3b2cbe` (keys, key blocks of 64, chunks of 8
blocks, tiles of 4 KV heads, the piece's offset) and the mass pass's layout (chunked from
2**19 keys), and prints the pieces at which some kernel met a class it had not seen.
Pieces 1 and 2 are compiled by the benchmark's warm-up stream.

    python lab/experiments/proxy_classes.py \\
        benchmarks/results/2026-12-06-stream-ingest-h100-a3b2cbe/stream_ingest.json
"""

from __future__ import annotations

import json
import math
import sys

BLOCK_Q, KB_PER, HKV, CHUNKS_FROM = 64, 8, 4, 1 << 19


def cls(x: int) -> str:
    return "1" if x == 1 else ("16" if x % 16 == 0 else "-")


def replay(tokens: list[int]) -> list[tuple[int, int, list[str]]]:
    """(piece, keys after it, the kernels that met a new class) for every piece that did."""
    seen, out, n = set(), [], 0
    for i, t in enumerate(tokens, 1):
        q0, n = n, n + t
        n_kb = math.ceil(n / BLOCK_Q)
        n_chunks = math.ceil(n_kb / KB_PER)
        args = {"_sets_lse_kernel": (cls(n_chunks), cls(q0)),
                "_fold_lse_kernel": (cls(n_chunks),)}
        if n >= CHUNKS_FROM:
            args["_sets_mass_chunk_kernel"] = (cls(n), cls(n_chunks), cls(q0))
        else:
            args["_sets_mass_kernel"] = (cls(n), cls(n_kb), cls(HKV * n_kb), cls(q0))
        new = [k for k, v in args.items() if (k, v) not in seen]
        seen.update(args.items())
        if new:
            out.append((i, n, new))
    return out


def main(argv=None) -> int:
    path = (argv or sys.argv[1:])[0]
    pieces = json.load(open(path))["ingest"]["stream"]["pieces"]
    times = [p["prefill_ms"] for p in pieces]
    for i, n, new in replay([p["tokens"] for p in pieces]):
        print(f"piece {i:2d} at {n:8d} keys: prefill {times[i - 1] / 1e3:.3f} s "
              f"(before {times[i - 2] / 1e3 if i > 1 else 0:.3f} s), new class: "
              f"{', '.join(new)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
