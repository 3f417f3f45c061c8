"""How spread a model's attention is, per layer and head: the tail mass of mminfer.toy.sharpen
(the attention mass outside the top ``rho`` share of causal key blocks, per block of
query rows; blocks of 1 and 1: per row and key) on the
dense prefill of real inputs. Sparse prefill can only be exact where this is small; the
number to watch before and after training with ``--sharpen``.

    python3 benchmarks/tail_mass.py --model mminfer/models/mminfer-embedded \
        --videos synth:count:512:900001 synth:needle:512:900000 --out /tmp/tail.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--videos", nargs="+", required=True,
                   help="video files or synth:TASK:FRAMES:SEED sources")
    p.add_argument("--rho", type=float, default=0.05)
    p.add_argument("--blocks", type=int, default=16, help="random row blocks per video")
    p.add_argument("--row-block", type=int, default=64)
    p.add_argument("--key-block", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="JSON file for the table")
    args = p.parse_args(argv)

    import torch

    from mminfer.engine.pipeline import Pipeline
    from mminfer.offline.capture import capture_qkv
    from mminfer.toy.sharpen import sample_starts, tail_mass

    pipe = Pipeline(args.model, attention="dense", device=args.device)
    per_video = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.videos:
            (path,) = capture_qkv(pipe, [v], "What happens?", tmp, device=args.device)
            cap = torch.load(path, weights_only=False)
            heads = {}
            for layer, t in sorted(cap["layers"].items()):
                q, k = t["q"].float(), t["k"].float()
                L = q.shape[2]
                st = sample_starts(L, args.blocks, 64 // args.row_block * args.row_block
                                   or args.row_block, L // 4, args.row_block,
                                   torch.Generator().manual_seed(0))
                tm = tail_mass(q, k, st, args.rho, 1 / math.sqrt(q.shape[-1]),
                               args.row_block, args.key_block)[0]
                for h in range(tm.shape[0]):
                    heads[f"L{layer}H{h}"] = round(float(tm[h].mean()), 4)
            per_video[v] = {"tokens": int(L), "heads": heads,
                            "mean": round(sum(heads.values()) / len(heads), 4)}
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
