"""Does a checkpoint answer every shipped sample right? The gate a new embedded model passes
before it replaces ``mminfer/models/mminfer-embedded`` (``tests/models/test_embedded.py``
holds the shipped one to the same), run on a candidate folder or a train stage's tarball:

    python3 lab/train/check_samples.py $OUT/model.tar.gz     # a train stage's archive

Prints one line per wrong answer and exits 1 if there is any."""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples" / "videos"


def model_dir(src: Path, tmp: str) -> Path:
    if src.is_dir():
        return src
    with tarfile.open(src) as t:
        t.extractall(tmp, filter="data")
    found = sorted(Path(tmp).glob("*/config.json"))
    if not found:
        raise SystemExit(f"{src}: no <folder>/config.json inside")
    return found[0].parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint folder or .tar.gz of one")
    ap.add_argument("--attention", choices=("dense", "sparse", "auto"), default="dense")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from mminfer.engine.pipeline import Pipeline
    answers = json.loads((SAMPLES / "answers.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        pipe = Pipeline(str(model_dir(Path(args.model), tmp)), attention=args.attention,
                        device=args.device, min_sparse_len=16)
        wrong, slowest = [], 0.0
        for name, d in answers.items():
            t0 = time.perf_counter()
            got = pipe.answer(SAMPLES / name, d["question"]).answer
            slowest = max(slowest, time.perf_counter() - t0)
            if got != d["answer"]:
                wrong.append(name)
                print(f"WRONG {name}: answered {got!r}, the answer is {d['answer']!r}")
    print(f"{len(answers) - len(wrong)} / {len(answers)} samples right "
          f"({args.attention}; slowest {slowest:.2f} s)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
