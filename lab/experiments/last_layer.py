"""What running only the last row of the last decoder layer saves (models/prefill.py), through
``Pipeline.answer``, the path the CLI, the server and batch run. One Pipeline, one video;
requests alternate between the prefill as served and every row of
the last layer (True), in each attention mode, so every ratio comes from requests side by side
in one process. The answers must be the same: a different one is reported and fails the run.

    python lab/experiments/last_layer.py --model qwen7b --frames 384 --out out/last_layer  # H200
    python lab/experiments/last_layer.py --model embedded --frames 4096 --out out/last_layer
    python lab/experiments/last_layer.py --tiny --out /tmp/last_layer                      # CPU

``--model``: a checkpoint folder, ``embedded`` (the shipped model) or ``qwen7b``
(Qwen2.5-VL-7B's shapes with random weights, written under ``--work`` by benchmarks/e2e.py's
writer; ``--tiny``: the test checkpoint's shapes). The video is e2e.py's synthetic one.
Prints a table of the median prefill (index + attention + llm_other) and TTFT per mode, and
writes ``last_layer.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mminfer.models.hooks import PrefillContext


class EveryRow(PrefillContext):
    """The prefill with every row of its last layer (the product computes the last one only)."""

    def every_row(self) -> bool:
        return True

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its e2e.py

QUESTION = "what is moving in the video ?"


def checkpoint(name: str, work: Path, device: str, tiny: bool) -> str:
    if name == "embedded":
        from mminfer.models.embedded import default_model
        return default_model()
    if name != "qwen7b":
        return name
    from e2e import write_qwen
    path = work / ("qwen-tiny" if tiny else "qwen7b")
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        write_qwen(path, device, tiny=tiny)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return str(path)


def prefill_ms(t: dict) -> float:
    return sum(t.get(k, 0.0) for k in ("index", "attention", "llm_other"))


def run(pipe, video: str, frames: int, modes, reps: int, max_new_tokens: int, log) -> dict:
    rows = {m: {"served": [], "full": []} for m in modes}
    answers = {}
    for r in range(reps + 1):                  # round 0 warms each mode and setting up
        for mode in modes:
            for setting in ("served", "full"):
                pipe.prefill_context = EveryRow if setting == "full" else PrefillContext
                # every request prefills (a video-cache hit would skip what is measured)
                res = pipe.answer(video, QUESTION, max_frames=frames, attention=mode,
                                  max_new_tokens=max_new_tokens, use_cache=False)
                answers.setdefault(mode, {}).setdefault(setting, res.answer)
                if answers[mode][setting] != res.answer:
                    raise SystemExit(f"{mode}/{setting}: the answer changed between requests")
                t = res.timings_ms
                rec = {"prefill_ms": round(prefill_ms(t), 3), "ttft_ms": t["ttft"],
                       "total_ms": t["total"], "attention_ran": res.attention,
                       "tokens": res.tokens.get("total"),
                       "last_row_only": (res.sparsity or {}).get("last_row_only")}
                log(f"round {r} {mode:6s} {setting:6s} prefill {rec['prefill_ms']:9.1f} ms "
                    f"ttft {t['ttft']:9.1f} ms  tokens {rec['tokens']}")
                if r:
                    rows[mode][setting].append(rec)
    pipe.prefill_context = PrefillContext
    out = {}
    for mode, by in rows.items():
        med = {s: {k: statistics.median(x[k] for x in recs) for k in ("prefill_ms", "ttft_ms")}
               for s, recs in by.items()}
        out[mode] = {
            "requests": by, "median": med,
            "same_answer": answers[mode]["served"] == answers[mode]["full"],
            "answer": answers[mode]["served"],
            "prefill_full_over_served": med["full"]["prefill_ms"] / med["served"]["prefill_ms"],
            "ttft_full_over_served": med["full"]["ttft_ms"] / med["served"]["ttft_ms"]}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen7b")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes")
    ap.add_argument("--frames", type=int, default=384)
    ap.add_argument("--size", type=int, nargs=2, default=(840, 1120), metavar=("H", "W"))
    ap.add_argument("--modes", nargs="+", default=["sparse", "dense"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--work", default="/tmp/mminfer_last_layer")
    ap.add_argument("--out", default="out/last_layer")
    a = ap.parse_args(argv)
    import torch
    from e2e import write_video
    from mminfer.engine.pipeline import Pipeline
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.tiny:
        a.frames, a.size, a.reps = min(a.frames, 16), (56, 84), min(a.reps, 1)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(a.model, work, device, a.tiny)
    video = work / f"v_{a.frames}f_{a.size[1]}x{a.size[0]}.mp4"
    if not video.exists():
        write_video(video, a.frames, a.size[0], a.size[1], fps=2.0)
    pipe = Pipeline(ckpt, device=device, min_sparse_len=0)
    modes = [m for m in a.modes if m != "sparse" or pipe.sparse_unavailable is None]
    res = run(pipe, str(video), a.frames, modes, a.reps, a.max_new_tokens,
              lambda s: print(s, flush=True))
    label = a.model + (" (tiny)" if a.tiny else "")
    rep = {"date": time.strftime("%Y-%m-%d"), "model": label, "checkpoint": str(ckpt),
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "layers": pipe.adapter.identity.layers, "frames": a.frames, "size": a.size,
           "reps": a.reps, "modes": res}
    (out / "last_layer.json").write_text(json.dumps(rep, indent=1))
    print(f"\n{label}, {pipe.adapter.identity.layers} layers, {a.frames} frames; medians of "
          f"{a.reps} requests (ms)")
    print("| mode | tokens | prefill, served | prefill, every row | ratio | TTFT, served | "
          "TTFT, every row | ratio | same answer |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for mode, r in res.items():
        m = r["median"]
        print(f"| {mode} | {r['requests']['served'][0]['tokens']} | "
              f"{m['served']['prefill_ms']:.1f} | {m['full']['prefill_ms']:.1f} | "
              f"{r['prefill_full_over_served']:.3f} | {m['served']['ttft_ms']:.1f} | "
              f"{m['full']['ttft_ms']:.1f} | {r['ttft_full_over_served']:.3f} | "
              f"{r['same_answer']} |")
    if not all(r["same_answer"] for r in res.values()):
        raise SystemExit("the answers differ with and without the last layer's other rows")


if __name__ == "__main__":
    main()
