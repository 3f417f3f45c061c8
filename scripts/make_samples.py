"""Write the sample videos of the synthetic tasks and their answers.

    python scripts/make_samples.py [--out samples/videos] [--per-task 3] [--long-seconds 32]

Each video is 10 s at 2 fps (20 frames), 224x224, H.264: Qwen sampling at its default
2 fps keeps every frame, so no needle or flash can fall between samples. ``needle_long.mp4``
(32 s, 535 tokens for the embedded model) is long enough that sparse attention skips work
(density about 0.7) while the Triton interpreter still runs it on a CPU in a minute or two.
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
LONG_SECONDS = 32


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "samples" / "videos")
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--long-seconds", type=float, default=LONG_SECONDS,
                    help="length of needle_long.mp4 (0: not written)")
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
    if args.long_seconds > 0:
        ex = synth.make_example("needle", SEED0, n_frames=int(FPS * args.long_seconds),
                                height=SIZE, width=SIZE)
        synth.write_mp4(ex.frames, args.out / "needle_long.mp4", fps=FPS)
        answers["needle_long.mp4"] = {"task": "needle", "question": ex.question,
                                      "answer": ex.answer, "seed": SEED0}
    (args.out / "answers.json").write_text(json.dumps(answers, indent=2) + "\n")
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {len(answers)} videos to {args.out} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
