"""Write the sample videos of the synthetic tasks and their answers.

    python scripts/make_samples.py [--out samples/videos] [--per-task 3]

Each video is 10 s at 2 fps (20 frames), 224x224, H.264: Qwen sampling at its default
2 fps keeps every frame, so no needle or flash can fall between samples.
answers.json maps file name -> {task, question, answer, seed}.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mminfer.offline import synthetic as synth

FPS = 2.0
SECONDS = 10
SIZE = 224
SEED0 = 1000  # kept apart from the small seeds used in tests and training


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "samples" / "videos")
    ap.add_argument("--per-task", type=int, default=3)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    answers = {}
    for task in synth.TASKS:
        for k in range(args.per_task):
            seed = SEED0 + k
            ex = synth.make_example(task, seed, n_frames=int(FPS * SECONDS), height=SIZE,
                                    width=SIZE)
            name = f"{task}_{k}.mp4"
            synth.write_mp4(ex.frames, args.out / name, fps=FPS)
            answers[name] = {"task": task, "question": ex.question, "answer": ex.answer,
                             "seed": seed}
    (args.out / "answers.json").write_text(json.dumps(answers, indent=2) + "\n")
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {len(answers)} videos to {args.out} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
