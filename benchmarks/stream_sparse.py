"""Does a video ingested in sparse pieces answer as its sparse one-shot prefill does?

    python3 benchmarks/stream_sparse.py --out $OUT/stream_sparse           # H200, 16K-32K
    python3 benchmarks/stream_sparse.py --lengths 1024 --piece 256 --per-task 1 \
        --engine reference --block 128 64 --out /tmp/stream_sparse          # CPU, tiny

The embedded model on held-out synthetic videos (``benchmarks/quality.py``'s examples: the
needle, colour, count and order tasks, seeds of the held-out range), the question's first
token as the answer. Three ways to build the prefix (everything up to the end of the video),
the question's rows always dense over it (the video cache's policy):

* ``dense``: one dense prefill;
* ``one-shot``: one sparse prefill with the model's head patterns, estimated from the
  prefix's own last queries (what ``mminfer answer`` runs);
* ``pieces``: the prefix prefilled as a live stream ingests it: the head and the first
  piece, then pieces of about ``--piece`` tokens (whole temporal pairs; the last one holds
  the closing token), each appended to the cache and, from ``--min-piece`` rows, sparse:
  planned from its own last queries against every key so far, with the stream's
  ModalityIndex up to it (mminfer.engine.streams does the same per piece).

Per task and length: agreement of the first token with dense's, KL(dense || mode) of the
last-token distribution in nats (mean and max), and the density of the prefix's sparse
layers (pairs computed over the causal pairs of the rows they computed; a piece's rows over
its own causal pairs, dense pieces counted as 1, weighted by their causal pairs). Writes
``stream_sparse.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from lab.toy import embedded as E  # noqa: E402
from mminfer.offline.answer_kl import kl_divergence  # noqa: E402

TASKS = ("needle", "colour", "count", "order")
MODES = ("dense", "one-shot", "pieces")


def clip_index(index, end: int):
    """The ModalityIndex of the rows ``[0, end)`` (``end`` on a frame boundary)."""
    from mminfer.sparse.modality import ModalityIndex, Span
    spans = [Span(s.start, min(s.end, end), s.modality, s.frame_stride, s.grid_h, s.grid_w,
                  s.separators) for s in index.spans if s.start < end]
    return ModalityIndex(end, spans)


def piece_bounds(index, piece: int) -> list:
    """``[(a, b)]`` tiling the prefix ``[0, index.n)``: the first piece holds the text before
    the video and about ``piece`` video rows; every cut sits on a frame boundary (a temporal
    pair for Qwen2.5-VL) of the video span, the last piece ends with the prefix."""
    vid = index.visual_spans()[0]
    step = max(1, round(piece / vid.frame_stride)) * vid.frame_stride
    cuts = list(range(vid.start + step, vid.end, step))
    edges = [0] + cuts + [index.n]
    return list(zip(edges[:-1], edges[1:]))


def _causal_pairs(a: int, b: int) -> float:
    return (b * (b + 1) - a * (a + 1)) / 2


@torch.inference_mode()
def first_token(ad, prep, embeds, pieces, mode, patterns, *, min_piece=0, engine="kernel",
                block=None):
    """Log-probabilities of the question's first token after the prefix is built in
    ``pieces`` (``[(a, b)]``) with attention ``mode`` ("dense"/"sparse"), and the prefix's
    density (None: dense)."""
    from mminfer.kernels import sparsity
    from mminfer.models.hooks import PrefillContext
    from mminfer.models.kv import PrefixKV
    from mminfer.models.prefill import prefill

    P, L = prep.prefix_len, prep.input_ids.shape[1]
    pos = ad.positions(prep, 0, P)
    kv = PrefixKV.for_model(ad.text_model, L - P + 16, dtype=ad.kv_cache_dtype)
    pairs = dense_pairs = 0.0
    for a, b in pieces:
        sparse = mode == "sparse" and b - a >= min_piece
        ctx = PrefillContext(index=clip_index(prep.prefix_index, b) if sparse else None,
                             patterns=patterns, mode="sparse" if sparse else "dense",
                             min_sparse_len=0, keep_plans=True, engine=engine, block=block)
        prefill(ad.text_model, embeds[:, a:b].clone(), kv, pos[..., a:b], ctx=ctx,
                kv_only_last=True, append=a > 0)
        d = sparsity(ctx.densities) if sparse else None
        share = d["mean_density"] if d else 1.0
        pairs += share * _causal_pairs(a, b)
        dense_pairs += _causal_pairs(a, b)
    h = ad._step(embeds[:, P:], ad.positions_after(prep.rope_delta, P, L - P), kv)
    logits = ad.lm_head(h[:, -1]).float()[0]
    return torch.log_softmax(logits, -1).cpu(), (pairs / dense_pairs if mode == "sparse"
                                                  else None)


def run_example(ad, frames, question, *, piece, min_piece=0, engine="kernel", block=None):
    """The three modes on one video: ``{mode: (token, logp, density)}``."""
    from mminfer.video import DecodedVideo
    prep = ad.prepare(DecodedVideo.from_frames(frames), question)
    with torch.inference_mode():
        embeds = ad.embed(prep)
    whole = [(0, prep.prefix_len)]
    runs = {"dense": (whole, "dense"), "one-shot": (whole, "sparse"),
            "pieces": (piece_bounds(prep.prefix_index, piece), "sparse")}
    out = {}
    for name, (bounds, mode) in runs.items():
        logp, dens = first_token(ad, prep, embeds, bounds, mode, ad.patterns,
                                 min_piece=min_piece, engine=engine, block=block)
        out[name] = (int(logp.argmax()), logp, dens)
    out["n_pieces"] = len(runs["pieces"][0])
    out["tokens"] = int(prep.input_ids.shape[1])
    return out


def summarise(records) -> dict:
    """Per (task, length) and overall: for each sparse mode, agreement with dense, KL mean and
    max, mean density."""
    groups: dict = {}
    for r in records:
        for key in ((r["task"], r["length"]), ("all", "all")):
            groups.setdefault(key, []).append(r)
    out = {}
    for (task, length), rs in sorted(groups.items(), key=lambda kv: kv[0][0] == "all"):
        row = {"n": len(rs)}
        for m in ("one-shot", "pieces"):
            kls = [r["kl"][m] for r in rs]
            dens = [r["density"][m] for r in rs if r["density"][m] is not None]
            row[m] = {"agree": sum(r["token"][m] == r["token"]["dense"] for r in rs) / len(rs),
                      "kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
                      "density": sum(dens) / len(dens) if dens else None}
        row["pieces_vs_one_shot_agree"] = sum(
            r["token"]["pieces"] == r["token"]["one-shot"] for r in rs) / len(rs)
        out[f"{task}@{length}"] = row
    return out


def table(summary) -> str:
    lines = ["| task @ length | n | one-shot agree | KL mean / max | density | "
             "pieces agree | KL mean / max | density | pieces = one-shot |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, row in summary.items():
        cells = [key, str(row["n"])]
        for m in ("one-shot", "pieces"):
            r = row[m]
            cells += [f"{r['agree']:.2f}", f"{r['kl_mean']:.4f} / {r['kl_max']:.4f}",
                      "-" if r["density"] is None else f"{r['density']:.3f}"]
        cells.append(f"{row['pieces_vs_one_shot_agree']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768],
                    help="visual tokens per video")
    ap.add_argument("--piece", type=int, default=3072, help="video tokens per piece")
    ap.add_argument("--min-piece", type=int, default=0,
                    help="pieces of fewer rows run dense (the stream's sparse_min_tokens)")
    ap.add_argument("--piece-lines", type=float, default=None,
                    help="the pieces' share of the count budgets (the config's "
                         "estimation.piece_lines; default: the config's, 1 when unset)")
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--seed0", type=int, default=E.HELDOUT_SEED_MIN + 40_000)
    ap.add_argument("--engine", default="kernel", choices=("kernel", "reference"))
    ap.add_argument("--block", type=int, nargs=2, default=None,
                    help="the plan's row and key block (default: 128 64 on a GPU, 16 16 CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="stream_sparse")
    args = ap.parse_args(argv)

    from mminfer.engine.pipeline import Pipeline
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    pipe = Pipeline(None, attention="dense", device=args.device, dtype=dtype)
    ad = pipe.adapter
    if args.piece_lines is not None:           # checked as a config field is
        from mminfer.sparse.patterns import HeadPatternConfig
        d = ad.patterns.to_dict()
        d.setdefault("estimation", {})["piece_lines"] = args.piece_lines
        ad.patterns = HeadPatternConfig.from_dict(d)
    answers = E.answer_ids(ad.tokenizer)
    block = tuple(args.block) if args.block else None
    records, t0, k = [], time.time(), 0
    for length in args.lengths:
        n_frames = 2 * max(1, round(length / E.TOKENS_PER_PAIR))
        for task in args.tasks:
            for _ in range(args.per_task):
                kw = {"depth": (k % 5) / 4} if task == "needle" else {}
                frames, answer, question, _ = E.render_example(task, args.seed0 + k, n_frames,
                                                               **kw)
                k += 1
                res = run_example(ad, frames, question, piece=args.piece,
                                  min_piece=args.min_piece, engine=args.engine, block=block)
                dense = res["dense"][1]
                rec = {"task": task, "length": length, "tokens": res["tokens"],
                       "pieces": res["n_pieces"], "answer": answer,
                       "right": int(answers[task].get(answer, -1)),
                       "token": {m: res[m][0] for m in MODES},
                       "kl": {m: kl_divergence(dense, res[m][1]) for m in MODES},
                       "density": {m: res[m][2] for m in MODES}}
                records.append(rec)
                print(f"[{time.time() - t0:6.1f}s] {task}@{length} {res['tokens']} tokens, "
                      f"{res['n_pieces']} pieces: KL one-shot {rec['kl']['one-shot']:.4f} "
                      f"pieces {rec['kl']['pieces']:.4f}, density "
                      f"{rec['density']['one-shot']:.3f} / {rec['density']['pieces']:.3f}",
                      flush=True)
    summary = summarise(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream_sparse.json").write_text(json.dumps(
        {"args": vars(args), "device": torch.cuda.get_device_name() if args.device == "cuda"
         else "cpu", "summary": summary, "records": records}, indent=1))
    print(table(summary))
    return summary


if __name__ == "__main__":
    main()
