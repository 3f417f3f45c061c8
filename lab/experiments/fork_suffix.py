"""A question's rows over a kept bf16 video that another question's answer holds the tail of
(a ForkKV reader: mminfer.models.hooks.fork_attention -> fp8_attention.split_attention): 28
layers' attention alone, CUDA events, at several question lengths.

Why: benchmarks/step_gap.py on an H100 (8 questions about one 115K-token video, `db6bcb7`):
the 8 suffix prefills took ~50 ms each, one at a time, where one question alone (writing in
the prefix's tail, plain SDPA) took ~29: half the engine's wall for 8 answers. The Triton
pass of split_attention takes a question's ``q_len x 7`` rows over all 115K keys in tiles
of 128 rows, compute bound (as the shared-prefix pass it replaced for decode groups, 677 us a
layer at 56 rows); split_attention now gives the prefix to PyTorch's flash attention.

Reports, per ``q_len``: ``split_ms`` (split_attention as the imported mminfer has it: run the
script against another tree with ``PYTHONPATH=<tree>`` for the other side), ``sdpa_ms`` (one
SDPA call over a cache in one piece, lower-right causal: the tail reader's path, a floor), and
the largest difference from the fp32 chunked form at the first length. Only mminfer is
imported, so the same file times any tree:

    python lab/experiments/fork_suffix.py --out cand.json
    (cd .base && PYTHONPATH=$PWD python ../lab/experiments/fork_suffix.py --out ../base.json)
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention.bias import causal_lower_right

from mminfer.kernels import fp8_attention as F

LAYERS, H, HKV, D = 28, 28, 4, 128


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=115000)
    ap.add_argument("--q-lens", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    P = args.prefix
    longest = max(args.q_lens)
    # one buffer per layer, as a PrefixKV's slab: the prefix, then the tail another answer holds
    ks = [torch.randn(1, HKV, P + longest, D, generator=g, device=dev, dtype=dt)
          for _ in range(LAYERS)]
    vs = [torch.randn(1, HKV, P + longest, D, generator=g, device=dev, dtype=dt)
          for _ in range(LAYERS)]
    scale = D ** -0.5
    rows = []
    for i, n in enumerate(args.q_lens):
        q = torch.randn(1, n, H, D, generator=g, device=dev, dtype=dt).transpose(1, 2)
        own = [(torch.randn(1, HKV, n, D, generator=g, device=dev, dtype=dt),
                torch.randn(1, HKV, n, D, generator=g, device=dev, dtype=dt))
               for _ in range(LAYERS)]
        segs = [[(k[:, :, :P], v[:, :, :P]), o] for k, v, o in zip(ks, vs, own)]
        whole = [(torch.cat([k[:, :, :P], o[0]], 2), torch.cat([v[:, :, :P], o[1]], 2))
                 for k, v, o in zip(ks, vs, own)]
        mask = causal_lower_right(n, P + n)

        def split():
            for s in segs:
                F.split_attention(q, s, None, None, scale)

        def sdpa():
            for k, v in whole:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                 scale=scale, enable_gqa=True)

        row = {"q_len": n, "split_ms": round(_time(split, args.reps), 3),
               "sdpa_ms": round(_time(sdpa, args.reps), 3)}
        if i == 0:
            one = torch.ones(HKV, device=dev)
            ref = F.chunked(q.float(), None, None, one, one, scale, segments=segs[0])
            got = F.split_attention(q, segs[0], None, None, scale)
            row["max_abs_err"] = float((got.float() - ref).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"prefix": P, "layers": LAYERS, "heads": [H, HKV, D],
              "device": torch.cuda.get_device_name(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
