"""Live video (issue 43): what ingesting a video piece by piece costs, how fast a question
about a long stream is answered, and how many real-time streams one GPU keeps up with.

    python3 benchmarks/stream_ingest.py --parts ingest --out out/stream          # targets 1-2
    python3 benchmarks/stream_ingest.py --parts realtime --streams 8 --out out/stream
    python3 benchmarks/stream_ingest.py --tiny --out /tmp/stream                  # CPU, ~2 min
    bash benchmarks/run_stream_h200.sh ingest                # one device call per part (H200)
    bash benchmarks/run_stream_h200.sh realtime

Two parts, each with its own time limit (``--ingest-max-s``, ``--realtime-max-s``: a part
that runs out stops where it is and reports what it measured, marked ``cut_short``), and a
JSON report (``--out``/stream_ingest.json, rewritten after every step: the command line, the
commit and the device in it) and a progress line per piece or phase on stdout.

**ingest** (targets 1 and 2): in one process, on one Pipeline (the engine ``mminfer watch``
runs without ``--url``), LongVILA-7B with random weights in the real layout
(``benchmarks/e2e.py``'s ``longvila1m`` case and its writers: Qwen2-7B + SigLIP-so400m-448,
``max_position_embeddings`` 1,064,960) on e2e's synthetic 640x360 H.264 file of 4096 frames
at 2 fps (34 min of media):

1. warm-up (excluded): ``Pipeline.warmup`` (what the server and ``mminfer watch`` run first),
   a one-shot sparse request on ``--warmup-frames`` frames and a short stream (two pieces
   and a question), so kernels are compiled before anything is timed (each piece still
   reports any Triton compilation it met);
2. one-shot: ``Pipeline.answer`` (sparse, video cache off) on the whole video: 4096 frames x
   257 tokens = 1,052,672 visual tokens; its stages from ``timings_ms``;
3. the same video as a stream: ``Streams.create`` (sparse; pieces of fewer than
   ``--sparse-min-tokens`` rows dense, the product's 2048 by default), the file read by
   ``mminfer watch``'s reader (mminfer.video.live.LiveSource) in one-minute pieces
   (``--piece-frames`` 120 = 60 s at 2 fps = 30,840 rows: 34 pieces and one of 16 frames),
   each appended with ``append_frames`` (its decode time measured apart); after 25 %, 50 %
   and 100 % of the pieces (``--ask-at``) ``--asks`` questions (``Stream.ask``: a fork of the
   stream's cache on the GPU tier, the question's rows, the first token).

Target 1: the pieces' vision + prefill (each piece's ``vision_ms`` + ``prefill_ms``, summed)
<= 1.3x the one-shot's vision + prefill (``vision`` + ``index`` + ``attention`` +
``llm_other``) on the same video, in the same process. ``ratio`` charges the pieces for their
frames' resize (inside a piece's ``vision_ms``) and not the one-shot (its ``preprocess``
stage): the stricter figure; ``ratio_incl_preprocess`` adds the one-shot's ``preprocess``.
Target 2: each question's TTFT (``timings_ms.ttft``: the fork, the question's prefill over
the stream's keys, the first token) <= 0.3 s.

Memory (H200, 141 GB): the weights ~16 GB; the stream's KV at the end, 1,052,672 tokens x
28 layers x 2 x 4 KV heads x 128 x 2 bytes (57,344 bytes a token) = 60.4 GB (56.2 GiB) bf16,
30.2 GB with ``--kv-cache-dtype fp8``; it fits the streams' default device budget (the video
cache's, half the GPU: 70 GB). The one-shot runs first and is freed before the stream (its
peak, ~110 GiB, is e2e's). An H100 (80 GB) needs ``--kv-cache-dtype fp8`` (its default
budget, 40 GB, takes bf16 to ~700K tokens: the stream becomes full, reported as such).
Device time (estimated from e2e's committed 1.05M runs: checkpoint 21-30 s, a sparse one-shot
44-58 s): setup ~1 min, warm-up ~15 s, one-shot ~1 min, stream ~1-1.5 min: ~4-5 min.

**realtime** (target 3): the real server over HTTP on 127.0.0.1 (``mminfer serve``, started
as benchmarks/load.py starts it, its log in ``--out``/server-realtime.log), Qwen2.5-VL-7B
with random weights (e2e's writer; ``max_position_embeddings`` raised to 327,680 in a sibling
folder, the 128K of the real config being 7 minutes of one stream), 560x420 frames at 2 fps:
20 x 15 = 300 tokens per temporal pair, 300 tokens a second, 180,000 tokens (10.3 GB bf16)
after 10 minutes of one stream, 82.6 GB for 8 streams, 124 GB for 12 (past an H200 in bf16:
``--kv-cache-dtype fp8`` halves it). The streams share ``--stream-kv-gb`` (the server's flag;
its room grows geometrically, up to half a stream's length, within the budget). For each
count of streams of ``--streams`` (the search: in order, stopping after the first count that
falls behind unless ``--search all``; a count whose time does not fit the part's limit is
skipped and says so):

1. N streams created (``POST /v1/streams``, attention ``--attention``), then a head start:
   each takes ``--head-start-minutes`` of media in ``--head-piece-s`` pieces, unpaced, all
   at once (``POST /v1/streams/{id}/segments``), so the paced part below runs at the length
   the streams have at minutes H..H+M (a piece's cost grows with the keys before it: the
   last minutes are the hardest), in the device call's 10 minutes;
2. paced: each stream sends ``--minutes`` of media in ``--piece-s`` pieces (one H.264 file,
   ``--frame-size`` at ``--video-fps``, sent again and again), piece k of stream i when its
   media time has passed: at T0 + i x P / N + (k + 1) x P (P: the piece's length over
   ``--pace``; the streams' phases spread over a piece), the next piece no earlier and never
   before the previous one is answered (one client per stream, as a camera's uploader);
3. per piece: its lag, the time from when its media had passed to when the server answered
   it (ingested: vision and prefill done), and the server's ``lag_seconds`` from the stream's
   status (measured since the stream's first piece: with a head start it runs ahead of the
   wall clock, so it is only meaningful without one). A stream **keeps up** when every piece
   of the paced part's second half was answered within ``--max-lag-s`` (default: two pieces'
   length) of its media time: a stream whose pieces take longer than their media has a lag
   that grows with each piece and fails. A stream that becomes full (past the memory), or a
   piece the server refuses, fails too; one the time limit cut short fails if its pieces
   so far lagged past the limit, else is undecided (``kept_up`` null). A falling-behind
   stream still sends every piece (back to back), so such a count often ends at the limit.
   ``lag_growth_s_per_min``: the slope of the lag over the second half, per minute of media.
   Then one question about stream 0 (``/v1/answer`` with ``stream_id``: the server's TTFT)
   and the streams are deleted.

The report's ``max_streams_kept_up``: the largest count whose every stream sent all its
pieces and kept up; the issue's target is >= 8 over 10 minutes (head start + paced).
``--pace`` > 1 sends the media faster than real time (the ``--tiny`` test uses it to see a
stream that cannot keep up reported as falling behind).
Device time, one call per count (H200, estimated): checkpoint ~30 s, server start and
warm-up ~1 min, head start of 7 min x 8 streams in one-minute pieces ~1 min, paced 3 min:
~6 min for ``--streams 8 --head-start-minutes 7 --minutes 3``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e  # noqa: E402  (benchmarks/e2e.py: checkpoints, videos, requests, environment)

GIB = 1024 ** 3
TARGET_RATIO = 1.3            # pieces' vision + prefill over the one-shot's
TARGET_TTFT_S = 0.3           # a question about the ~1M-token stream
TARGET_STREAMS = 8            # real-time 2-fps Qwen2.5-VL streams on one GPU
TARGET_MINUTES = 10.0
# LongVILA-7B's LLM (Qwen2-7B) and Qwen2.5-VL-7B's: 28 layers, K and V, 4 KV heads of 128
KV_BYTES_PER_TOKEN_7B = 28 * 2 * 4 * 128 * 2


def sizes(frames: int, piece_frames: int, fps: float, tokens_per_frame: int = 257,
          kv_bytes: int = KV_BYTES_PER_TOKEN_7B) -> dict:
    """The ingest part's shape: pieces, tokens, KV bytes at the end (bf16 and FP8)."""
    tokens = frames * tokens_per_frame
    full, rest = divmod(frames, piece_frames)
    return {"frames": frames, "media_s": frames / fps, "piece_frames": piece_frames,
            "piece_s": piece_frames / fps, "pieces": full + (rest > 0),
            "last_piece_frames": rest or piece_frames, "visual_tokens": tokens,
            "piece_tokens": piece_frames * tokens_per_frame,
            "kv_gb_bf16": round(tokens * kv_bytes / 1e9, 1),
            "kv_gb_fp8": round(tokens * kv_bytes / 2e9, 1)}


def realtime_sizes(streams: int, minutes: float, tokens_per_s: int = 300,
                   kv_bytes: int = KV_BYTES_PER_TOKEN_7B) -> dict:
    """The real-time part's KV at the end: ``streams`` of ``minutes`` media each."""
    tokens = int(minutes * 60 * tokens_per_s)
    return {"streams": streams, "minutes": minutes, "tokens_per_stream": tokens,
            "kv_gb_per_stream_bf16": round(tokens * kv_bytes / 1e9, 2),
            "kv_gb_bf16": round(streams * tokens * kv_bytes / 1e9, 1),
            "kv_gb_fp8": round(streams * tokens * kv_bytes / 2e9, 1)}


class Limit:
    """A part's time limit: ``left()`` seconds before it, ``over()`` once past it."""

    def __init__(self, seconds: float | None, parent=None):
        self.t0, self.seconds, self.parent = time.monotonic(), seconds, parent

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        mine = math.inf if self.seconds is None else self.seconds - self.elapsed()
        return min(mine, self.parent.left()) if self.parent is not None else mine

    def over(self) -> bool:
        return self.left() <= 0


def say(clock: Limit, text: str) -> None:
    print(f"[{clock.elapsed():7.1f} s] {text}", flush=True)


def _r(v, n=3):
    return None if v is None else round(float(v), n)


# ============================================================================ ingest
def ingest_case(args):
    cases = e2e.tiny_cases() if args.tiny else e2e.full_cases()
    case = cases["tiny-longvila" if args.tiny else "longvila1m"]
    return replace(case, frames=args.frames or case.frames)


def run_ingest(args, report: dict, save, clock: Limit) -> None:
    """Targets 1 and 2 (the module doc): warm-up, the one-shot, the stream in pieces with
    questions along the way. Fills ``report["ingest"]``."""
    import torch
    from mminfer.engine.pipeline import Pipeline
    from mminfer.engine.streams import SPARSE_MIN_PIECE_TOKENS, Streams
    from mminfer.video.live import LiveSource

    case = ingest_case(args)
    limit = Limit(args.ingest_max_s, clock)
    rec = report["ingest"] = {"case": case.name, "frames": case.frames,
                              "piece_frames": args.piece_frames, "fps": case.fps,
                              "limit_s": args.ingest_max_s}
    work = Path(args.work_dir)
    videos = e2e.VideoJobs(work, [case], background=not args.tiny)
    device = torch.device(args.device)
    path, info = e2e.ensure_checkpoint(case, work, device, args.tiny, {})
    rec["checkpoint"] = info
    rec["video"] = videos.get(case)
    video = rec["video"]["path"]
    say(clock, f"ingest: checkpoint {info.get('write_s')} s, video {rec['video'].get('write_s')}"
               f" s")
    t = time.perf_counter()
    pipe = Pipeline(str(path), attention="auto", device=args.device, dtype=args.dtype,
                    kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    rec["load_s"] = round(time.perf_counter() - t, 2)
    sparse_ok = pipe.sparse_unavailable is None and pipe.adapter.patterns is not None
    if sparse_ok and args.piece_lines is not None:     # checked as a config field is
        from mminfer.sparse.patterns import HeadPatternConfig
        d = pipe.adapter.patterns.to_dict()
        d.setdefault("estimation", {})["piece_lines"] = args.piece_lines
        pipe.adapter.patterns = HeadPatternConfig.from_dict(d)
    rec["piece_lines"] = pipe.adapter.patterns.piece_lines if sparse_ok else None
    mode = "sparse" if args.attention == "sparse" and sparse_ok else "dense"
    rec["attention"] = mode
    if mode != args.attention:
        rec["attention_why"] = pipe.sparse_unavailable or "no head patterns"
    rec["kv_bytes_per_token"] = pipe.kv_bytes_per_token
    min_piece = SPARSE_MIN_PIECE_TOKENS if args.sparse_min_tokens is None \
        else args.sparse_min_tokens
    rec["sparse_min_tokens"] = min_piece
    streams = Streams(pipe, budget_bytes=None if args.stream_kv_gb is None
                      else int(args.stream_kv_gb * GIB))
    rec["stream_budget_bytes"] = streams.budget_bytes
    save()
    piece_s = args.piece_frames / case.fps
    try:
        # 1. warm-up: what `mminfer serve` and `mminfer watch` compile before the first
        # request (Pipeline.warmup), then the one-shot's and the pieces' calls
        wf = min(args.warmup_frames, case.frames)
        rec["warmup"] = {"pipeline": pipe.warmup()}
        rec["warmup"]["one_shot"] = e2e.request(pipe, case, video, mode, args, frames=wf)
        warm = streams.create(fps=case.fps, mode=mode, sparse_min_tokens=min_piece)
        try:
            n_warm = max(1, min(args.piece_frames, wf // 2))
            src = LiveSource(video, case.fps, piece_seconds=n_warm / case.fps)
            got, gen = [], src.pieces()
            for piece in gen:
                got.append(warm.append_frames(
                    piece.frames, media_seconds=max(piece.media_end - warm.media_end, 0.0),
                    next_sample=piece.next_sample))
                if len(got) == 2:
                    break
            gen.close()                   # the file closed now, not when collected
            res = warm.ask(args.question, max_new_tokens=args.max_new_tokens)
            rec["warmup"]["stream"] = {"pieces": got, "ttft_ms": res.timings_ms.get("ttft")}
        finally:
            streams.delete(warm.id)
            e2e.free_memory()
        say(clock, f"ingest: warm-up done ({wf} frames one-shot, 2 pieces of {n_warm} frames)")
        save()

        # 2. one-shot sparse prefill of the whole video
        if limit.over():
            rec["one_shot"] = {"skipped": f"time limit: {limit.elapsed():.0f} s used"}
        else:
            before = _compiles().stats()
            rec["one_shot"] = e2e.request(pipe, case, video, mode, args)
            rec["one_shot"]["compiles"] = _compiled_since(before)
            e2e.free_memory()
            t1 = rec["one_shot"].get("timings_ms") or {}
            say(clock, "ingest: one-shot " + (
                f"{(rec['one_shot'].get('tokens') or {}).get('total')} tokens, vision "
                f"{_s(t1.get('vision'))} s, prefill {_s(_prefill_ms(t1))} s, ttft "
                f"{_s(t1.get('ttft'))} s" if t1 else str(rec["one_shot"].get("error"))[:300]))
        save()

        # 3. the stream: one-minute pieces, questions at 25 / 50 / 100 %
        srec = rec["stream"] = {"pieces": [], "asks": [], "complete": False}
        n_pieces = math.ceil(case.frames / args.piece_frames)
        ask_after = sorted({min(n_pieces, max(1, math.ceil(f * n_pieces - 1e-9)))
                            for f in args.ask_at})
        srec["ask_after_pieces"] = ask_after
        s = streams.create(fps=case.fps, mode=mode, sparse_min_tokens=min_piece)
        src = LiveSource(video, case.fps, piece_seconds=piece_s)
        with e2e.GpuPeak(device) as gpu:
            pieces = src.pieces()
            while True:
                t = time.perf_counter()
                piece = next(pieces, None)
                decode_s = time.perf_counter() - t
                if piece is None:
                    srec["complete"] = True
                    break
                if limit.over():
                    srec["cut_short"] = (f"time limit: {limit.elapsed():.0f} s used after "
                                         f"{len(srec['pieces'])} pieces")
                    say(clock, "ingest: " + srec["cut_short"])
                    break
                before = _compiles().stats()
                k = len(srec["pieces"]) + 1
                try:
                    with _profiled(args, k) as prof:
                        rep = s.append_frames(
                            piece.frames,
                            media_seconds=max(piece.media_end - s.media_end, 0.0),
                            next_sample=piece.next_sample)
                except Exception as err:      # a full stream or an OOM: what came is kept
                    srec["error"] = e2e._error(err)
                    say(clock, f"ingest: piece {len(srec['pieces']) + 1} failed: "
                               f"{srec['error']['error'][:300]}")
                    break
                rep = {**rep, "decode_ms": round(decode_s * 1e3, 3),
                       "stream_tokens": s.length, "compiles": _compiled_since(before)}
                if prof is not None:
                    rep["profile"] = _profile_summary(prof, Path(args.out) / f"piece{k}")
                    say(clock, f"ingest: piece {k} profiled: {rep['profile']['syncs']} host "
                               "waits for the device; "
                               + ", ".join(f"{x['site']} x{x['calls']}"
                                           for x in rep["profile"]["sync_sites"][:8]))
                srec["pieces"].append(rep)
                say(clock, f"ingest: piece {k}/{n_pieces}: {rep['frames']} frames "
                           f"{rep['tokens']} tokens, vision {_s(rep['vision_ms'])} s, prefill "
                           f"{_s(rep['prefill_ms'])} s (index {_s(rep.get('index_ms'))} s, "
                           f"attention {_s(rep.get('attention_ms'))} s; {rep.get('attention')}"
                           + (f", density {rep['density']:.3f}" if "density" in rep else "")
                           + f"), stream {s.length} tokens"
                           + (f", {rep['compiles']['compiles']} Triton compilations "
                              f"{rep['compiles']['seconds']:.2f} s "
                              f"({', '.join(rep['compiles']['kernels'])})"
                              if rep["compiles"]["compiles"] else ""))
                if k in ask_after:
                    for j in range(args.asks):
                        srec["asks"].append(ask(s, args, k, n_pieces, j))
                        a = srec["asks"][-1]
                        say(clock, f"ingest: question after {k}/{n_pieces} pieces "
                                   f"({a.get('stream_tokens')} tokens): ttft "
                                   f"{_s(a.get('ttft_ms'))} s")
                save()
        srec["peak_gpu_gib"] = _r(gpu.allocated)
        srec["status"] = s.status()
        streams.delete(s.id)
    finally:
        pipe = streams = None
        e2e.free_memory()
    rec["summary"] = ingest_summary(rec)
    save()


def ask(stream, args, after: int, n_pieces: int, j: int) -> dict:
    """One question about ``stream`` as it is: its TTFT and what it saw."""
    t = time.perf_counter()
    try:
        res = stream.ask(args.question, max_new_tokens=args.max_new_tokens)
    except Exception as err:
        return {"after_pieces": after, **e2e._error(err)}
    tm = res.timings_ms
    return {"after_pieces": after, "share": round(after / n_pieces, 3), "repeat": j,
            "stream_tokens": res.tokens.get("prefix"), "seen_until": res.video["seen_until"],
            "kv": stream.status()["kv"]["tier"],
            "ttft_ms": _r(tm.get("ttft")), "suffix_ms": _r(tm.get("suffix")),
            "generate_ms": _r(tm.get("generate")), "total_ms": _r(tm.get("total")),
            "wall_ms": _r((time.perf_counter() - t) * 1e3), "answer": str(res.answer)[:80]}


@contextmanager
def _profiled(args, piece: int):
    """torch.profiler around piece ``piece`` if ``--profile-pieces`` names it (CPU and, on a
    GPU, CUDA activity), else nothing: yields the profiler or None. On a GPU the piece also
    runs under torch's sync debug mode: each call that made the host wait for the device is
    counted by its site (``prof.sync_sites``, a Counter; see :func:`sync_site`)."""
    if piece not in (args.profile_pieces or ()):
        yield None
        return
    import torch
    acts = [torch.profiler.ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sites = Counter()
    with torch.profiler.profile(activities=acts, record_shapes=False) as prof, \
            warnings.catch_warnings():
        prof.sync_sites = sites
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def hook(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                sites[sync_site(traceback.extract_stack()[:-1], f"{filename}:{lineno}")] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = hook
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield prof
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


def sync_site(stack, fallback: str) -> str:
    """Where a synchronizing call came from: the innermost frame of the package (a kernel
    launcher, the estimate, the plan), as ``mminfer/...py:line (function)``; else
    ``fallback`` (the warning's own file and line)."""
    for fr in reversed(stack):
        f = fr.filename.replace(os.sep, "/")
        if "/mminfer/" in f:
            return f"mminfer/{f.rsplit('/mminfer/', 1)[1]}:{fr.lineno} ({fr.name})"
    return fallback


def _profile_summary(prof, stem: Path, top: int = 25) -> dict:
    """A profiled piece's heaviest ops by device time and by host time (also written to
    ``stem``.txt as profiler tables), for finding what a piece pays per key before it."""
    import torch
    events = prof.key_averages()
    dev_attr = None
    if len(events):
        dev_attr = "device_time_total" if hasattr(events[0], "device_time_total") \
            else "cuda_time_total"

    def rows(attr):
        if attr is None:
            return []
        ev = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:top]
        return [{"op": e.key, "calls": e.count,
                 "ms": round(getattr(e, attr, 0.0) / 1e3, 3)} for e in ev]

    stem.parent.mkdir(parents=True, exist_ok=True)
    by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    stem.with_suffix(".txt").write_text(events.table(sort_by=by, row_limit=top * 2))
    sites = getattr(prof, "sync_sites", None) or Counter()
    return {"by_device_time": rows(dev_attr) if torch.cuda.is_available() else [],
            "by_host_time": rows("self_cpu_time_total"), "table": str(stem.with_suffix(".txt")),
            # the host's waits for the device, by site (none on the CPU)
            "syncs": sum(sites.values()),
            "sync_sites": [{"site": k, "calls": n} for k, n in sites.most_common(top)]}


def _compiles():
    """mminfer.kernels.compiles, imported once TRITON_INTERPRET is settled (main sets it)."""
    from mminfer.kernels import compiles
    compiles.install()
    return compiles


def _compiled_since(before: dict) -> dict:
    """The Triton compilations since ``before`` (compiles.stats()): how many, their seconds,
    and per kernel how many (a piece's time that a new specialisation of a kernel's integer
    arguments took; none under the interpreter)."""
    now = _compiles().stats()
    was = before["kernels"]
    kernels = {k: v["compiles"] - was.get(k, {}).get("compiles", 0)
               for k, v in now["kernels"].items()}
    return {"compiles": now["compiles"] - before["compiles"],
            "seconds": round(now["seconds"] - before["seconds"], 3),
            "kernels": {k: n for k, n in kernels.items() if n}}


def _prefill_ms(t: dict):
    parts = [t.get(k) for k in ("index", "attention", "llm_other")]
    return None if any(p is None for p in parts) else sum(parts)


def ingest_summary(rec: dict) -> dict:
    """Target 1's ratio and target 2's TTFTs from the ingest part's records."""
    out = {"target_ratio": TARGET_RATIO, "target_ttft_s": TARGET_TTFT_S}
    st = rec.get("stream") or {}
    pieces = st.get("pieces") or []
    if pieces:
        out.update(pieces=len(pieces), complete=bool(st.get("complete")),
                   pieces_tokens=sum(p["tokens"] for p in pieces),
                   pieces_vision_s=_r(sum(p["vision_ms"] for p in pieces) / 1e3),
                   pieces_prefill_s=_r(sum(p["prefill_ms"] for p in pieces) / 1e3),
                   pieces_decode_s=_r(sum(p["decode_ms"] for p in pieces) / 1e3),
                   sparse_pieces=sum(p.get("attention") == "sparse" for p in pieces),
                   pieces_index_s=_r(sum(p.get("index_ms", 0.0) for p in pieces) / 1e3),
                   pieces_attention_s=_r(sum(p.get("attention_ms", 0.0) for p in pieces) / 1e3),
                   pieces_compiles=sum(p["compiles"]["compiles"] for p in pieces),
                   pieces_compile_s=_r(sum(p["compiles"]["seconds"] for p in pieces)),
                   last_piece_s=_r((pieces[-1]["vision_ms"] + pieces[-1]["prefill_ms"]) / 1e3))
        out["pieces_s"] = _r(out["pieces_vision_s"] + out["pieces_prefill_s"])
    one = (rec.get("one_shot") or {}).get("timings_ms")
    if one and _prefill_ms(one) is not None:
        oneshot = rec["one_shot"]
        out.update(one_shot_tokens=(oneshot.get("tokens") or {}).get("total"),
                   one_shot_visual_tokens=(oneshot.get("tokens") or {}).get("visual"),
                   one_shot_preprocess_s=_r(one["preprocess"] / 1e3),
                   one_shot_vision_s=_r(one["vision"] / 1e3),
                   one_shot_prefill_s=_r(_prefill_ms(one) / 1e3),
                   one_shot_attention=oneshot.get("attention_ran"),
                   one_shot_compile_s=(oneshot.get("compiles") or {}).get("seconds"),
                   one_shot_index_s=_r(one.get("index", 0.0) / 1e3),
                   one_shot_attention_s=_r(one.get("attention", 0.0) / 1e3),
                   one_shot_peak_gpu_gib=oneshot.get("peak_gpu_gib"))
        out["one_shot_s"] = _r(out["one_shot_vision_s"] + out["one_shot_prefill_s"])
    if pieces and "one_shot_s" in out:
        status = st.get("status") or {}
        # the same video both ways: the stream's visual rows are the one-shot's
        out["same_visual_tokens"] = status.get("visual_tokens") == out["one_shot_visual_tokens"]
        if out["complete"] and out["one_shot_s"] > 0:
            out["ratio"] = _r(out["pieces_s"] / out["one_shot_s"])
            out["ratio_incl_preprocess"] = _r(out["pieces_s"] / (
                out["one_shot_s"] + out["one_shot_preprocess_s"]))
            out["ratio_met"] = out["ratio"] <= TARGET_RATIO
        else:
            out["ratio"] = None
            out["ratio_why"] = "the stream was cut short: its pieces do not cover the video"
    asks = [a for a in st.get("asks") or [] if a.get("ttft_ms") is not None]
    if asks:
        out["ttft_s"] = [{"after_pieces": a["after_pieces"], "share": a["share"],
                          "tokens": a["stream_tokens"], "ttft_s": _r(a["ttft_ms"] / 1e3)}
                         for a in asks]
        out["ttft_max_s"] = max(t["ttft_s"] for t in out["ttft_s"])
        out["ttft_met"] = out["ttft_max_s"] <= TARGET_TTFT_S
    return out


def _s(ms):
    return "-" if ms is None else f"{ms / 1e3:.3f}"


# ============================================================================ realtime
def realtime_case(args):
    """The Qwen2.5-VL checkpoint the server loads: e2e's writer, a long-context sibling."""
    w, h = args.frame_size
    key = "tiny-qwen-stream" if args.tiny else "qwen7b-stream"
    return e2e.Case(key, "qwen", 2, h, w, checkpoint=key, max_position=327680)


def keeps_up(lags: list, limit_s: float) -> bool | None:
    """Whether a stream kept up: every piece of the second half answered within ``limit_s``
    of its media time (None: no piece)."""
    if not lags:
        return None
    return max(lags[len(lags) // 2:]) <= limit_s


def lag_slope(lags: list, piece_media_s: float) -> float | None:
    """The lag's growth over the second half, seconds per minute of media (least squares)."""
    half = lags[len(lags) // 2:]
    if len(half) < 2:
        return None
    n = len(half)
    xm, ym = (n - 1) / 2, sum(half) / n
    sxx = sum((i - xm) ** 2 for i in range(n))
    sxy = sum((i - xm) * (y - ym) for i, y in enumerate(half))
    return round(sxy / sxx * 60.0 / piece_media_s, 4)


class Client:
    """One stream's uploader: pieces posted one at a time; a 503 (busy) is retried after
    its Retry-After."""

    def __init__(self, url: str, timeout: float):
        import httpx
        self.http = httpx.Client(base_url=url, timeout=timeout)

    def create(self, body: dict) -> dict:
        r = self.http.post("/v1/streams", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"POST /v1/streams: {r.status_code} {r.text[:500]}")
        return r.json()

    def piece(self, sid: str, name: str, data: bytes, limit: Limit) -> tuple[int, dict, int]:
        """(status, body, retries) of one piece."""
        retries = 0
        while True:
            r = self.http.post(f"/v1/streams/{sid}/segments",
                               files={"file": (name, data, "video/mp4")})
            try:
                body = r.json()
            except ValueError:
                body = {"text": r.text[:500]}
            if r.status_code != 503 or limit.over():
                return r.status_code, body, retries
            retries += 1
            time.sleep(min(float(r.headers.get("retry-after") or 0.5), 2.0))

    def close(self):
        self.http.close()


def _piece_row(k: int, body: dict, avail: float, sent: float, done: float, t0: float,
               retries: int) -> dict:
    p, st = body.get("piece") or {}, body.get("stream") or {}
    return {"k": k, "sent_s": round(sent - t0, 3), "done_s": round(done - t0, 3),
            "lag_s": round(done - avail, 3), "waited_s": round(max(sent - avail, 0.0), 3),
            "latency_s": round(done - sent, 3), "retries": retries,
            "vision_ms": p.get("vision_ms"), "prefill_ms": p.get("prefill_ms"),
            "total_ms": p.get("total_ms"), "tokens": p.get("tokens"),
            "attention": p.get("attention"), "stream_tokens": st.get("tokens"),
            "server_lag_s": st.get("lag_seconds")}


def push_head(url, rec, a, data: bytes, n: int, limit: Limit, stop: threading.Event):
    """The head start: ``n`` pieces as fast as the server takes them."""
    c = Client(url, a.request_timeout)
    try:
        for k in range(n):
            if stop.is_set() or limit.over():
                rec["cut_short"] = "time limit in the head start"
                return
            t = time.monotonic()
            status, body, retries = c.piece(rec["id"], "head.mp4", data, limit)
            if status != 200:
                rec["errors"].append({"phase": "head", "k": k, "status": status,
                                      "error": body.get("error") or body})
                rec["state"] = "full" if status == 409 else "error"
                return
            rec["head"].append({"k": k, "s": round(time.monotonic() - t, 3),
                                "tokens": (body.get("piece") or {}).get("tokens"),
                                "retries": retries})
    except Exception as err:            # a lost connection is a result too
        rec["errors"].append({"phase": "head", "error": f"{type(err).__name__}: {err}"})
        rec["state"] = "error"
    finally:
        c.close()


def push_paced(url, rec, a, data: bytes, n: int, start: float, wall: float, t0: float,
               limit: Limit, stop: threading.Event):
    """The paced part: piece k once its media time has passed (``start + (k + 1) * wall``),
    never before the previous piece is answered."""
    c = Client(url, a.request_timeout)
    try:
        for k in range(n):
            avail = start + (k + 1) * wall
            if stop.wait(max(0.0, avail - time.monotonic())) or limit.over():
                rec["cut_short"] = "time limit in the paced part"
                return
            sent = time.monotonic()
            status, body, retries = c.piece(rec["id"], "piece.mp4", data, limit)
            done = time.monotonic()
            if status != 200:
                rec["errors"].append({"phase": "paced", "k": k, "status": status,
                                      "error": body.get("error") or body})
                rec["state"] = "full" if status == 409 else "error"
                return
            rec["pieces"].append(_piece_row(k, body, avail, sent, done, t0, retries))
    except Exception as err:
        rec["errors"].append({"phase": "paced", "error": f"{type(err).__name__}: {err}"})
        rec["state"] = "error"
    finally:
        c.close()


def _join(threads, limit: Limit, stop: threading.Event, grace_s: float, tick=None,
          every_s: float = 30.0):
    """Wait for the clients (``tick()`` every ``every_s``: a progress line); past the limit,
    tell them to stop and wait ``grace_s`` for the pieces in flight. True when the limit
    stopped them."""
    for th in threads:
        th.start()
    last = time.monotonic()
    while any(th.is_alive() for th in threads):
        if tick is not None and time.monotonic() - last >= every_s:
            last = time.monotonic()
            tick()
        if limit.over():
            stop.set()
            end = time.monotonic() + grace_s
            for th in threads:
                th.join(max(0.0, end - time.monotonic()))
            return True
        next(th for th in threads if th.is_alive()).join(0.2)
    return False


def run_step(url: str, n: int, a, files: dict, limit: Limit, clock: Limit,
             step: dict) -> dict:
    """One count of streams: created, head start, paced, one question, deleted; ``step``
    (in the report already, so a run stopped midway keeps what it holds) filled as it goes."""
    piece_wall = a.piece_s / a.pace
    n_head = round(a.head_start_minutes * 60 / a.head_piece_s)
    n_paced = max(1, round(a.minutes * 60 / a.piece_s))
    step.update({"streams": n, "head_pieces": n_head, "paced_pieces": n_paced,
                 "piece_s": a.piece_s, "pace": a.pace, "piece_wall_s": round(piece_wall, 4),
                 "max_lag_s": a.max_lag_s if a.max_lag_s is not None else 2 * piece_wall,
                 "media_minutes": round(a.head_start_minutes + n_paced * a.piece_s / 60, 3),
                 "sizes": realtime_sizes(n, round(a.head_start_minutes + a.minutes, 3))})

    def tick(phase):
        done = [len(r[phase]) for r in recs]
        lags = [r["pieces"][-1]["lag_s"] for r in recs if r["pieces"]]
        say(clock, f"realtime {n} streams, {phase}: pieces done {done}"
                   + (f", last lags {lags} s" if phase == "pieces" else ""))
    main = Client(url, a.request_timeout)
    body = {"fps": a.fps, **({"attention": a.attention} if a.attention else {}),
            **({"max_pixels": a.max_pixels} if a.max_pixels else {})}
    recs = []
    try:
        for i in range(n):
            st = main.create(body)
            recs.append({"i": i, "id": st["id"], "attention": st.get("attention"),
                         "head": [], "pieces": [], "errors": [], "state": "open"})
        step["stream_records"] = recs
        stop = threading.Event()
        t = time.monotonic()
        if n_head and _join([threading.Thread(target=push_head, daemon=True, args=(
                url, r, a, files["head"], n_head, limit, stop)) for r in recs], limit, stop,
                a.grace_s, lambda: tick("head")):
            step["cut_short"] = "time limit in the head start"
        step["head_start_s"] = round(time.monotonic() - t, 3)
        say(clock, f"realtime {n} streams: head start {a.head_start_minutes:g} min each in "
                   f"{step['head_start_s']:.1f} s" + (" (cut short)" if limit.over() else ""))
        if not limit.over() and all(r["state"] == "open" for r in recs):
            t0 = time.monotonic() + 0.05
            step["paced_wall_s_planned"] = round(n_paced * piece_wall, 3)
            if _join([threading.Thread(target=push_paced, daemon=True, args=(
                url, r, a, files["piece"], n_paced, t0 + r["i"] * piece_wall / n, piece_wall,
                t0, limit, stop)) for r in recs], limit, stop, a.grace_s,
                    lambda: tick("pieces")):
                step["cut_short"] = "time limit in the paced part"
            step["paced_wall_s"] = round(time.monotonic() - t0, 3)
        elif limit.over():
            step["cut_short"] = step.get("cut_short") or "time limit before the paced part"
        judge(step, recs, a)
        if recs and not limit.over():
            step["question"] = http_ask(main, recs[0]["id"], a)
        for r in recs:
            r["status"] = main.http.get(f"/v1/streams/{r['id']}").json()
    finally:
        if "kept_up" not in step:       # stopped midway: what the pieces done say
            step["cut_short"] = "stopped"
            judge(step, recs, a)
        for r in recs:
            try:
                main.http.delete(f"/v1/streams/{r['id']}")
            except Exception:      # noqa: BLE001 - the server may be gone; the step is kept
                pass
        main.close()
    say(clock, f"realtime {n} streams: kept up {step['streams_kept_up']}/{n}, lag last "
               f"{[r['lag_last_s'] for r in recs]} s" + (" (cut short)" if step["cut_short"]
                                                          else ""))
    return step


def judge(step: dict, recs: list, a) -> None:
    """Each stream's lags and verdict, and the step's. A stream fell behind when it failed
    (full, a piece refused) or its pieces lagged past the limit, even in a part cut short;
    one cut short within the limit is undecided (None). The step kept up when every stream
    did, fell behind when one did, else is undecided."""
    for r in recs:
        lags = [p["lag_s"] for p in r["pieces"]]
        ok = keeps_up(lags, step["max_lag_s"])
        if r["state"] != "open":
            ok = False
        elif ok and len(lags) < step["paced_pieces"]:
            ok = None
        r.update(pieces_done=len(lags), lag_last_s=lags[-1] if lags else None,
                 lag_max_s=max(lags) if lags else None,
                 lag_growth_s_per_min=lag_slope(lags, a.piece_s),
                 server_lag_last_s=r["pieces"][-1]["server_lag_s"] if lags else None,
                 kept_up=ok)
    step["cut_short"] = step.get("cut_short") or any("cut_short" in r for r in recs) or None
    verdicts = [r["kept_up"] for r in recs]
    step["kept_up"] = False if False in verdicts else \
        None if None in verdicts or not verdicts else True
    step["streams_kept_up"] = sum(v is True for v in verdicts)
    step["paced_minutes_done"] = round(min((r["pieces_done"] for r in recs), default=0)
                                       * a.piece_s / 60, 3)


def http_ask(client: Client, sid: str, a) -> dict:
    """``/v1/answer`` with ``stream_id``: the server's TTFT over the stream as it is."""
    r = client.http.post("/v1/answer", data={
        "question": a.question, "stream_id": sid, "max_new_tokens": str(a.max_new_tokens)},
        files={"dummy": ("x.bin", b"", "application/octet-stream")})
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.text[:500]}
    b = r.json()
    return {"status": 200, "ttft_ms": b["timings_ms"].get("ttft"),
            "tokens": b["tokens"]["total"], "seen_until": b["video"]["seen_until"]}


def run_realtime(args, report: dict, save, clock: Limit) -> None:
    """Target 3 (the module doc): the server, a warm-up stream, the search over counts."""
    import torch
    import load       # benchmarks/load.py: `mminfer serve` in a subprocess, stopped with us

    limit = Limit(args.realtime_max_s, clock)
    rec = report["realtime"] = {"limit_s": args.realtime_max_s, "steps": [],
                                "target_streams": TARGET_STREAMS,
                                "target_minutes": TARGET_MINUTES}
    work = Path(args.work_dir)
    case = realtime_case(args)
    path, info = e2e.ensure_checkpoint(case, work, torch.device(args.device), args.tiny, {})
    e2e.free_memory()
    rec["checkpoint"] = info
    w, h = args.frame_size
    files = {}
    for name, secs in (("piece", args.piece_s), ("head", args.head_piece_s)):
        n = max(2, round(secs * args.video_fps))
        f = work / f"stream_{name}_{n}f_{w}x{h}_{args.video_fps:g}fps.mp4"
        if not f.exists():
            e2e.write_video(f, n, h, w, args.video_fps)
        files[name] = f.read_bytes()
        rec[f"{name}_file"] = {"path": str(f), "frames": n, "seconds": n / args.video_fps,
                               "bytes": len(files[name])}
    serve = ["--model", str(path), "--device", args.device, "--queue-size", "256",
             "--max-uploads-per-client", "0", "--shadow-rate", "0", "--no-self-calibrate",
             "--timeout-s", str(args.request_timeout)]
    if args.stream_kv_gb is not None:
        serve += ["--stream-kv-gb", str(args.stream_kv_gb)]
    if args.kv_cache_dtype not in (None, "auto"):
        serve += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.quantization:
        serve += ["--quantization", args.quantization]
    serve += args.serve_arg
    rec["serve_args"] = serve
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    save()
    srv = load.Server(serve, env, log=Path(args.out) / "server-realtime.log",
                      log_level=args.server_log_level)
    rec["server"] = {"url": srv.url, "ready_s": round(srv.ready_s, 2)}
    say(clock, f"realtime: server ready in {srv.ready_s:.1f} s at {srv.url}")
    try:
        rec["warmup"] = warmup_stream(srv.url, args, files, limit)
        say(clock, f"realtime: warm-up stream done ({rec['warmup']})")
        save()
        stopped = None
        per_head_stream_s = None        # head-start seconds per stream, from the steps run
        for n in args.streams:
            paced_s = max(1, round(args.minutes * 60 / args.piece_s)) * args.piece_s / args.pace
            head_est = (per_head_stream_s or 0.0) * n
            if stopped:
                rec["steps"].append({"streams": n, "skipped": stopped})
                continue
            if limit.left() < paced_s + head_est + args.grace_s:
                rec["steps"].append({"streams": n, "skipped": (
                    f"time limit: {limit.left():.0f} s left, the step needs ~"
                    f"{paced_s + head_est:.0f} s (paced {paced_s:.0f} s + head start "
                    f"~{head_est:.0f} s)")})
                say(clock, f"realtime {n} streams: skipped ({rec['steps'][-1]['skipped']})")
                continue
            say(clock, f"realtime {n} streams: {args.head_start_minutes:g} min head start, "
                       f"then {args.minutes:g} min paced at {args.pace:g}x real time")
            step = {"streams": n}
            rec["steps"].append(step)
            try:
                run_step(srv.url, n, args, files, limit, clock, step)
            except Exception as err:      # the server may have died: the step says why
                step.update(e2e._error(err), server_log="".join(srv.tail)[-4000:])
            if step.get("head_pieces") and step.get("head_start_s"):
                per_head_stream_s = step["head_start_s"] / n
            if step.get("kept_up") is False and args.search == "stop":
                stopped = f"{n} streams fell behind (--search stop)"
            save()
        rec["metrics"] = _stream_metrics(srv.url)
    except KeyboardInterrupt:         # stopped: the report first, then the server at once
        rec["summary"] = realtime_summary(rec, args)
        save()
        load.stop_live()
        raise
    finally:
        srv.close()
    rec["summary"] = realtime_summary(rec, args)
    save()


def warmup_stream(url: str, a, files: dict, limit: Limit) -> dict:
    """One stream: a head piece and two pieces, a question; deleted (kernels compiled and
    the decode workers started before anything is timed)."""
    c = Client(url, a.request_timeout)
    out = {}
    try:
        body = {"fps": a.fps, **({"attention": a.attention} if a.attention else {}),
                **({"max_pixels": a.max_pixels} if a.max_pixels else {})}
        sid = c.create(body)["id"]
        t = time.monotonic()
        for name in ("head", "piece", "piece"):
            status, b, _ = c.piece(sid, name + ".mp4", files[name], limit)
            if status != 200:
                out["error"] = {"status": status, "body": b}
                break
        out["pieces_s"] = round(time.monotonic() - t, 3)
        if "error" not in out:
            out["question"] = http_ask(c, sid, a)
        c.http.delete(f"/v1/streams/{sid}")
    finally:
        c.close()
    return out


def _stream_metrics(url: str) -> dict:
    """The server's stream counters from /metrics (pieces, refusals, spills)."""
    import httpx
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except Exception as err:        # noqa: BLE001 - a figure missing is said, not fatal
        return {"error": str(err)[:300]}
    return {ln.split()[0]: ln.split()[-1] for ln in text.splitlines()
            if ln.startswith("mminfer:stream") and not ln.startswith("#")
            and "_bucket" not in ln}


def realtime_summary(rec: dict, args) -> dict:
    steps = [s for s in rec["steps"] if "kept_up" in s]
    kept = [s["streams"] for s in steps if s["kept_up"] is True]
    fell = [s["streams"] for s in steps if s["kept_up"] is False]
    best = max(kept) if kept else None
    minutes = args.head_start_minutes + args.minutes
    return {"max_streams_kept_up": best, "counts_kept_up": kept, "counts_fell_behind": fell,
            "counts_cut_short": [s["streams"] for s in steps if s.get("cut_short")],
            "minutes": round(minutes, 3), "head_start_minutes": args.head_start_minutes,
            "paced_minutes": args.minutes, "pace": args.pace,
            "target_met": None if best is None else bool(
                best >= TARGET_STREAMS and minutes >= TARGET_MINUTES and args.pace >= 1)}


# ============================================================================ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/stream", help="folder for stream_ingest.json")
    p.add_argument("--parts", nargs="+", choices=("ingest", "realtime"),
                   default=["ingest", "realtime"])
    p.add_argument("--tiny", action="store_true",
                   help="tiny checkpoints and short videos on the CPU (sparse only with "
                   "TRITON_INTERPRET=1, which --tiny sets when it is unset)")
    p.add_argument("--work-dir", default=None,
                   help="checkpoints and videos (default /tmp/mminfer_e2e, shared with "
                   "e2e.py; tiny: OUT/work)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                   help="both parts (the server's flag for realtime)")
    p.add_argument("--quantization", choices=("fp8",), default=None)
    p.add_argument("--attention", choices=("sparse", "dense", "auto"), default="sparse",
                   help="the one-shot's and the streams' attention (ingest: dense where sparse "
                   "cannot run, said in the report)")
    p.add_argument("--stream-kv-gb", type=float, default=None,
                   help="the streams' device budget, GiB (default: the product's, the video "
                   "cache's: half the GPU)")
    p.add_argument("--question", default=e2e.QUESTION)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-s", type=float, default=None, help="the whole run's time limit")
    p.add_argument("--commit", default=None, help="recorded in the JSON (else git's)")
    g = p.add_argument_group("ingest (targets 1-2)")
    g.add_argument("--frames", type=int, default=None,
                   help="frames of the video (default 4096: 1.05M tokens; tiny 48)")
    g.add_argument("--piece-frames", type=int, default=None,
                   help="frames per piece (default 120: one minute at 2 fps; tiny 8)")
    g.add_argument("--sparse-min-tokens", type=int, default=None,
                   help="pieces of fewer rows run dense (default: the product's 2048; tiny 0)")
    g.add_argument("--ask-at", type=float, nargs="+", default=[0.25, 0.5, 1.0],
                   help="ask after these shares of the pieces")
    g.add_argument("--asks", type=int, default=2, help="questions at each point")
    g.add_argument("--piece-lines", type=float, default=None,
                   help="the pieces' share of the count budgets (the config's "
                        "estimation.piece_lines; default: the config's, 1 when unset)")
    g.add_argument("--profile-pieces", type=int, nargs="+", default=None, metavar="K",
                   help="pieces (1-based) run under torch.profiler: their heaviest ops by "
                        "device and host time in the report, tables in --out")
    g.add_argument("--warmup-frames", type=int, default=None,
                   help="frames of the warm-up one-shot (default 512; tiny 8)")
    g.add_argument("--ingest-max-s", type=float, default=None,
                   help="the ingest part's time limit (then it reports what it measured)")
    g = p.add_argument_group("realtime (target 3)")
    g.add_argument("--streams", type=int, nargs="+", default=None,
                   help="counts of concurrent streams to try, in order (default 1 2 4 8 12; "
                   "tiny 1 2)")
    g.add_argument("--search", choices=("stop", "all"), default="stop",
                   help="stop: skip the counts after one that falls behind; all: run each")
    g.add_argument("--minutes", type=float, default=None,
                   help="paced media per stream (default 3; tiny 0.2)")
    g.add_argument("--head-start-minutes", type=float, default=None,
                   help="media each stream takes unpaced first (default 7; tiny 0.1)")
    g.add_argument("--piece-s", type=float, default=None,
                   help="seconds of media per paced piece (default 4; tiny 2)")
    g.add_argument("--head-piece-s", type=float, default=None,
                   help="seconds of media per head-start piece (default 60; tiny 6)")
    g.add_argument("--pace", type=float, default=1.0,
                   help="media seconds sent per wall second (1: real time)")
    g.add_argument("--max-lag-s", type=float, default=None,
                   help="a stream keeps up while its pieces' lag stays within this (default: "
                   "two pieces' wall time)")
    g.add_argument("--fps", type=float, default=2.0, help="the streams' sampling rate")
    g.add_argument("--video-fps", type=float, default=2.0, help="the piece files' frame rate")
    g.add_argument("--frame-size", type=int, nargs=2, default=None, metavar=("W", "H"),
                   help="the piece files' frames (default 560 420; tiny 112 84)")
    g.add_argument("--max-pixels", type=int, default=None,
                   help="the streams' pixel budget per frame (default: the model's)")
    g.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for `mminfer serve` (repeatable)")
    g.add_argument("--server-log-level", default="warning")
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--grace-s", type=float, default=20.0,
                   help="past the limit: how long the pieces in flight are waited for")
    g.add_argument("--realtime-max-s", type=float, default=None,
                   help="the realtime part's time limit (counts that do not fit are skipped)")
    a = p.parse_args(argv)
    tiny = a.tiny
    defaults = dict(frames=48 if tiny else None, piece_frames=8 if tiny else 120,
                    sparse_min_tokens=0 if tiny else None, warmup_frames=8 if tiny else 512,
                    streams=[1, 2] if tiny else [1, 2, 4, 8, 12],
                    minutes=0.2 if tiny else 3.0, head_start_minutes=0.1 if tiny else 7.0,
                    piece_s=2.0 if tiny else 4.0, head_piece_s=6.0 if tiny else 60.0,
                    frame_size=[112, 84] if tiny else [560, 420])
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if tiny:
        a.max_new_tokens = min(a.max_new_tokens, 4)
        if a.asks == 2:
            a.asks = 1
    if a.piece_frames < 1 or a.asks < 0 or a.pace <= 0 or a.piece_s <= 0 or \
            a.head_piece_s <= 0 or a.minutes <= 0 or a.head_start_minutes < 0:
        p.error("--piece-frames, --pace, --piece-s, --head-piece-s, --minutes must be "
                "positive; --asks and --head-start-minutes >= 0")
    if any(not 0 < f <= 1 for f in a.ask_at):
        p.error("--ask-at takes shares in (0, 1]")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")    # before triton loads
    import torch
    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available()
                                  else "cuda")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.work_dir = args.work_dir or str(out / "work" if args.tiny else "/tmp/mminfer_e2e")
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    clock = Limit(args.max_s)
    case = ingest_case(args)
    report = {"benchmark": "stream_ingest (issue 43: live video)",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "argv": sys.argv[1:] if argv is None else list(argv),
              "env": e2e.environment(args), "device": args.device, "dtype": args.dtype,
              "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
              "question": args.question, "parts": args.parts,
              # the GPU run's shapes (issue 43's targets), whatever this run's are
              "full_size_plan": {"ingest": sizes(4096, 120, 2.0),
                                 "realtime": [realtime_sizes(n, TARGET_MINUTES)
                                              for n in (TARGET_STREAMS, 12)]}}
    if not args.tiny:       # this run's, in the full-size models' tokens
        report["sizes"] = {"ingest": sizes(case.frames, args.piece_frames, case.fps),
                           "realtime": realtime_sizes(
                               max(args.streams),
                               round(args.head_start_minutes + args.minutes, 3))}

    def save():
        report["elapsed_s"] = round(clock.elapsed(), 1)
        tmp = out / "stream_ingest.json.partial"
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(out / "stream_ingest.json")

    def interrupted(signum, frame):     # timeout(1) sends TERM: still write the report
        raise KeyboardInterrupt(f"signal {signum} after {clock.elapsed():.0f} s")

    signal.signal(signal.SIGTERM, interrupted)
    save()
    rc = 0
    try:
        for part, fn in (("ingest", run_ingest), ("realtime", run_realtime)):
            if part not in args.parts:
                continue
            say(clock, f"part {part}")
            try:
                fn(args, report, save, clock)
            except KeyboardInterrupt:
                raise
            except Exception as err:    # one part failing must not lose the other
                report.setdefault(part, {}).update(e2e._error(err))
                say(clock, f"part {part} failed: {report[part]['error'][:500]}")
                rc = 1
            save()
    except KeyboardInterrupt as err:
        report["interrupted"] = str(err)
        rc = 130
    finally:
        if "load" in sys.modules:       # a server still running would hold the GPU
            sys.modules["load"].stop_live()
        save()
        print(summary_text(report), flush=True)
    return rc


def summary_text(report: dict) -> str:
    lines = []
    s = (report.get("ingest") or {}).get("summary")
    if s:
        lines.append(f"ingest: pieces {s.get('pieces')} ({s.get('pieces_s')} s vision + "
                     f"prefill) vs one-shot {s.get('one_shot_s')} s: ratio {s.get('ratio')} "
                     f"(target <= {TARGET_RATIO}; incl. one-shot preprocess "
                     f"{s.get('ratio_incl_preprocess')})")
        for t in s.get("ttft_s") or []:
            lines.append(f"  question after {t['after_pieces']} pieces ({t['tokens']} tokens):"
                         f" ttft {t['ttft_s']} s (target <= {TARGET_TTFT_S})")
    r = report.get("realtime") or {}
    for st in r.get("steps") or []:
        if "skipped" in st or "error" in st:
            lines.append(f"realtime {st['streams']} streams: "
                         f"{st.get('skipped') or st.get('error')}"[:300])
            continue
        lags = [rr.get("lag_last_s") for rr in st.get("stream_records", [])]
        lines.append(f"realtime {st['streams']} streams over {st.get('media_minutes')} min: "
                     f"kept up {st.get('streams_kept_up')}/{st['streams']}, last lags {lags} s"
                     + (" (cut short)" if st.get("cut_short") else ""))
    if r.get("summary"):
        lines.append(f"realtime: most streams kept up {r['summary']['max_streams_kept_up']} "
                     f"(target >= {TARGET_STREAMS} over {TARGET_MINUTES:g} min)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
