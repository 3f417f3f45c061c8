"""Many users at once, through the real server: new long videos arriving back to back while
questions about already-cached videos arrive at a steady rate, with the scheduler (requests
taking turns on the model) against the serial worker (``--max-num-seqs 1``) in the same run.

    python benchmarks/load.py --model CKPT --new-video long.mp4 --cached-video a.mp4 \
        --cached-video b.mp4 ... --duration-s 300 --hit-rate 2 --out results/load

For each server mode it starts ``mminfer serve`` (loopback, a fresh data folder), asks each
cached video once (its prefix is then in the video cache), then for ``--duration-s``:

* a *new-video* client sends the new video back to back, each time under another cache key
  (``max_frames`` = ``--max-frames`` + i, i < ``--key-span``: with a video of at most
  ``--max-frames`` sampled frames, the same frames and the same work, never a hit; the
  server's ``--max-frames-limit`` must admit ``--max-frames`` + ``--key-span``);
* a *hit* client sends a question about one of the cached videos every 1/``--hit-rate`` s
  (round robin), each in its own connection, without waiting for the previous one.

Several GPUs (``--data-parallel 1,2,...``): each count N above 1 starts ``mminfer serve
--data-parallel N`` once per ``--dp-routing`` mode (``affinity``, ``round_robin``), N = 1 the
ordinary server, and scales the workload by N: N new-video clients, N x ``--hit-rate``, the
cached videos asked once each first. Reported besides, per mode: the hit class's hit rate (a
question about a cached video that landed where its prefix is), answers per second, and that
throughput against N = 1's (``scaling``); ``health_after`` lists what each engine was sent.
``--ray ADDRESS`` runs each N > 1 as ``mminfer serve --ray ADDRESS --ray-replicas N`` (Ray
Serve replicas, the same routing modes) instead.

``--decoders N`` then runs a decode phase: N answers decoding at once, each over its own
cached prefix, against one alone; ``--decode-shared`` adds N answers about ONE cached prefix
(distinct question texts, so N requests of their own fork that one entry and their decode
steps read it once for all: shared-prefix attention), reported under ``decode.shared``.

Reported per mode and class: count, errors (no request may be lost: every one answered 200),
time to first token percentiles (the server's ``timings_ms.ttft``, arrival to first token),
the ``wait`` stage, client latency; new videos per minute; and the ratio of the new videos'
TTFT against one asked alone (``--alone`` runs it once before the load, on the same server).
Writes ``load.json`` under ``--out`` and prints a table. Timings on a GPU: run it there with a
real or random-weight checkpoint (benchmarks/run_load_h200.sh); on a CPU, the embedded model
exercises the same path (tests/test_benchmarks.py runs it briefly).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mminfer.engine.timing import SERVED_STAGES  # noqa: E402


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 3)


def summary(rows):
    ok = [r for r in rows if r["status"] == 200]
    ttft = [r["ttft_ms"] for r in ok]
    return {"count": len(rows), "ok": len(ok), "errors": len(rows) - len(ok),
            "ttft_ms": {"p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9), "p99": pct(ttft, 0.99),
                        "max": max(ttft) if ttft else None},
            "wait_ms": {"p50": pct([r["wait_ms"] for r in ok], 0.5),
                        "p99": pct([r["wait_ms"] for r in ok], 0.99)},
            "latency_ms": {"p50": pct([r["latency_ms"] for r in ok], 0.5),
                           "p99": pct([r["latency_ms"] for r in ok], 0.99)},
            "cache": {c: sum(1 for r in ok if r["cache"] == c)
                      for c in sorted({r["cache"] for r in ok})},
            "stages_ms": stages(ok),
            # what each lost request was told (status 0: no answer at all), counted
            "lost": dict(collections.Counter(f"{r['status']}: {str(r.get('error'))[:300]}"
                                             for r in rows if r["status"] != 200))}


def stages(ok) -> dict:
    """Where the answers' time went (upload, queue, wait, suffix, generate, ...): each stage's
    [p50, p99] in ms, the stages no answer spent time in left out."""
    out = {}
    for k in SERVED_STAGES:
        v = [r.get("stages", {}).get(k) or 0.0 for r in ok]
        if any(v):
            out[k] = [pct(v, 0.5), pct(v, 0.99)]
    return out


class Server:
    """``mminfer serve`` in a subprocess on a free loopback port."""

    def __init__(self, args: list[str], env: dict):
        self.data = tempfile.TemporaryDirectory(prefix="mminfer-load-")
        cmd = [sys.executable, "-m", "mminfer.cli", "serve", "--port", "0", "--data-dir",
               self.data.name, "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.url = None
        self.tail = collections.deque(maxlen=200)   # the server's last lines, for a failure
        deadline = time.monotonic() + 600
        lines = []
        while self.url is None and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("the server did not start:\n" + "".join(lines[-30:]))
            lines.append(line)
            if " at http://" in line:
                self.url = line.split(" at ", 1)[1].split()[0]
        if self.url is None:
            raise RuntimeError("the server did not start in time")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.tail.append(line)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.data.cleanup()


def ask(url, video: Path, question: str, data: dict, timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/answer", timeout=timeout,
                       data={"question": question, **{k: str(v) for k, v in data.items()}},
                       files={"video": (video.name, video.read_bytes(), "video/mp4")})
        body = r.json()
    except Exception as e:  # noqa: BLE001 - a lost request is a result, counted as one
        return {"status": 0, "error": f"{type(e).__name__}: {e}", "start": t0,
                "latency_ms": (time.monotonic() - t0) * 1e3}
    t = body.get("timings_ms", {}) if r.status_code == 200 else {}
    return {"status": r.status_code, "start": t0, "end": time.monotonic(),
            "latency_ms": round((time.monotonic() - t0) * 1e3, 3),
            "ttft_ms": t.get("ttft"), "wait_ms": t.get("wait", 0.0), "cache": body.get("cache"),
            "tokens": (body.get("tokens") or {}).get("total"),
            "generated": (body.get("tokens") or {}).get("generated"),
            "generate_ms": t.get("generate"), "stages": t,
            "error": None if r.status_code == 200 else body.get("error")}


def run_mode(name, serve_args, a, env, scale: int = 1) -> dict:
    """One server mode under the mixed workload, ``scale`` times over (``scale`` new-video
    clients, ``scale`` x the hit rate: one engine's load per engine)."""
    srv = Server(serve_args, env)
    try:
        q = a.question
        base = dict(max_new_tokens=a.max_new_tokens, attention=a.attention)
        for v in a.cached_video:                     # their prefixes are cached now
            r = ask(srv.url, Path(v), q, base, a.timeout_s)
            if r["status"] != 200:
                raise RuntimeError(f"{name}: caching {v} failed: {r}")
        alone = None
        if a.alone:
            alone = ask(srv.url, Path(a.new_video), q,
                        {**base, "max_frames": a.max_frames + a.key_span}, a.timeout_s)
        new_rows, hit_rows = [], []
        lock = threading.Lock()
        stop_at = time.monotonic() + a.duration_s

        def new_client(c):
            i = 0
            while time.monotonic() < stop_at:     # keys never repeat across clients either
                r = ask(srv.url, Path(a.new_video), q,
                        {**base, "max_frames": a.max_frames + (i * scale + c) % a.key_span},
                        a.timeout_s)
                i += 1
                with lock:
                    new_rows.append(r)

        def one_hit(v):
            r = ask(srv.url, Path(v), q, base, a.timeout_s)
            with lock:
                hit_rows.append(r)

        new_threads = [threading.Thread(target=new_client, args=(c,)) for c in range(scale)]
        for t in new_threads:
            t.start()
        hits = []
        k = 0
        rate = a.hit_rate * scale
        next_at = time.monotonic() + 1.0 / rate
        while time.monotonic() < stop_at:
            time.sleep(max(0.0, next_at - time.monotonic()))
            th = threading.Thread(target=one_hit,
                                  args=(a.cached_video[k % len(a.cached_video)],))
            th.start()
            hits.append(th)
            k += 1
            next_at += 1.0 / rate
        for t in new_threads:
            t.join()
        for th in hits:
            th.join()
        elapsed = max([r.get("end", r["start"]) for r in new_rows + hit_rows] +
                      [stop_at]) - (stop_at - a.duration_s)
        new = summary(new_rows)
        done_new = sum(1 for r in new_rows if r["status"] == 200)
        new["per_minute"] = round(done_new / elapsed * 60, 3)
        if alone is not None and alone["status"] == 200 and new["ttft_ms"]["p50"]:
            new["alone_ttft_ms"] = alone["ttft_ms"]
            new["ttft_vs_alone_p50"] = round(new["ttft_ms"]["p50"] / alone["ttft_ms"], 3)
            new["ttft_vs_alone_max"] = round(new["ttft_ms"]["max"] / alone["ttft_ms"], 3)
        health = httpx.get(f"{srv.url}/health", timeout=30).json()
        hit = summary(hit_rows)
        hit_ok = [r for r in hit_rows if r["status"] == 200]
        hit["hit_rate"] = round(sum(r["cache"] in ("hit", "host") for r in hit_ok)
                                / len(hit_ok), 4) if hit_ok else None
        answered = sum(1 for r in new_rows + hit_rows if r["status"] == 200)
        out = {"mode": name, "serve_args": serve_args, "engines": scale,
               "elapsed_s": round(elapsed, 3), "answers_per_s": round(answered / elapsed, 3),
               "new_video": new, "hit": hit, "health_after": health}
        if new["errors"] or hit["errors"]:         # the server's side of a lost request
            out["server_log"] = "".join(srv.tail)[-8000:]
        return out
    except Exception as e:  # noqa: BLE001 - one mode's failure is reported, the next one runs
        return {"mode": name, "serve_args": serve_args, "engines": scale,
                "failed": f"{type(e).__name__}: {e}", "server_log": "".join(srv.tail)[-8000:]}
    finally:
        srv.close()


def run_decoders(serve_args, a, env) -> dict:
    """Answers decoding together: ``--decoders`` questions, each about its own cached prefix of
    the decode video (one video under ``--decoders`` cache keys: the same frames, distinct
    entries), sent at once, against one of them asked alone. Time per token is the server's
    ``generate`` stage over the tokens after the first; the aggregate rate counts every
    generated token over the window from the first answer's first token to the last answer.
    With ``--decode-shared``, then (the same server) as many questions about ONE of those
    prefixes, each its own text, so they fork that one entry and their decode steps read it
    once for all of them (shared-prefix attention), against the first asked alone: the result
    under ``"shared"``."""
    srv = Server(serve_args, env)
    try:
        video, n = Path(a.decode_video), a.decoders
        base = dict(max_new_tokens=a.decode_tokens, attention=a.attention)
        keys = [dict(base, max_frames=a.max_frames + a.key_span + 1 + i) for i in range(n)]
        for k in keys:                                 # each key's prefix is cached now
            r = ask(srv.url, video, a.question, k, a.timeout_s)
            if r["status"] != 200:
                raise RuntimeError(f"decoders: caching failed: {r}")
        out = _decode_at_once(srv, video, [(a.question, k) for k in keys], a)
        if a.decode_shared:
            # distinct texts: N requests of their own (their answers differ), one prefix
            asks = [(a.question if i == 0 else f"{a.question} (reader {i + 1})", keys[0])
                    for i in range(n)]
            out["shared"] = _decode_at_once(srv, video, asks, a)
        return out
    except Exception as e:  # noqa: BLE001 - reported; the modes' figures stand
        return {"failed": f"{type(e).__name__}: {e}", "server_log": "".join(srv.tail)[-8000:]}
    finally:
        srv.close()


def _decode_at_once(srv, video, asks, a) -> dict:
    """``asks`` ((question, form data) each, every prefix cached) sent at once, against the
    first asked alone (twice: the second is the one timed)."""
    n = len(asks)
    alone = [ask(srv.url, video, *asks[0], a.timeout_s) for _ in range(2)][-1]
    rows = [None] * n

    def one(i):
        rows[i] = ask(srv.url, video, *asks[i], a.timeout_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in rows if r["status"] == 200]

    def per_token(r):
        return r["generate_ms"] / max(1, r["generated"] - 1)
    first = min(r["start"] + r["ttft_ms"] / 1e3 for r in ok) if ok else 0.0
    window = (max(r["end"] for r in ok) - first) if ok else 0.0
    agg = sum(r["generated"] - 1 for r in ok) / window if window > 0 else None
    one_rate = 1e3 / per_token(alone) if alone["status"] == 200 else None
    out = {"decoders": n, "errors": n - len(ok), "cache": [r["cache"] for r in ok],
           "lost": [f"{r['status']}: {str(r.get('error'))[:300]}" for r in rows
                    if r["status"] != 200],
           "prefixes": len({tuple(sorted(d.items())) for _, d in asks}),
           "prefix_tokens": alone.get("tokens"),
           "alone_ms_per_token": round(per_token(alone), 3) if one_rate else None,
           "ms_per_token": [round(per_token(r), 3) for r in ok],
           "aggregate_tokens_per_s": round(agg, 2) if agg else None,
           "alone_tokens_per_s": round(one_rate, 2) if one_rate else None}
    if agg and one_rate:
        out["aggregate_vs_alone"] = round(agg / one_rate, 3)
        out["worst_per_token_vs_alone"] = round(
            max(out["ms_per_token"]) / out["alone_ms_per_token"], 3)
    return out


def modes_of(a, common: list[str]) -> list[tuple[str, list[str], int]]:
    """(name, `mminfer serve` arguments, engines) of each server mode the flags ask for."""
    named = {"serial": common + ["--max-num-seqs", "1"], "scheduler": common}
    # the scheduler first: where a device call runs out of time, its figures are the ones kept
    chosen = a.modes if a.modes is not None else \
        ("" if a.data_parallel else "scheduler,serial")
    out = [(name, named[name], 1) for name in chosen.split(",") if name]
    for n in (int(x) for x in (a.data_parallel or "").split(",") if x):
        if n == 1:
            out.append(("dp1", common, 1))
            continue
        engines = ["--ray", a.ray, "--ray-replicas", str(n)] if a.ray else \
            ["--data-parallel", str(n)]
        for routing in a.dp_routing.split(","):
            out.append((f"{'ray' if a.ray else 'dp'}{n}-{routing}",
                        common + engines + ["--dp-routing", routing], n))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--new-video", required=True, help="the long video sent back to back")
    p.add_argument("--cached-video", action="append", required=True,
                   help="a video cached before the load; questions about it arrive at "
                        "--hit-rate (repeatable)")
    p.add_argument("--question", default="What number appears in the video?")
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--hit-rate", type=float, default=2.0, help="cache-hit questions a second")
    p.add_argument("--max-frames", type=int, default=768,
                   help="the new video's frame cap, at least its sampled frames (its key "
                        "varies above it)")
    p.add_argument("--key-span", type=int, default=200,
                   help="distinct keys of the new video (max_frames .. + key-span)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--attention", default="auto")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--alone", action="store_true",
                   help="ask the new video once alone first (the TTFT ratio's baseline)")
    p.add_argument("--modes", default=None,
                   help="serial (--max-num-seqs 1) and/or scheduler (the default server); "
                        "default: both, or none with --data-parallel")
    p.add_argument("--data-parallel", default=None, metavar="N,N...",
                   help="engine counts to compare, e.g. 1,2: N > 1 runs `mminfer serve "
                        "--data-parallel N` per --dp-routing mode, N = 1 the ordinary server; "
                        "the workload is scaled by N")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="with --data-parallel: each N > 1 runs `mminfer serve --ray ADDRESS "
                        "--ray-replicas N` (Ray Serve replicas; local: a cluster on this "
                        "machine for each mode) instead of --data-parallel N")
    p.add_argument("--dp-routing", default="affinity,round_robin",
                   help="routing modes compared at each N > 1 (affinity, round_robin)")
    p.add_argument("--decoders", type=int, default=0,
                   help="after the modes: this many answers decoding at once (each over its "
                        "own cached prefix of --decode-video) against one alone")
    p.add_argument("--decode-shared", action="store_true",
                   help="then as many answers decoding at once about ONE cached prefix (each "
                        "question its own text: they fork one entry and share its attention), "
                        "reported as decode.shared")
    p.add_argument("--decode-video", default=None,
                   help="the video of the decode phase (default: the first --cached-video)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for `mminfer serve` (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    common = (["--model", a.model] if a.model else []) + a.serve_arg + [
        "--queue-size", "256", "--timeout-s", str(a.timeout_s), "--shadow-rate", "0",
        "--max-frames-limit", str(max(a.max_frames + a.key_span + a.decoders + 1, 768))]
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "modes": {}}
    for name, args, scale in modes_of(a, common):
        out["modes"][name] = m = run_mode(name, args, a, env, scale)
        print(f"{name}: " + (f"FAILED {m['failed']}\n{m['server_log'][-3000:]}" if "failed" in m
              else json.dumps({c: m[c] for c in ("new_video", "hit")})), flush=True)
        if a.out is not None:       # each mode as it ends: a run stopped later keeps it
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "load.json").write_text(json.dumps(out, indent=1))
    if a.decoders:
        a.decode_video = a.decode_video or a.cached_video[0]
        out["decode"] = d = run_decoders(common, a, env)
        print("decode: " + json.dumps({k: v for k, v in d.items()
                                       if k not in ("server_log", "shared")}), flush=True)
        if "shared" in d:
            print("decode (one shared prefix): " + json.dumps(d["shared"]), flush=True)
        if "failed" in d:
            print(d["server_log"][-3000:])
        if a.out is not None:
            (a.out / "load.json").write_text(json.dumps(out, indent=1))
    failed = [n for n, m in out["modes"].items() if "failed" in m]
    for n in failed:
        print(f"{n}: FAILED {out['modes'][n]['failed']}")
    out["failed"] = {n: out["modes"].pop(n) for n in failed}
    base = next((m for m in out["modes"].values() if m["engines"] == 1
                 and "--max-num-seqs" not in m["serve_args"]), None)
    for m in out["modes"].values():
        if base is not None and base["answers_per_s"]:
            m["scaling"] = round(m["answers_per_s"] / base["answers_per_s"], 3)
    print(f"{'mode':<20} {'class':<6} {'n':>4} {'err':>4} {'ttft p50':>10} {'p99':>10} "
          f"{'max':>10} {'wait p99':>10} {'new/min':>8} {'hit%':>6} {'ans/s':>7} {'x1':>6}")
    for name, m in out["modes"].items():
        for cls in ("new_video", "hit"):
            s = m[cls]
            t = s["ttft_ms"]
            rate = s.get("hit_rate")
            print(f"{name:<20} {cls[:6]:<6} {s['count']:>4} {s['errors']:>4} "
                  f"{t['p50'] or 0:>10.1f} {t['p99'] or 0:>10.1f} {t['max'] or 0:>10.1f} "
                  f"{s['wait_ms']['p99'] or 0:>10.1f} {s.get('per_minute', ''):>8} "
                  f"{'' if rate is None else f'{rate * 100:.0f}':>6} "
                  f"{m['answers_per_s'] if cls == 'hit' else '':>7} "
                  f"{m.get('scaling', '') if cls == 'hit' else '':>6}")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "load.json").write_text(json.dumps(out, indent=1))
    lost = sum(m[c]["errors"] for m in out["modes"].values() for c in ("new_video", "hit"))
    return 1 if lost or failed or "failed" in out.get("decode", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
