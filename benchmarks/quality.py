"""Sparse vs dense answer quality of the embedded model on held-out synthetic videos.

    python3 benchmarks/quality.py --out $OUT/quality            # H200, about 2 minutes
    TRITON_INTERPRET=1 python3 benchmarks/quality.py --lengths 256 512 --depths 0 1 \
        --per-task 1 --densities 0.5 --out /tmp/quality         # CPU, tiny grid

Held-out videos: ``mminfer.offline.synthetic`` examples with seeds in [500,000, 800,000) (training uses
seeds >= 1,000,000 and private random streams, its periodic evaluation [800,000, 801,000),
the shipped samples 1000-1002), drawn at 224 x 224 and resized to 112 x 112 with the
adapter's own resize (the pixels an mp4 of them would give, minus the codec), at lengths of
~1K to 32K visual tokens (16 tokens per pair of frames at 2 fps). The needle task is swept
over depths (0 = first frame, 1 = last); colour, count and order get ``--per-task`` videos
per length. Videos are fed to the model directly (no mp4): the adapter's ``prepare`` builds
the prompt, M-RoPE positions and ModalityIndex; the vision tower runs batched over frame
pairs; then one prefill per attention mode, through mminfer's attention hook:

* ``dense``: SDPA;
* ``prefix``: sparse with the model's own head-pattern config as ``mminfer answer`` runs it
  since the video cache: the prefix (up to the end of the video) prefilled sparse with its
  patterns estimated from the prefix's own last queries, the question's rows dense over
  every key (``Adapter.prefill_prefix`` + ``Adapter.continue_on``): the same for every
  question, so a cached prefix serves them all;
* ``config``: sparse with the same config over the whole prompt in one pass, estimated from
  the prompt's last queries, which are the question's (the policy before the video cache);
* ``cfg:<stem>``: sparse with each config file of ``--configs`` (several configs compared on
  one rendering of each video), as ``config`` runs the model's own (one pass), or as
  ``prefix`` does with ``--served-configs`` (the served policy); ``quality.json`` gives each
  file's sha256 (``configs``);
* ``d=0.10`` ...: sparse with every head's pattern (its kind, boundary and regions kept)
  re-sized by ``mminfer.offline.calibrate.resize_config`` to that density of the causal
  triangle at the example's length. The measured density (logical pairs, kernel count mode)
  is reported next to it;
* ``fp8`` (``--fp8``): dense attention on the same model loaded with
  ``quantization="fp8"`` (FP8 linear layers, its own vision tower pass): its agreement with
  ``dense`` and KL(dense || fp8) measure what FP8 costs.

The answer is the greedy first token (every answer of these tasks is one token); each
sparse mode's last-token distribution is compared with dense's, KL(dense || mode) in nats.
Writes ``quality.json`` (every example; per mode: accuracy by task and length, agreement
with dense, density per length, per task and per task x length, KL per task and per task x
length, and the same per task over the lengths >= ``--long-from``), ``quality_needle.png``
(V-NIAH-style heatmaps, length x depth, one panel per mode) and ``tables.md`` (those tables
in markdown, for BENCHMARKS.md), and prints them.

``--renderer eval`` draws the videos with ``lab.toy.render_eval`` (320 x 240 frames,
which the adapter makes 84 x 112: 12 visual tokens a pair, so a "32768" video of 2048 pairs
holds 24,576 visual tokens; the tables give the real count) instead of synth: a renderer
neither training nor calibration uses (calibration videos are synth, seeds 900,000+). ``--max-minutes`` stops taking new examples (the grid is
ordered so that a cut run still covers every length).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from mminfer.offline.answer_kl import kl_divergence as _kl  # noqa: E402
from mminfer.offline.calibrate import resize_config  # noqa: E402
from lab.toy import embedded as E  # noqa: E402

TASKS = ("needle", "colour", "count", "order")
_T0 = time.time()


def log(msg):
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------- examples
def grid_specs(lengths, depths, needle_reps, per_task, tasks, seed0):
    """Example specs, ordered round by round so that a run cut short still covers every
    length (round r holds the r-th repetition of every cell)."""
    specs = []
    rounds = max(needle_reps, per_task)
    k = 0
    for r in range(rounds):
        for tokens in lengths:
            n_frames = 2 * max(1, round(tokens / E.TOKENS_PER_PAIR))
            for task in tasks:
                if task == "needle":
                    if r >= needle_reps:
                        continue
                    for d in depths:
                        specs.append({"task": task, "tokens": tokens, "n_frames": n_frames,
                                      "depth": float(d), "seed": seed0 + k})
                        k += 1
                elif r < per_task:
                    specs.append({"task": task, "tokens": tokens, "n_frames": n_frames,
                                  "depth": None, "seed": seed0 + k})
                    k += 1
    if seed0 + k > E.HELDOUT_SEED_MAX:
        raise ValueError("grid too large for the held-out seed range")
    return specs


def _init_worker():
    # SIGINT (timeout -s INT signals the whole group) is the main process's to handle: a
    # worker killed by it leaves the pool unable to terminate, and the run then dies by
    # SIGKILL with nothing written
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    E.use_bundled_fonts()


def render(spec):
    kw = {"depth": spec["depth"]} if spec["task"] == "needle" else {}
    if spec.get("renderer") == "eval":      # the evaluation-only renderer, its own sizes
        from lab.toy import render_eval
        ex = render_eval.make_example(spec["task"], spec["seed"], n_frames=spec["n_frames"],
                                      **kw)
        if "style" in ex.meta:      # the needle's digit look: which looks a model fails on
            spec = {**spec, "look": ex.meta["style"]}
        return spec, ex.frames, ex.answer, ex.question
    frames, answer, question, meta = E.render_example(spec["task"], spec["seed"],
                                                      spec["n_frames"], **kw)
    return spec, frames, answer, question


def rendered(specs, workers):
    if workers <= 0:
        for s in specs:
            yield render(s)
        return
    import multiprocessing as mp
    try:
        pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker)
    except (OSError, RuntimeError, ImportError) as e:     # e.g. no /dev/shm semaphores
        log(f"no worker processes ({type(e).__name__}: {e}); rendering in this process")
        for s in specs:
            yield render(s)
        return
    try:
        yield from pool.imap(render, specs)
    finally:
        stop_pool(pool)


def stop_pool(pool, wait_s: float = 10.0) -> bool:
    """Stop the rendering pool within about ``wait_s`` s; False when it had to kill the
    workers. ``Pool.terminate`` can deadlock when it comes mid-run (a SIGINT in ``imap``): a
    worker blocked writing a large rendered video into the full result pipe holds the lock
    that terminate's own sentinel needs, and nothing reads the pipe any more. The run must
    still write its tables, so terminate gets ``wait_s`` s in a thread of its own; then the
    workers are killed (which lets a blocked terminate finish) and the run goes on."""
    import multiprocessing as mp
    import threading
    t = threading.Thread(target=pool.terminate, name="pool-terminate", daemon=True)
    t.start()
    t.join(wait_s)
    if not t.is_alive():
        pool.join()
        return True
    for child in mp.active_children():
        child.kill()
    log(f"the rendering pool did not stop in {wait_s:g} s: its workers were killed")
    t.join(wait_s)
    return False


# ------------------------------------------------------------------------- model
class Runner:
    def __init__(self, model_dir, device, dtype, engine="kernel", block=None,
                 quantization=None):
        from mminfer.engine.pipeline import Pipeline
        self.pipe = Pipeline(str(model_dir), attention="dense", device=device, dtype=dtype,
                             quantization=quantization)
        self.ad = self.pipe.adapter
        cuda = self.ad.device.type == "cuda"
        self.block_m, self.block_n = block or ((128, 64) if cuda else (16, 16))
        self.engine = engine
        self.answer_ids = E.answer_ids(self.ad.tokenizer)

    def prepare(self, frames, question):
        from mminfer.video import DecodedVideo
        return self.ad.prepare(DecodedVideo.from_frames(frames), question)

    @torch.inference_mode()
    def embeds(self, prep):
        return self.ad.embed(prep)          # the batched tower (mminfer.models.vision)

    @torch.inference_mode()
    def first_token_prefix(self, prep, embeds, patterns, density: bool):
        """The shipped policy: the prefix sparse (its own estimate), the suffix dense."""
        from mminfer.models.hooks import PrefillContext
        ad = self.ad
        P, L = prep.prefix_len, prep.input_ids.shape[1]
        ctx = PrefillContext(index=prep.prefix_index, patterns=patterns, mode="sparse",
                             min_sparse_len=0, keep_plans=True, engine=self.engine,
                             block=(self.block_m, self.block_n))
        kv = ad.prefill_prefix(prep, embeds.clone(), ctx=ctx, headroom=L - P)
        h = ad._step(embeds[:, P:], ad.positions_after(prep.rope_delta, P, L - P), kv)
        logits = ad.lm_head(h[:, -1]).float()[0]
        dens = None
        if density and ctx.densities:
            vals = []
            for plan in ctx.densities.values():
                d = plan.density()
                vals.append(float(d["logical"]) if isinstance(d, dict) else float(d))
            # over the whole prompt's causal triangle: the suffix's rows are dense
            tri = lambda n: n * (n + 1) / 2      # noqa: E731
            dens = (sum(vals) / len(vals) * tri(P) + tri(L) - tri(P)) / tri(L)
        return int(logits.argmax(-1)), dens, bool(ctx.densities), \
            torch.log_softmax(logits, -1).cpu()

    @torch.inference_mode()
    def first_token(self, prep, embeds, patterns, sparse: bool, density: bool):
        from mminfer.models.hooks import PrefillContext, prefill_context
        ad = self.ad
        L = prep.input_ids.shape[1]
        ctx = PrefillContext(index=prep.index, patterns=patterns,
                             mode="sparse" if sparse else "dense", min_sparse_len=0,
                             keep_plans=True, engine=self.engine,
                             block=(self.block_m, self.block_n))
        with prefill_context(ctx):
            h = ad.text_model(inputs_embeds=embeds, position_ids=ad.positions(prep, 0, L),
                              use_cache=False).last_hidden_state
        logits = ad.lm_head(h[:, -1]).float()[0]
        tok = int(logits.argmax(-1))
        dens = None
        if sparse and density and ctx.densities:
            vals = []
            for plan in ctx.densities.values():
                d = plan.density()
                vals.append(float(d["logical"]) if isinstance(d, dict) else float(d))
            dens = sum(vals) / len(vals)
        return tok, dens, bool(ctx.densities), torch.log_softmax(logits, -1).cpu()


# ------------------------------------------------------------------------- report
def kl_divergence(p_log, q_log):
    """KL(p || q) in nats of two log-probability rows (None without both)."""
    if p_log is None or q_log is None:
        return None
    return _kl(p_log, q_log)


def summarise(records, modes, lengths, depths, long_from: int = 16384):
    """Accuracy per task x length x mode, the needle grid, agreement with dense, and per
    mode: density per length, per task and per task x length; last-token KL(dense || mode)
    per task and per task x length; each also over the lengths >= ``long_from``."""
    out = {"accuracy": {}, "agreement_with_dense": {}, "density": {}, "needle_grid": {},
           "counts": {}, "density_task": {}, "density_task_length": {}, "kl_task": {},
           "kl_task_length": {}, "long": {}, "long_from": long_from, "needle_by_look": {}}
    for m in modes:
        acc, grid, dens, dtl, kl, look = {}, {}, {}, {}, {}, {}
        agree = n_agree = 0
        for r in records:
            if m not in r["modes"]:
                continue
            mr = r["modes"][m]
            ok = mr["correct"]
            key = (r["task"], r["tokens"])
            acc.setdefault(key, []).append(ok)
            if r["task"] == "needle":
                grid.setdefault((r["tokens"], r["depth"]), []).append(ok)
                if r.get("look"):
                    look.setdefault(r["look"], []).append(ok)
            if mr.get("density") is not None:
                dens.setdefault(r["tokens"], []).append(mr["density"])
                dtl.setdefault(key, []).append(mr["density"])
            if mr.get("kl") is not None:
                kl.setdefault(key, []).append(mr["kl"])
            if "dense" in r["modes"]:
                agree += mr["answer"] == r["modes"]["dense"]["answer"]
                n_agree += 1

        def per_task(d, pick=lambda n: True):
            return {t: _mean([v for (tt, n), vs in d.items() if tt == t and pick(n)
                              for v in vs]) for t in TASKS}

        long = lambda n: n >= long_from    # noqa: E731
        out["accuracy"][m] = {t: {str(n): _mean(acc.get((t, n))) for n in lengths}
                              for t in TASKS}
        out["accuracy"][m]["all"] = _mean([v for vs in acc.values() for v in vs])
        out["needle_by_look"][m] = {k: {"accuracy": _mean(v), "n": len(v)}
                                    for k, v in sorted(look.items())}
        out["needle_grid"][m] = {str(n): {f"{d:g}": _mean(grid.get((n, d))) for d in depths}
                                 for n in lengths}
        out["density"][m] = {str(n): _mean(dens.get(n)) for n in lengths}
        out["density_task"][m] = per_task(dtl)
        out["density_task_length"][m] = {t: {str(n): _mean(dtl.get((t, n))) for n in lengths}
                                         for t in TASKS}
        out["kl_task"][m] = per_task(kl)
        out["kl_task_length"][m] = {t: {str(n): _mean(kl.get((t, n))) for n in lengths}
                                    for t in TASKS}
        out["long"][m] = {"accuracy": per_task(acc, long), "density": per_task(dtl, long),
                          "kl": per_task(kl, long),
                          "kl_all": _mean([v for (t, n), vs in kl.items() if long(n)
                                           for v in vs]),
                          "n": {t: len([v for (tt, n), vs in acc.items() if tt == t and long(n)
                                        for v in vs]) for t in TASKS}}
        out["agreement_with_dense"][m] = agree / n_agree if n_agree else None
    out["counts"] = {t: {str(n): sum(1 for r in records if r["task"] == t and r["tokens"] == n)
                         for n in lengths} for t in TASKS}
    out["visual_tokens"] = {str(n): _mean([r["visual_tokens"] for r in records
                                           if r["tokens"] == n and "visual_tokens" in r])
                            for n in lengths}
    return out


def _mean(v):
    return (sum(float(x) for x in v) / len(v)) if v else None


def table(summary, modes, lengths) -> str:
    def f(x):
        return "  -  " if x is None else f"{x:5.2f}"
    head = f"{'task':<8}{'tokens':>7} " + " ".join(f"{m:>8}" for m in modes)
    lines = [head, "-" * len(head)]
    for t in TASKS:
        for n in lengths:
            if not summary["counts"][t][str(n)]:
                continue
            lines.append(f"{t:<8}{n:>7} " + " ".join(
                f"{f(summary['accuracy'][m][t][str(n)]):>8}" for m in modes)
                + f"   (n={summary['counts'][t][str(n)]})")
    lines.append(f"{'all':<15} " + " ".join(f"{f(summary['accuracy'][m]['all']):>8}"
                                           for m in modes))
    lines.append(f"{'agree w/ dense':<15} " + " ".join(
        f"{f(summary['agreement_with_dense'][m]):>8}" for m in modes))
    for n in lengths:
        lines.append(f"{'density':<8}{n:>7} " + " ".join(
            f"{f(summary['density'][m][str(n)]):>8}" for m in modes))
    for t in TASKS:
        if "kl_task" in summary:
            lines.append(f"{'KL ' + t:<15} " + " ".join(
                f"{('  -  ' if summary['kl_task'][m][t] is None else format(summary['kl_task'][m][t], '5.3f')):>8}"
                for m in modes))
    return "\n".join(lines)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def markdown(summary, modes, lengths, *, renderer: str = "synth", heatmap: str | None = None) -> str:
    """The tables for BENCHMARKS.md: accuracy per task x length x mode, the lengths >= the
    summary's ``long_from`` per task (accuracy, points from dense, density, KL), density per
    task x length, last-token KL(dense || mode) per task x length."""
    def f(x, fmt="{:.2f}"):
        return "–" if x is None else fmt.format(x)
    sparse = [m for m in modes if m != "dense"]
    vt = summary.get("visual_tokens", {})
    L = []
    L.append(f"Accuracy (greedy first token; renderer `{renderer}`; visual tokens = what the "
             f"adapter made of the video):")
    L.append("")
    L.append("| task | length | visual tokens | " + " | ".join(modes) + " | n |")
    L.append("|---|---:|---:|" + "---:|" * len(modes) + "---:|")
    for t in TASKS:
        for n in lengths:
            c = summary["counts"][t][str(n)]
            if not c:
                continue
            L.append(f"| {t} | {_k(n)} | {f(vt.get(str(n)), '{:.0f}')} | " + " | ".join(
                f(summary["accuracy"][m][t][str(n)]) for m in modes) + f" | {c} |")
    L.append("| **all** | | | " + " | ".join(f(summary["accuracy"][m]["all"]) for m in modes)
             + f" | {sum(sum(v.values()) for v in summary['counts'].values())} |")
    L.append("| agreement with dense | | | " + " | ".join(
        f(summary["agreement_with_dense"][m]) for m in modes) + " | |")
    looks = summary.get("needle_by_look", {})
    if any(looks.get(m) for m in modes):
        L += ["", "Needle accuracy by the digits' look (all lengths): " + "; ".join(
            f"{m}: " + ", ".join(f"{k} {f(v['accuracy'])} (n={v['n']})"
                                 for k, v in looks[m].items())
            for m in modes if looks.get(m))]
    lf = summary.get("long_from", 16384)
    if "long" in summary:
        L += ["", f"At >= {_k(lf)} tokens, per task: accuracy (points from dense), mean "
              f"density, mean last-token KL(dense ‖ mode) in nats:", ""]
        L.append("| task | n | dense | " + " | ".join(
            f"{m} acc | {m} density | {m} KL" for m in sparse) + " |")
        L.append("|---|---:|---:|" + "---:|---:|---:|" * len(sparse))
        lo = summary["long"]
        for t in TASKS:
            d = lo["dense"]["accuracy"][t] if "dense" in lo else None
            cells = []
            for m in sparse:
                a = lo[m]["accuracy"][t]
                gap = "" if a is None or d is None else f" ({100 * (a - d):+.0f})"
                cells += [f(a) + gap, f(lo[m]["density"][t]), f(lo[m]["kl"][t], "{:.3f}")]
            L.append(f"| {t} | {lo[modes[0]]['n'][t]} | {f(d)} | " + " | ".join(cells) + " |")
        cells = []
        for m in sparse:
            cells += ["", "", f(lo[m]["kl_all"], "{:.3f}")]
        L.append("| **all tasks** | | | " + " | ".join(cells) + " |")
    if sparse:
        for title, key, fmt in (
                ("Measured density (logical pairs / causal pairs, mean over heads and the layers "
                 "that compute every row: not the last, which runs its last row only) per task "
                 "and length:", "density", "{:.2f}"),
                ("Last-token KL(dense ‖ mode), nats, mean per task and length:", "kl",
                 "{:.3f}")):
            L += ["", title, ""]
            L.append("| task | mode | " + " | ".join(_k(n) for n in lengths) + " | mean |")
            L.append("|---|---|" + "---:|" * (len(lengths) + 1))
            for t in TASKS:
                for m in sparse:
                    row = summary[f"{key}_task_length"][m][t]
                    if all(row[str(n)] is None for n in lengths):
                        continue
                    L.append(f"| {t} | {m} | " + " | ".join(f(row[str(n)], fmt) for n in lengths)
                             + f" | {f(summary[f'{key}_task'][m][t], fmt)} |")
    if heatmap:
        L += ["", f"![needle heatmaps, dense and sparse]({heatmap})"]
    return "\n".join(L) + "\n"


def heatmap_png(summary, modes, lengths, depths, path):
    """One panel per mode: rows = lengths (short at top), columns = depths; green = right."""
    from PIL import Image, ImageDraw
    cw, ch, lw, top = 44, 26, 70, 40
    pw = max(lw + cw * len(depths) + 20, 250)
    ph = top + ch * len(lengths) + 30
    img = Image.new("RGB", (pw * len(modes), ph), (255, 255, 255))
    d = ImageDraw.Draw(img)
    for i, m in enumerate(modes):
        x0 = i * pw
        d.text((x0 + lw, 6), f"needle: {m}", fill=(0, 0, 0))
        for j, dep in enumerate(depths):
            d.text((x0 + lw + j * cw + 8, top - 14), f"{dep:g}", fill=(0, 0, 0))
        for r, n in enumerate(lengths):
            y = top + r * ch
            d.text((x0 + 4, y + 7), f"{n // 1024}K" if n >= 1024 else str(n), fill=(0, 0, 0))
            for j, dep in enumerate(depths):
                v = summary["needle_grid"][m][str(n)][f"{dep:g}"]
                col = (200, 200, 200) if v is None else (int(220 * (1 - v)), int(60 + 150 * v), 60)
                box = (x0 + lw + j * cw, y, x0 + lw + (j + 1) * cw - 2, y + ch - 2)
                d.rectangle(box, fill=col)
                if v is not None:
                    d.text((box[0] + 8, box[1] + 7), f"{v:.2f}", fill=(255, 255, 255))
        d.text((x0 + lw, ph - 20), "depth ->   rows: visual tokens", fill=(80, 80, 80))
    img.save(path)


def extra_configs(paths, identity) -> dict:
    """{'cfg:<stem>': HeadPatternConfig} for ``--configs``, each checked against the model
    (a config of another shape fails here, before any video is drawn)."""
    from mminfer.errors import ConfigError
    from mminfer.sparse.patterns import HeadPatternConfig
    out = {}
    for p in paths:
        name = f"cfg:{Path(p).stem}"
        if name in out:
            raise SystemExit(f"--configs: two files named {Path(p).stem!r}; rename one")
        try:
            out[name] = HeadPatternConfig.load(Path(p), expect=identity)
        except ConfigError as e:
            raise SystemExit(f"--configs: {e}") from None
    return out


# ------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the embedded model)")
    ap.add_argument("--out", default="out/quality", help="folder for quality.json + PNG")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768],
                    help="visual tokens per video (16 per pair of frames)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--needle-reps", type=int, default=1, help="needle videos per cell")
    ap.add_argument("--per-task", type=int, default=2,
                    help="colour/count/order videos per length")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--densities", type=float, nargs="*", default=[0.1, 0.25, 0.5])
    ap.add_argument("--no-config", action="store_true",
                    help="skip the mode with the model's own head-pattern config")
    ap.add_argument("--configs", nargs="+", default=[], metavar="JSON",
                    help="more sparse modes, one per head-pattern config file (mode "
                    "'cfg:<file stem>'), on the same rendered videos: comparing configs this "
                    "way renders each video once")
    ap.add_argument("--served-configs", action="store_true",
                    help="run the --configs modes as 'prefix' runs the model's own config (the "
                    "served policy: the prefix sparse, the question dense over it) instead of "
                    "one sparse pass over the whole prompt")
    ap.add_argument("--fp8", action="store_true",
                    help="add mode 'fp8': the model loaded again with quantization='fp8', "
                    "dense (agreement with dense and last-token KL)")
    ap.add_argument("--no-density", action="store_true",
                    help="do not measure densities (saves the count-mode kernel runs)")
    ap.add_argument("--renderer", choices=("synth", "eval"), default="synth",
                    help="synth: the training renderer (held-out seeds); eval: "
                    "lab.toy.render_eval, a renderer training never sees")
    ap.add_argument("--seed0", type=int, default=E.HELDOUT_SEED_MIN)
    ap.add_argument("--long-from", type=int, default=16384,
                    help="the per-task summary of long videos takes lengths >= this")
    ap.add_argument("--markdown", help="write the markdown tables here (default: "
                    "<out>/tables.md)")
    ap.add_argument("--workers", type=int, default=None,
                    help="rendering processes (default: cores - 2 on GPU, 0 on CPU)")
    ap.add_argument("--device")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--max-minutes", type=float, default=2.0,
                    help="stop taking new examples after this long")
    ap.add_argument("--engine", choices=("kernel", "reference"), default="kernel",
                    help="how sparse modes run their plans: the Triton kernels, or exact "
                    "masked attention by row chunks (no Triton: sparse answers on a CPU at "
                    "long N, at the cost of a dense pass)")
    ap.add_argument("--block", type=int, nargs=2, metavar=("M", "N"),
                    help="plan tiles (default 128 64 on a GPU, 16 16 on the CPU; give 128 64 "
                    "on the CPU to plan as a GPU calibration did)")
    args = ap.parse_args(argv)
    # SIGINT ends the run with its tables written (run_embedded_h200.sh stops it so at a
    # call's limit); a process started with SIGINT ignored (a background job of a
    # non-interactive shell) would otherwise never see it
    signal.signal(signal.SIGINT, signal.default_int_handler)

    E.use_bundled_fonts()
    model_dir = Path(args.model) if args.model else E.default_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(model_dir, args.device, args.dtype, engine=args.engine,
                    block=tuple(args.block) if args.block else None)
    ad = runner.ad
    cuda = ad.device.type == "cuda"
    workers = args.workers if args.workers is not None else (
        max(0, min(14, (os.cpu_count() or 2) - 2)) if cuda else 0)
    lengths, depths = sorted(args.lengths), [float(x) for x in args.depths]
    extra = extra_configs(args.configs, ad.identity)
    configs_info = {f"cfg:{Path(p).stem}": {"path": str(p), "sha256": hashlib.sha256(
        Path(p).read_bytes()).hexdigest()} for p in args.configs}
    modes = ["dense"] + ([] if args.no_config else ["prefix", "config"]) + list(extra) + \
        [f"d={x:.2f}" for x in args.densities] + (["fp8"] if args.fp8 else [])
    runner8 = Runner(model_dir, args.device, args.dtype, quantization="fp8") if args.fp8 \
        else None
    specs = grid_specs(lengths, depths, args.needle_reps, args.per_task, args.tasks, args.seed0)
    for sp in specs:
        sp["renderer"] = args.renderer
    log(f"model {model_dir} on {ad.device} ({ad.dtype}); {len(specs)} videos, modes "
        f"{', '.join(modes)}; {workers} rendering workers")
    if ad.patterns is None:
        raise SystemExit("the model has no head-pattern config: sparse modes impossible")

    records = []
    deadline = time.time() + args.max_minutes * 60
    stopped = None

    def result_of(stopped_now):
        summary = summarise(records, modes, lengths, depths, args.long_from)
        return summary, {
            "model": str(model_dir), "device": torch.cuda.get_device_name(ad.device)
            if cuda else "cpu", "dtype": str(ad.dtype), "engine": args.engine,
            "block": [runner.block_m, runner.block_n], "modes": modes,
            "lengths": lengths, "depths": depths, "renderer": args.renderer,
            "held_out_seeds": [E.HELDOUT_SEED_MIN, E.HELDOUT_SEED_MAX], "stopped": stopped_now,
            "patterns_uncalibrated": bool(getattr(ad.patterns, "uncalibrated", True)),
            "configs": configs_info, "configs_policy": "served" if args.served_configs
            else "one pass",
            "summary": summary, "examples": records}

    def write_json(stopped_now):
        # after every video too: a run killed hard (a device call's limit) keeps what it did
        tmp = out / "quality.json.tmp"
        tmp.write_text(json.dumps(result_of(stopped_now)[1], indent=1, default=str))
        tmp.replace(out / "quality.json")
    try:
        for spec, frames, answer, question in rendered(specs, workers):
            if time.time() > deadline:
                stopped = f"--max-minutes {args.max_minutes:g} reached"
                break
            t0 = time.time()
            prep = runner.prepare(frames, question)
            emb = runner.embeds(prep)
            want = runner.answer_ids[spec["task"]][answer]
            n = prep.total_tokens
            rec = {**spec, "answer": answer, "total_tokens": n,
                   "visual_tokens": int(prep.visual_tokens), "modes": {}}
            dense_logp = None
            for m in modes:
                if m == "fp8":            # the same prompt through the FP8 model, dense
                    tok, _, _, logp = runner8.first_token(prep, runner8.embeds(prep),
                                                          ad.patterns, False, False)
                    rec["modes"][m] = {"answer": ad.tokenizer.decode([tok]).strip(),
                                       "correct": tok == want, "density": None,
                                       "sparse": False, "kl": kl_divergence(dense_logp, logp)}
                    continue
                if m == "prefix" or (args.served_configs and m in extra):
                    tok, dens, ran_sparse, logp = runner.first_token_prefix(
                        prep, emb, ad.patterns if m == "prefix" else extra[m],
                        not args.no_density)
                    rec["modes"][m] = {"answer": ad.tokenizer.decode([tok]).strip(),
                                       "correct": tok == want, "density": dens,
                                       "sparse": ran_sparse,
                                       "kl": kl_divergence(dense_logp, logp)}
                    continue
                if m == "dense":
                    pats, sparse = ad.patterns, False
                elif m == "config":
                    pats, sparse = ad.patterns, True
                elif m in extra:
                    pats, sparse = extra[m], True
                else:
                    pats = resize_config(ad.patterns, prep.index, n, float(m[2:]),
                                         block_m=runner.block_m, block_n=runner.block_n)
                    sparse = True
                tok, dens, ran_sparse, logp = runner.first_token(prep, emb, pats, sparse,
                                                                 not args.no_density)
                if m == "dense":
                    dense_logp = logp
                rec["modes"][m] = {"answer": ad.tokenizer.decode([tok]).strip(),
                                   "correct": tok == want, "density": dens,
                                   "sparse": ran_sparse, "kl": kl_divergence(dense_logp, logp)}
            rec["seconds"] = round(time.time() - t0, 3)
            records.append(rec)
            marks = " ".join(f"{m}:{'ok' if r['correct'] else r['answer'] or '?'}"
                             for m, r in rec["modes"].items())
            log(f"{spec['task']:<6} {n:>6} tok" + (f" depth {spec['depth']:.2f}"
                                                   if spec["depth"] is not None else "")
                + f"  answer {answer:<6} {marks}  ({rec['seconds']:.1f}s)")
            write_json("in progress")
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        summary, result = result_of(stopped)
        write_json(stopped)
        if records:
            heatmap_png(summary, modes, lengths, depths, out / "quality_needle.png")
        md = markdown(summary, modes, lengths, renderer=args.renderer,
                      heatmap="quality_needle.png" if records else None)
        md_path = Path(args.markdown) if args.markdown else out / "tables.md"
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(md)
        print(table(summary, modes, lengths), flush=True)
        print(md, flush=True)
        log(f"{len(records)} videos; wrote {out / 'quality.json'}"
            + (f" ({stopped})" if stopped else ""))
    return result


if __name__ == "__main__":
    main()
