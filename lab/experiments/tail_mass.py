"""How spread a model's attention is, per layer and head: the tail mass of lab.toy.sharpen
(the attention mass outside the top ``rho`` share of causal key blocks, per block of
query rows; blocks of 1 and 1: per row and key) on the
dense prefill of real inputs. Sparse prefill can only be exact where this is small; the
number to watch before and after training with ``--sharpen``.

    python3 lab/experiments/tail_mass.py --model mminfer/models/mminfer-embedded \
        --videos synth:count:512:900001 synth:needle:512:900000 --out /tmp/tail.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _oracle_error(q, k, v, starts, rho, rb, kb):
    """Per head, the relative L2 error (over the sampled row blocks) of attention restricted
    to each block's best ``ceil(rho * n)`` key blocks by mass plus its two diagonal blocks."""
    import torch
    _, H, L, D = q.shape
    g = H // k.shape[1]
    num = torch.zeros(H)
    den = torch.zeros(H)
    for s0 in starts.tolist():
        n = s0 + rb
        rows = torch.arange(s0, n)
        for h in range(H):
            lg = (q[0, h, s0:n] @ k[0, h // g, :n].T) / D ** 0.5
            lg = lg.masked_fill(torch.arange(n)[None, :] > rows[:, None], float("-inf"))
            p = torch.softmax(lg, -1)
            ref = p @ v[0, h // g, :n]
            nkb = -(-n // kb)
            mass = torch.nn.functional.pad(p.mean(0), (0, nkb * kb - n)).view(nkb, kb).sum(-1)
            keep = torch.zeros(nkb, dtype=torch.bool)
            keep[mass.topk(max(1, math.ceil(rho * nkb))).indices] = True
            keep[-2:] = True
            m = keep.repeat_interleave(kb)[:n]
            out = torch.softmax(lg.masked_fill(~m[None, :], float("-inf")), -1) @ v[0, h // g, :n]
            num[h] += (out - ref).pow(2).sum()
            den[h] += ref.pow(2).sum()
    return (num / den).sqrt()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--videos", nargs="+", required=True,
                   help="video files or synth:TASK:FRAMES:SEED sources")
    p.add_argument("--rho", type=float, default=0.05)
    p.add_argument("--blocks", type=int, default=16, help="random row blocks per video")
    p.add_argument("--row-block", type=int, default=64)
    p.add_argument("--key-block", type=int, default=64)
    p.add_argument("--oracle", action="store_true",
                   help="also the oracle's relative output error per head: each sampled row "
                   "block attends only to its best rho share of key blocks (by mass) and its "
                   "two diagonal key blocks")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="JSON file for the table")
    args = p.parse_args(argv)

    import torch

    from mminfer.engine.pipeline import Pipeline
    from mminfer.offline.capture import capture_qkv
    from lab.toy.sharpen import sample_starts, tail_mass

    pipe = Pipeline(args.model, attention="dense", device=args.device)
    per_video = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.videos:
            (path,) = capture_qkv(pipe, [v], "What happens?", tmp, device=args.device)
            cap = torch.load(path, weights_only=False)
            heads, oracle = {}, {}
            for layer, t in sorted(cap["layers"].items()):
                q, k = t["q"].float(), t["k"].float()
                L = q.shape[2]
                st = sample_starts(L, args.blocks, 64 // args.row_block * args.row_block
                                   or args.row_block, L // 4, args.row_block,
                                   torch.Generator().manual_seed(0))
                tm = tail_mass(q, k, st, args.rho, 1 / math.sqrt(q.shape[-1]),
                               args.row_block, args.key_block)[0]
                err = _oracle_error(q, k, t["v"].float(), st, args.rho, args.row_block,
                                    args.key_block) if args.oracle else None
                for h in range(tm.shape[0]):
                    heads[f"L{layer}H{h}"] = round(float(tm[h].mean()), 4)
                    if err is not None:
                        oracle[f"L{layer}H{h}"] = round(float(err[h]), 4)
            per_video[v] = {"tokens": int(L), "heads": heads,
                            "mean": round(sum(heads.values()) / len(heads), 4)}
            if oracle:
                per_video[v]["oracle_error"] = oracle
                per_video[v]["oracle_mean"] = round(sum(oracle.values()) / len(oracle), 4)
                print(f"  oracle error, mean {per_video[v]['oracle_mean']:.3f}: " +
                      " ".join(f"{h} {x:.3f}" for h, x in oracle.items()), flush=True)
            print(f"{v}: {L} tokens, mean tail mass {per_video[v]['mean']:.3f}  " +
                  " ".join(f"{h} {x:.2f}" for h, x in heads.items()), flush=True)
            path.unlink()
    res = {"model": args.model, "rho": args.rho, "row_block": args.row_block,
           "key_block": args.key_block, "videos": per_video,
           "mean": round(sum(r["mean"] for r in per_video.values()) / len(per_video), 4)}
    print(f"mean over videos: {res['mean']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
