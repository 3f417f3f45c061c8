"""Served-policy calibration against one-shot scoring: the quality of the configs each gives,
on the embedded model.

    python3 benchmarks/calib_quality.py --out $OUT/calib_quality     # GPU, 16K and 32K tokens
    TRITON_INTERPRET=1 python3 benchmarks/calib_quality.py --tiny --out /tmp/cq     # CPU

``mminfer calibrate`` (and the server's self-calibration) scores each rung of its ladder by the
served policy: the prefix prefilled sparse, estimated from its own last queries, the question's
rows dense over its cache (``mminfer/offline/served_policy.py``). The scoring it replaced ran
one sparse prefill of the whole prompt, estimated from the question's last queries
(``AnswerProbe(one_shot=True)``, ``mminfer/offline/answer_kl.py``). This benchmark measures
what the change buys:

1. **Calibrate twice, on the same videos.** The calibration videos (default: the eight the
   embedded model's shipped config was calibrated on, ``synth:TASK:FRAMES:SEED`` at 2048 and
   4096 frames, about 16K and 32K tokens, seeds 900,000-900,007) go through the vision tower
   once. ``ServedCalibration`` (the code ``mminfer calibrate`` and the server run) takes their
   dense references and captures, runs the per-head search and scores its ladder as served:
   the ``served`` config. A second ``ServedCalibration`` gets the same search's numbers (so the
   same ladder of configs) and scores each rung on the same videos with one-shot prefills
   against a one-shot dense prefill: greedy first token and last-token KL (every answer of
   these tasks is one token), the same thresholds: the ``one_shot`` config. A side that no
   rung holds the thresholds for is evaluated at its tightest rung (what a server would not
   serve; its verdict says ``fail``).
2. **Evaluate both as served.** ``benchmarks/quality.py --configs served.json one_shot.json
   --served-configs`` on its held-out videos (seeds from 500,000, not calibration's): dense
   and each config under the served policy, on one rendering of each video.

Writes to ``--out``: ``served.json`` and ``one_shot.json`` (the configs, each with how it was
scored in its provenance: ``calibration_scoring`` and the rungs' numbers),
``quality/quality.json`` (every example, quality.py's format) and ``calib_quality.json``: per
side the verdict, the per-head bound chosen, the rungs' calibration numbers, the config's
sha256 and the calibration's times (vision tower, dense references, the search, which both
sides share and both totals count, the ladder's scoring); per task (and per task x length)
agreement of the greedy first token with dense, mean last-token KL(dense || config) and mean
density (the whole prompt's causal triangle, the question's rows dense), for both side by side.
It prints the same as a table.

The GPU run (one H100 or H200, the kernels; the evaluation at 16K and 32K tokens, needle
over five depths and two videos per other task per length)::

    python3 benchmarks/calib_quality.py --out $OUT/calib_quality --lengths 16384 32768 \\
        --max-minutes 6

``--tiny`` (CPU, a couple of minutes): two 8-frame calibration videos (77 tokens), the CPU's
ladder (one budget, one mass target, three rungs), the reference engine, one 8-frame held-out
video per task: every piece runs, the numbers mean little.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import quality  # noqa: E402
from mminfer.models.base import PrepareOptions  # noqa: E402
from mminfer.offline.answer_kl import AnswerProbe  # noqa: E402
from mminfer.offline.capture import load_video  # noqa: E402
from mminfer.offline.served_policy import (  # noqa: E402
    SearchSettings, ServedCalibration, ServedRun, Step, compare, keep)
from mminfer.offline.thresholds import MAX_KL, MIN_AGREEMENT  # noqa: E402

TASKS = quality.TASKS
SIDES = ("served", "one_shot")
# the embedded model's shipped config's calibration videos (mminfer/models/configs/README.md)
DEFAULT_VIDEOS = [f"synth:{t}:{f}:{900000 + 4 * i + j}"
                  for i, f in enumerate((2048, 4096))
                  for j, t in enumerate(("needle", "colour", "order", "count"))]
TINY_VIDEOS = ["synth:needle:8:900000", "synth:count:8:900001"]
ONE_SHOT_OBJECTIVE = ("one sparse prefill of the whole prompt under the config, its patterns "
                      "estimated from the question's last queries, against a dense one: the "
                      "greedy first token agrees, last-token KL(dense || sparse)")
_T0 = time.time()


def log(msg):
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


class OneShotCalibration(ServedCalibration):
    """The same calibration (steps, ladder, winner) with each input scored by one prefill of
    its whole prompt instead of as served: its reference is a dense one-shot prefill, each
    rung's run a sparse one (``AnswerProbe(one_shot=True)``), compared on the first answer
    token. ``preps``: input name -> the adapter's Prepared (the one-shot prefill needs the
    whole prompt's ModalityIndex and positions)."""

    def __init__(self, adapter, inputs, preps, **kw):
        super().__init__(adapter, inputs, **kw)
        self.preps = preps
        self.probe = AnswerProbe(adapter, engine=self.engine, block=self.block, one_shot=True)

    def _run(self, inp, patterns) -> ServedRun:
        t0 = time.perf_counter()
        logp, dens = self.probe.logprobs(self.preps[inp.name], inp.embeds.to(self.adapter.device),
                                         patterns)
        self.forwards += 1
        return ServedRun(logits=logp, token_ids=[int(logp.argmax())], density=dens,
                         seconds=time.perf_counter() - t0)

    def reference_step(self, inp) -> Step:
        def fn(cancel):
            inp.reference = self._run(inp, None)
        return Step(f"dense reference of {inp.name}", fn)

    def score(self, inp, patterns, cancel=None) -> dict:
        return compare(inp.reference, self._run(inp, patterns))


def run_timed(cal, cuda: bool) -> dict:
    """Every step of ``cal``, their seconds summed by kind."""
    t = {"references_s": 0.0, "search_s": 0.0, "ladder_s": 0.0}
    for step in cal.steps():
        if step is None:
            continue
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        kind = ("search_s" if step.what.startswith("per-head search") else
                "ladder_s" if step.what.startswith("rung") else "references_s")
        t[kind] += time.perf_counter() - t0
    return {k: round(v, 3) for k, v in t.items()}


def side_config(cal, scoring: str):
    """The winner's config with how it was scored; without a winner the tightest rung
    (verdict ``fail``: what a server would not serve)."""
    if cal.winner is not None:
        cfg = cal.config(made_by=f"benchmarks/calib_quality.py ({scoring} scoring)")
        verdict = "pass"
    else:
        rung = min(cal.rungs, key=lambda r: r.bound)
        cfg = rung.config
        cfg.provenance = dict(cfg.provenance, made_by=f"benchmarks/calib_quality.py "
                              f"({scoring} scoring; no rung held: the tightest)",
                              served_policy={"per_head_bound": rung.bound, "rungs": [
                                  {"bound": r.bound, **r.summary()} for r in cal.rungs
                                  if r.rows]})
        verdict = "fail"
    scored = cfg.provenance.pop("served_policy")
    if scoring == "one-shot":
        scored["objective"] = ONE_SHOT_OBJECTIVE
        scored["max_new_tokens"] = 1            # the first token is all a prefill gives
        scored["density"] = "the whole prompt's plans (answer_kl's: physical tiles)"
    else:
        scored["density"] = "the prefix's plans (served_policy.plans_density)"
    scored["verdict"] = verdict
    cfg.provenance["calibration_scoring"] = scoring
    cfg.provenance["served_policy" if scoring == "served" else "one_shot"] = scored
    return cfg, scored


def calibrate_both(ad, videos, settings, lo, hi) -> tuple:
    """Both calibrations on ``videos``: {side: (config, scored, times)} and the vision
    tower's seconds."""
    cuda = ad.device.type == "cuda"
    t0 = time.perf_counter()
    served_in, one_in, preps = [], [], {}
    for v in videos:
        decoded, question, name = load_video(v, ad, "")
        prep = ad.prepare(decoded, question, PrepareOptions())
        with torch.inference_mode():
            emb = ad.embed(prep)
        inp = keep(ad, prep, emb, name, source="synthetic")
        served_in.append(inp)
        one_in.append(dataclasses.replace(inp))     # its own reference, the same embeddings
        # the one-shot prefill needs the prompt's index and positions, not its pixels (0.6 GB
        # of frames at 4096)
        prep.tensors = {k: v for k, v in prep.tensors.items()
                        if k not in ("frames", "pixel_values", "pixel_values_videos")}
        preps[name] = prep
        log(f"calibration video {name}: {inp.tokens} tokens (prefix {inp.prefix_len})")
    vision_s = round(time.perf_counter() - t0, 3)
    kw = dict(min_agreement=lo, max_kl=hi, settings=settings, log=lambda s: log("  " + s))
    served = ServedCalibration(ad, served_in, **kw)
    log("served-policy scoring: references, search, ladder")
    t_served = run_timed(served, cuda)
    one = OneShotCalibration(ad, one_in, preps, **kw)
    # the same search's numbers: the same ladder of configs, scored the other way
    one.head_config, one.head_report = served.head_config, served.head_report
    one.searched = list(served.searched)
    log("one-shot scoring: references, ladder (the search's numbers are the served side's)")
    t_one = run_timed(one, cuda)
    t_one["search_s"] = t_served["search_s"]
    out = {}
    for side, cal, t in (("served", served, t_served), ("one_shot", one, t_one)):
        cfg, scored = side_config(cal, "served" if side == "served" else "one-shot")
        t["total_s"] = round(vision_s + sum(t.values()), 3)
        out[side] = (cfg, scored, t, cal.forwards)
    return out, vision_s


def per_task(records, lengths) -> dict:
    """Per side, per task and per task x length: agreement of the first token with dense,
    mean KL, mean density, accuracy and the count."""
    out = {}
    for side in SIDES:
        m = f"cfg:{side}"
        rows = {}
        for t in TASKS:
            for n in [None] + list(lengths):
                rs = [r for r in records if r["task"] == t and (n is None or r["tokens"] == n)
                      and m in r["modes"]]
                if not rs:
                    continue
                got = [r["modes"][m] for r in rs]
                rows.setdefault(t, {})["all" if n is None else str(n)] = {
                    "n": len(rs),
                    "agreement": sum(g["answer"] == r["modes"]["dense"]["answer"]
                                     for g, r in zip(got, rs)) / len(rs),
                    "kl": _mean([g["kl"] for g in got]),
                    "density": _mean([g["density"] for g in got]),
                    "accuracy": _mean([g["correct"] for g in got]),
                    "dense_accuracy": _mean([r["modes"]["dense"]["correct"] for r in rs])}
        out[side] = rows
    return out


def _mean(v):
    v = [float(x) for x in v if x is not None]
    return sum(v) / len(v) if v else None


def table(result) -> str:
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)
    L = ["calibration (same videos, same search and ladder; each side's density is its own "
         "scoring's: served over the prefix, one-shot over the whole prompt):",
         f"{'scoring':<10}{'verdict':>8}{'bound':>7}{'agree':>7}{'KL':>8}{'density':>9}"
         f"{'fwd':>5}{'refs s':>8}{'search s':>9}{'ladder s':>9}{'total s':>9}"]
    for side in SIDES:
        c = result["calibration"][side]
        s = c["calibration"] or {}
        t = c["times"]
        L.append(f"{side:<10}{c['verdict']:>8}{c['per_head_bound']:>7g}"
                 f"{f(s.get('agreement'), '{:.2f}'):>7}{f(s.get('mean_kl'), '{:.4f}'):>8}"
                 f"{f(s.get('mean_density')):>9}{c['forwards']:>5}{t['references_s']:>8.1f}"
                 f"{t['search_s']:>9.1f}{t['ladder_s']:>9.1f}{t['total_s']:>9.1f}")
    L += ["", "held-out evaluation, both as served (agreement of the first token with dense, "
          "mean last-token KL(dense || config), density):",
          f"{'task':<8}{'tokens':>7}{'n':>4}  {'agree S':>8}{'agree 1':>8}  {'KL S':>8}"
          f"{'KL 1':>8}  {'dens S':>7}{'dens 1':>7}"]
    ev = result["evaluation"]
    for t in TASKS:
        keys = [k for k in ev["served"].get(t, {}) if k != "all"] + ["all"]
        for k in keys:
            a, b = ev["served"].get(t, {}).get(k), ev["one_shot"].get(t, {}).get(k)
            if a is None or b is None:
                continue
            L.append(f"{t:<8}{k:>7}{a['n']:>4}  {f(a['agreement'], '{:.2f}'):>8}"
                     f"{f(b['agreement'], '{:.2f}'):>8}  {f(a['kl'], '{:.4f}'):>8}"
                     f"{f(b['kl'], '{:.4f}'):>8}  {f(a['density'], '{:.3f}'):>7}"
                     f"{f(b['density'], '{:.3f}'):>7}")
    L.append("S: served-policy scoring's config; 1: one-shot scoring's config")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the embedded model)")
    ap.add_argument("--out", default="out/calib_quality")
    ap.add_argument("--videos", nargs="+", help="calibration videos, synth:TASK:FRAMES:SEED "
                    "(default: the shipped config's eight at 16K and 32K tokens)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768],
                    help="held-out videos' visual tokens (quality.py's --lengths)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--needle-reps", type=int, default=1)
    ap.add_argument("--budget", type=float, nargs="+", help="the search's budgets "
                    "(default: SearchSettings.for_device's, as mminfer calibrate)")
    ap.add_argument("--gamma", type=float, nargs="+", help="the search's mass targets")
    ap.add_argument("--bounds", type=float, nargs="+", help="the ladder's per-head bounds")
    ap.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT)
    ap.add_argument("--max-kl", type=float, default=MAX_KL)
    ap.add_argument("--engine", choices=("auto", "kernel", "reference"), default="auto",
                    help="sparse layers, calibration and evaluation (auto: the kernels on a "
                    "GPU, the reference engine on the CPU)")
    ap.add_argument("--device")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--max-minutes", type=float, default=6.0,
                    help="the evaluation stops taking new videos after this long")
    ap.add_argument("--tiny", action="store_true", help="the CPU setting (see the docstring)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.device = args.device or "cpu"
        args.videos = args.videos or TINY_VIDEOS
        args.lengths, args.depths, args.per_task = [64], [0.5], 1

    from mminfer.engine.pipeline import Pipeline
    from mminfer.models.embedded import default_model
    model = Path(args.model) if args.model else default_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ad = Pipeline(str(model), attention="dense", device=args.device, dtype=args.dtype).adapter
    cuda = ad.device.type == "cuda"
    engine = args.engine if args.engine != "auto" else ("kernel" if cuda else "reference")
    s = SearchSettings.for_device(ad.device)
    settings = dataclasses.replace(
        s, budgets=tuple(args.budget or s.budgets), gammas=tuple(args.gamma or s.gammas),
        bounds=tuple(sorted(args.bounds or s.bounds)), engine=engine)
    videos = args.videos or DEFAULT_VIDEOS
    log(f"{model} on {ad.device} ({ad.dtype}), engine {engine}; calibration videos "
        f"{' '.join(videos)}; ladder {settings.bounds}")
    sides, vision_s = calibrate_both(ad, videos, settings, args.min_agreement, args.max_kl)
    block = list(settings.resolved(ad.device)[1])
    calib = {}
    for side, (cfg, scored, times, forwards) in sides.items():
        path = out / f"{side}.json"
        cfg.save(path)
        calib[side] = {"config": str(path),
                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                       "verdict": scored["verdict"], "per_head_bound": scored["per_head_bound"],
                       "calibration": scored.get("calibration"), "rungs": scored["rungs"],
                       "forwards": forwards, "times": times}
        log(f"{side}: {scored['verdict']}, per-head bound {scored['per_head_bound']:g}; "
            f"wrote {path}")
    result = {"model": str(model), "engine": engine, "block": block,
              "calibration_videos": list(videos), "vision_s": vision_s,
              "thresholds": {"min_agreement": args.min_agreement, "max_kl": args.max_kl},
              "ladder": list(settings.bounds), "budgets": list(settings.budgets),
              "gammas": list(settings.gammas), "calibration": calib, "evaluation": None}
    # written now too: a run stopped during the evaluation keeps its calibrations' numbers
    (out / "calib_quality.json").write_text(json.dumps(result, indent=1, default=str))
    del ad, sides
    if cuda:
        torch.cuda.empty_cache()

    qargs = ["--out", str(out / "quality"), "--configs", str(out / "served.json"),
             str(out / "one_shot.json"), "--served-configs", "--no-config", "--densities",
             "--lengths", *map(str, args.lengths), "--depths", *map(str, args.depths),
             "--per-task", str(args.per_task), "--needle-reps", str(args.needle_reps),
             "--engine", engine, "--block", *map(str, block),
             "--max-minutes", str(args.max_minutes)]
    for flag, v in (("--model", args.model), ("--device", args.device),
                    ("--dtype", args.dtype)):
        if v:
            qargs += [flag, str(v)]
    if args.tiny:
        qargs += ["--workers", "0"]
    log("evaluation: quality.py " + " ".join(qargs))
    q = quality.main(qargs)
    records = q["examples"]
    result.update({
        "device": q["device"], "dtype": q["dtype"],
        "held_out": {"lengths": q["lengths"], "depths": q["depths"],
                     "seeds": sorted(r["seed"] for r in records),
                     "held_out_seeds": q["held_out_seeds"], "stopped": q["stopped"],
                     "configs": q["configs"], "configs_policy": q["configs_policy"],
                     "quality_json": str(out / "quality" / "quality.json")},
        "evaluation": per_task(records, q["lengths"]),
        "agreement_with_dense": {side: q["summary"]["agreement_with_dense"][f"cfg:{side}"]
                                 for side in SIDES}})
    (out / "calib_quality.json").write_text(json.dumps(result, indent=1, default=str))
    print(table(result), flush=True)
    log(f"wrote {out / 'calib_quality.json'}")
    return result


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
