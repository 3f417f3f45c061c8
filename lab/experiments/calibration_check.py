"""One short device call (issue 14): the shipped embedded config's per-head output error on a
current capture (the error `mminfer calibrate` bounds), beside calibrate's own vertical-slash
candidate at budget 0.25, with the fused and the PyTorch proxy; ``--spread`` measures that
candidate once per number of spread queries (``estimation.spread_queries``).

    python3 lab/experiments/calibration_check.py --frames 2048 --device cuda
    # on a CPU, any model: exact masked attention by row chunks, GPU tiles (128 x 64)
    python3 lab/experiments/calibration_check.py --model DIR --task count --frames 1024 \
        --seed 900003 --device cpu --spread 0 64 --out /tmp/check.json
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mminfer.offline import calibrate as C  # noqa: E402
from mminfer.offline.capture import capture_qkv  # noqa: E402
from mminfer.sparse.patterns import HeadPatternConfig  # noqa: E402

MODEL = "mminfer/models/mminfer-embedded"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--frames", type=int, default=2048)
    ap.add_argument("--task", default="needle")
    ap.add_argument("--seed", type=int, default=900000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--spread", type=int, nargs="+", default=[0],
                    help="spread queries for the vs@0.25 candidate, one row set per value")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = HeadPatternConfig.load(f"{a.model}/mminfer_patterns.json")
    paths = capture_qkv(a.model, [f"synth:{a.task}:{a.frames}:{a.seed}"], "", "/tmp/calcheck",
                        device=a.device)
    cap = C.load_captures(paths)[0]
    rows = []
    cuda = a.device.startswith("cuda")
    bm, bn = 128, 64
    cand = C.candidate_patterns(cap.index, cap.n, 0.25, block_m=bm, block_n=bn)["vertical_slash"]
    for layer in sorted(cap.layers):
        q, k, v = (t.to(a.device) for t in cap.layers[layer])
        ref = C.dense_reference(q.float(), k.float(), v.float(), cap.scale)
        runs = [("shipped", cfg.layer(layer), cfg.spread_queries)]
        runs += [(f"vs@0.25 spread {s}" if s else "vs@0.25", [cand] * q.shape[1], s)
                 for s in a.spread]
        for label, heads, spread in runs:
            for proxy in ("triton", "torch") if cuda else ("torch",):
                r = C.evaluate(q, k, v, cap.index, heads, ref,
                               engine="kernel" if cuda else "reference", block_m=bm,
                               block_n=bn, scale=cap.scale, proxy=proxy, spread_q=spread)
                row = {"layer": layer, "config": label, "proxy": proxy, "n": cap.n,
                       "error": [round(x, 4) for x in r["error"].tolist()],
                       "mass": [round(x, 4) for x in r["mass"].tolist()],
                       "density": [round(float(x), 4) for x in r["physical"]]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
