"""Where the time between two batched decode steps goes: N answers about one cached video
decode together through the server's path (``Pipeline.answer`` on N threads, each with a
mminfer.engine.scheduler Turn; their steps batched by ``Turn.decode`` into ``step_batch``),
and each batched step's start and end are recorded. The *gap* is the time from the end of one
batched step to the start of the next: the scheduler's hand-over and every answer's own work
between its tokens (the token's readback, sampling, the cancel check, detokenising, the
``on_token`` callback), serialised by the GIL. The step itself is the model's; the gap is what
serving many answers at once adds to it.

Reported per N (default 1, 2, 4, 8): batched steps, mean answers a step, the gap's median, mean
and p90 between two full steps (all N answers in both), the step's median, the scheduler's
gather waits (steps that began after waiting the whole ``gather_s`` for an answer that was not
back yet), the questions' suffix prefills (median ms; they run one at a time before their
answers decode) and the steps' summed time against the wall time of the N answers.

Every answer decodes all ``--tokens`` (end tokens are off: the steps are what is measured).
On a GPU, ``--device cuda --model CKPT --clip LONG.mp4`` measures the same path over a long
cache (a step's end is its host read of the tokens, so the times are the device's).

    PYTHONPATH=$PWD python benchmarks/step_gap.py                 # CPU, embedded model, ~1 min
    PYTHONPATH=$PWD python benchmarks/step_gap.py --tokens 48 --answers 1 8 --out gap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.engine import pipeline as pipeline_mod  # noqa: E402
from mminfer.engine.scheduler import Scheduler  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLIP = REPO / "samples" / "videos" / "needle_0.mp4"
QUESTIONS = ["What number appears in the video?", "What color is the ball?",
             "How many red flashes are there?", "Describe the video.",
             "What happens at the end?", "Is there any text?", "What moves first?",
             "Where is the square?"]


def _timed_step_batch(log):
    real = pipeline_mod.step_batch

    def step_batch(adapter, items):
        t0 = time.perf_counter()
        try:
            return real(adapter, items)
        finally:
            log.append((t0, time.perf_counter(), len(items)))

    return real, step_batch


def measure(pipe, n: int, tokens: int, clip: Path, temperature: float = 0.0,
            stagger: int = 0, sampling: dict | None = None,
            gather_s: float | None = None) -> dict:
    """N answers about ``clip`` (cached) decoding together: the gaps between their steps
    (``temperature`` > 0: each answer sampled, seeded by its index; answer i asks for
    ``tokens - i * stagger`` tokens, so they end one after another; ``sampling``: the
    video's fps and max_frames, as the cached one was asked; ``gather_s``: the scheduler's
    window for a batch's late answers, its default when None)."""
    from mminfer.models.sampler import SamplingParams
    sched = Scheduler() if gather_s is None else Scheduler(gather_s=gather_s)
    log: list = []
    real, timed = _timed_step_batch(log)
    results, errors, texts = [None] * n, [], [[] for _ in range(n)]
    hold = sched.turn("hold")          # the model held until all N wait for it
    assert hold.acquire()

    def ask(i):
        turn = sched.turn(f"a{i}")
        try:
            results[i] = pipe.answer(clip, QUESTIONS[i % len(QUESTIONS)], **(sampling or {}),
                                     max_new_tokens=max(tokens - i * stagger, 2), turn=turn,
                                     on_token=lambda text, tid: texts[i].append(tid),
                                     sampling_params=SamplingParams(
                                         temperature=temperature, seed=i)
                                     if temperature else None)
        except BaseException as e:     # noqa: BLE001 - reported
            errors.append(e)
        finally:
            turn.close()

    pipeline_mod.step_batch = timed
    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        while len(sched._waiting) < n:
            time.sleep(0.01)
        t0 = time.perf_counter()
        hold.close()
        for th in threads:
            th.join(600)
        wall = time.perf_counter() - t0
    finally:
        pipeline_mod.step_batch = real
    if errors:
        raise errors[0]
    full = [(a, b) for a, b in zip(log, log[1:]) if a[2] == n and b[2] == n]
    gaps = sorted((b[0] - a[1]) * 1e3 for a, b in full)
    steps = sorted((e - s) * 1e3 for s, e, _ in log)
    generated = [r.tokens["generated"] for r in results]

    def pct(xs, q):
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    return {"answers": n, "generated": generated, "batches": len(log),
            "mean_batch": round(sum(k for *_, k in log) / max(len(log), 1), 2),
            "full_pairs": len(full),
            "gap_ms_median": round(statistics.median(gaps), 3) if gaps else None,
            "gap_ms_mean": round(statistics.mean(gaps), 3) if gaps else None,
            "gap_ms_p90": pct(gaps, 0.9),
            "step_ms_median": round(statistics.median(steps), 3) if steps else None,
            "gather_timeouts": sched.state().get("decode_gather_timeouts"),
            # each question's rows over the cached prefix: FIRST work, one at a time, inside
            # the wall (with the steps: what N answers asked together wait for)
            "suffix_ms_median": round(statistics.median(
                r.timings_ms.get("suffix", 0.0) for r in results), 3),
            "suffix_ms": [round(r.timings_ms.get("suffix", 0.0), 3) for r in results],
            "steps_s": round(sum(e - s_ for s_, e, _ in log), 3),
            "wall_s": round(wall, 3), "token_ids": [[t for t in x if t is not None] for x in texts]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=32, help="max_new_tokens of each answer")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: every answer sampled (seeded), its sampler run on each step's "
                         "logits")
    ap.add_argument("--stagger", type=int, default=0,
                    help="answer i asks for --tokens minus i times this (they end apart)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per N (the best median kept)")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clip", default=str(CLIP))
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--max-frames", type=int, default=768)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's CPU threads (a machine shared with other work: 1 gives steady "
                         "figures, a team of several stalls when another process holds a core)")
    ap.add_argument("--gather-s", type=float, default=None,
                    help="how long a batched step waits for an answer not back yet (default: "
                         "the scheduler's; a long one shows whether the last answer back wakes "
                         "the step, whatever the machine's load)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from mminfer.engine.pipeline import Pipeline
    from mminfer.serve.worker import SWITCH_INTERVAL_S
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.setswitchinterval(SWITCH_INTERVAL_S)        # as the server's model worker runs
    pipe = Pipeline(args.model, attention="dense", device=args.device)
    clip = Path(args.clip)
    sampling = {"fps": args.fps, "max_frames": args.max_frames}
    pipe.answer(clip, QUESTIONS[0], **sampling, max_new_tokens=2)      # cached, warm
    # every answer decodes all its tokens (the embedded model's answers end in a few): the
    # steps to measure, not the answers' words
    pipe.adapter.eos_token_ids = ()
    rows = []
    for n in args.answers:
        runs = [measure(pipe, n, args.tokens, clip, args.temperature, args.stagger, sampling,
                        gather_s=args.gather_s) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["gap_ms_median"] if r["gap_ms_median"] is not None
                   else float("inf"))
        rows.append(best)
        print(f"N={n:2d}  batches {best['batches']:4d}  mean batch {best['mean_batch']:5.2f}  "
              f"gap ms median {best['gap_ms_median']}  mean {best['gap_ms_mean']}  "
              f"p90 {best['gap_ms_p90']}  step ms median {best['step_ms_median']}  "
              f"gather timeouts {best['gather_timeouts']}  suffix ms median "
              f"{best['suffix_ms_median']}  steps {best['steps_s']} s  wall {best['wall_s']} s",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "tokens": args.tokens,
                                              "temperature": args.temperature,
                                              "stagger": args.stagger,
                                              "threads": torch.get_num_threads()}, indent=1))


if __name__ == "__main__":
    main()
