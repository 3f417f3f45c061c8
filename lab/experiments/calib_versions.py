"""The shipped embedded config's per-head output error on one saved capture, evaluated by the
mminfer of any commit (today's layout or the flat one before 20d8376), to tell a change of code
from a change of data. Capture with today's code, then evaluate with both:

    python -c "from mminfer.offline.capture import capture_qkv; capture_qkv(
        'mminfer/models/mminfer-embedded', ['synth:needle:512:900000'], '', '/tmp/caps', device='cpu')"
    git worktree add /tmp/old 1158fdb
    TRITON_INTERPRET=1 python lab/experiments/calib_versions.py /tmp/caps/synth-needle-512-900000.pt
    TRITON_INTERPRET=1 OLD_ROOT=/tmp/old python lab/experiments/calib_versions.py /tmp/caps/synth-needle-512-900000.pt

OLD_ROOT puts that tree's mminfer first (an editable install's finder is dropped so it cannot
win). Reference engine: a capture of at most 4096 tokens.
"""
import os
import sys

if os.environ.get("OLD_ROOT"):
    sys.meta_path[:] = [f for f in sys.meta_path if "ditable" not in type(f).__name__
                        and "ditable" not in str(f)]
    sys.path.insert(0, os.environ["OLD_ROOT"])

try:
    from mminfer.offline import calibrate as C
    from mminfer.sparse.patterns import HeadPatternConfig
except ImportError:                  # the flat layout of the first commits
    from mminfer import calibrate as C
    from mminfer.patterns import HeadPatternConfig

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(HERE, "mminfer/models/mminfer-embedded/mminfer_patterns.json")


def main():
    cfg = HeadPatternConfig.load(sys.argv[2] if len(sys.argv) > 2 else CONFIG)
    cap = C.load_captures([sys.argv[1]])[0]
    print("mminfer from", C.__file__, "n", cap.n)
    for layer in sorted(cap.layers):
        q, k, v = (t.float() for t in cap.layers[layer])
        ref = C.dense_reference(q, k, v, cap.scale)
        # a config that sets estimation is read as serving reads it (mminfer before the
        # setting existed has neither the field nor the argument)
        spread = {"spread_q": cfg.spread_queries} if getattr(cfg, "spread_queries", 0) else {}
        r = C.evaluate(q, k, v, cap.index, cfg.layer(layer), ref, engine="reference",
                       block_m=128, block_n=64, scale=cap.scale, **spread)
        print("layer", layer, "error", [round(x, 3) for x in r["error"].tolist()],
              "density", [round(float(x), 3) for x in r["density"]], flush=True)


if __name__ == "__main__":
    main()
