"""One short device call (issue 14): the shipped embedded config's per-head output error on a
current capture (the error `mminfer calibrate` bounds), beside calibrate's own vertical-slash
candidate at budget 0.25, with the fused and the PyTorch proxy.

    python3 benchmarks/calibration_check.py --frames 2048 --device cuda
"""
import argparse
import json

from mminfer.offline import calibrate as C
from mminfer.offline.capture import capture_qkv
from mminfer.sparse.patterns import HeadPatternConfig

MODEL = "mminfer/models/mminfer-embedded"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=2048)
    ap.add_argument("--task", default="needle")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = HeadPatternConfig.load(f"{MODEL}/mminfer_patterns.json")
    paths = capture_qkv(MODEL, [f"synth:{a.task}:{a.frames}:900000"], "", "/tmp/calcheck",
                        device=a.device)
    cap = C.load_captures(paths)[0]
    rows = []
    cuda = a.device.startswith("cuda")
    bm, bn = (128, 64) if cuda else (16, 16)
    cand = C.candidate_patterns(cap.index, cap.n, 0.25, block_m=bm, block_n=bn)["vertical_slash"]
    for layer in sorted(cap.layers):
        q, k, v = (t.to(a.device) for t in cap.layers[layer])
        ref = C.dense_reference(q.float(), k.float(), v.float(), cap.scale)
        for label, heads in (("shipped", cfg.layer(layer)), ("vs@0.25", [cand] * q.shape[1])):
            for proxy in ("triton", "torch") if cuda else ("torch",):
                r = C.evaluate(q, k, v, cap.index, heads, ref, engine="kernel",
                               block_m=bm, block_n=bn, scale=cap.scale, proxy=proxy,
                               spread_q=cfg.spread_queries if label == "shipped" else 0)
                row = {"layer": layer, "config": label, "proxy": proxy, "n": cap.n,
                       "error": [round(x, 4) for x in r["error"].tolist()],
                       "mass": [round(x, 4) for x in r["mass"].tolist()],
                       "density": [round(float(x), 4) for x in r["density"]]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
