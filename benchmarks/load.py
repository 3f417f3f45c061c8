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

Per mode, ``spills``: the GiB of cached videos the server moved to its host tier meanwhile to
make room for the new ones, and the seconds that took; ``compiles``: the Triton kernels it
compiled meanwhile and their seconds (its /metrics counters).

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

``--selfcal-video V`` runs a self-calibration phase: a server with no measured config for
the checkpoint (its calibration folder a new temporary one), from its start, under a steady
stream of requests for V (one every 1/``--selfcal-rate`` s, each under its own cache key,
``max_frames`` = ``--max-frames`` + i: a full prefill each; ``attention=auto``), for up to
``--selfcal-s`` s or until ``--selfcal-sparse`` answers came sparse. Before it, in the same
run, the dense baseline: the same stream (``--selfcal-baseline`` requests) on a server that
does not calibrate (``--no-self-calibrate``: attention auto on an uncalibrated config, dense),
so "dense's TTFT" is measured on the same machine, by the same path, without calibration's
idle-time work. Reported under ``selfcal``: per request its send time and answer time since
the server started, its TTFT (the server's, arrival to first token), dense or sparse, and its
TTFT over the baseline's (a cold first request against the baseline's first, the others
against the median of the baseline's others); the time to the first sparse answer (or that
none came within ``--selfcal-s``), the ratios' max and p99 and how many exceed 1.05; the
calibration state over time (``/v1/models``' ``self_calibration``, polled, each change kept)
and at the end, and whether the config was stored. ``--selfcal-baseline-file F`` keeps the
baseline in F and reuses it for the same stream (a later run on the same machine). The
calibrating server runs with ``--calibration-max-density 1``: random weights hold only
near-dense, where the default would stay dense (no faster), and the phase measures the way
to a sparse answer. The load
modes' and the decode phase's servers do not calibrate (``--no-self-calibrate``).

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
import atexit
import collections
import json
import os
import signal
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


# the servers started and not yet closed: stopped when load.py is (a device script's
# `timeout` sends SIGTERM; a server left running would hold the GPU for the next command)
LIVE: set = set()


def stop_live(grace_s: float = 3.0) -> None:
    """Terminate every server still running, kill those not gone within ``grace_s``."""
    procs = [srv.proc for srv in list(LIVE)]
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def on_sigterm(signum, frame):
    for srv in list(LIVE):     # where each server was when the call's time ran out
        srv.dump_threads()
    stop_live()
    raise SystemExit(128 + signum)


class Server:
    """``mminfer serve`` in a subprocess on a free loopback port."""

    def __init__(self, args: list[str], env: dict, log: Path | None = None,
                 log_level: str = "warning"):
        self.data = tempfile.TemporaryDirectory(prefix="mminfer-load-")
        self.started = time.monotonic()          # the clock of "time since the start"
        # every line the server prints, as it prints it (a call stopped mid-mode keeps them)
        self.log = open(log, "a", buffering=1) if log is not None else None
        cmd = [sys.executable, "-m", "mminfer.cli", "serve", "--port", "0", "--data-dir",
               self.data.name, "--log-level", log_level, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        LIVE.add(self)
        self.url = None
        self.tail = collections.deque(maxlen=200)   # the server's last lines, for a failure
        deadline = time.monotonic() + 600
        lines = []
        while self.url is None and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("the server did not start:\n" + "".join(lines[-30:]))
            lines.append(line)
            if self.log is not None:
                self.log.write(line)
            if " at http://" in line:
                self.url = line.split(" at ", 1)[1].split()[0]
                self.ready_s = time.monotonic() - self.started
        if self.url is None:
            self.close()
            raise RuntimeError("the server did not start in time")
        print(f"server pid {self.proc.pid} at {self.url}", flush=True)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.tail.append(line)
            if self.log is not None:
                self.log.write(line)

    def dump_threads(self, wait_s: float = 2.0) -> None:
        """Have the server print every thread's stack (``mminfer serve`` registers SIGUSR1
        with faulthandler) into its output: where a request that never came back is."""
        if self.proc.poll() is None and hasattr(signal, "SIGUSR1"):
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(wait_s)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        LIVE.discard(self)
        self.data.cleanup()
        if self.log is not None:
            self.log.close()


def start_server(a, tag: str, args: list[str], env: dict) -> Server:
    """A server for one phase; its output goes to ``--out``/server-``tag``.log as it comes."""
    log = a.out / f"server-{tag}.log" if a.out is not None else None
    if log is not None:
        a.out.mkdir(parents=True, exist_ok=True)
    return Server(args, env, log=log, log_level=a.server_log_level)


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
            "attention": body.get("attention"),
            "density": (body.get("sparsity") or {}).get("mean_density"),
            "error": None if r.status_code == 200 else body.get("error")}


def run_mode(name, serve_args, a, env, scale: int = 1) -> dict:
    """One server mode under the mixed workload, ``scale`` times over (``scale`` new-video
    clients, ``scale`` x the hit rate: one engine's load per engine)."""
    srv = start_server(a, name, serve_args, env)
    t0 = time.monotonic()

    def say(what):          # the phase's progress, as it goes (a stopped call shows where)
        print(f"{name} +{time.monotonic() - t0:.1f}s: {what}", flush=True)

    try:
        q = a.question
        base = dict(max_new_tokens=a.max_new_tokens, attention=a.attention)
        for v in a.cached_video:                     # their prefixes are cached now
            r = ask(srv.url, Path(v), q, base, a.timeout_s)
            if r["status"] != 200:
                raise RuntimeError(f"{name}: caching {v} failed: {r}")
            say(f"cached {Path(v).name} (ttft {r['ttft_ms']} ms)")
        alone = None
        if a.alone:
            alone = ask(srv.url, Path(a.new_video), q,
                        {**base, "max_frames": a.max_frames + a.key_span}, a.timeout_s)
            say(f"alone: {alone['status']} ttft {alone.get('ttft_ms')} ms "
                f"{alone.get('error') or ''}")
        new_rows, hit_rows = [], []
        lock = threading.Lock()
        spills_before = server_counts(srv.url, *SPILLS)
        compiles_before = server_counts(srv.url, *COMPILES)
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
                say(f"new video: {r['status']} ttft {r.get('ttft_ms')} ms "
                    f"{r.get('error') or ''}")

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
        say(f"{len(hits)} hits sent; waiting for the last answers")
        for t in new_threads:
            t.join()
        for th in hits:
            th.join()
        if any(r["status"] == 0 for r in new_rows + hit_rows):     # a request never came back
            srv.dump_threads()
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
        spilled, spill_s = (x - y for x, y in zip(server_counts(srv.url, *SPILLS),
                                                  spills_before))
        compiled, compile_s = (x - y for x, y in zip(server_counts(srv.url, *COMPILES),
                                                     compiles_before))
        hit = summary(hit_rows)
        hit_ok = [r for r in hit_rows if r["status"] == 200]
        hit["hit_rate"] = round(sum(r["cache"] in ("hit", "host") for r in hit_ok)
                                / len(hit_ok), 4) if hit_ok else None
        answered = sum(1 for r in new_rows + hit_rows if r["status"] == 200)
        out = {"mode": name, "serve_args": serve_args, "engines": scale,
               "elapsed_s": round(elapsed, 3), "answers_per_s": round(answered / elapsed, 3),
               "new_video": new, "hit": hit, "health_after": health,
               # cached videos moved to the host tier to make room for new ones
               "spills": {"gib": round(spilled / 2**30, 3), "seconds": round(spill_s, 3)},
               # Triton kernels compiled while the workload ran (a new specialisation's
               # second inside some request's time)
               "compiles": {"count": int(compiled), "seconds": round(compile_s, 3)}}
        if new["errors"] or hit["errors"]:         # the server's side of a lost request
            out["server_log"] = "".join(srv.tail)[-8000:]
        return out
    except Exception as e:  # noqa: BLE001 - one mode's failure is reported, the next one runs
        srv.dump_threads()
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
    srv = start_server(a, "decode", serve_args, env)
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


def server_counts(url, *names) -> list[float]:
    """The server's series ``names`` on ``/metrics``, each summed over its labels."""
    got = dict.fromkeys(names, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]      # labelled by model: summed
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    return [got[n] for n in names]


def decode_batches(url) -> tuple[float, float]:
    """The server's running counts of batched decode steps and of the answers' steps they
    carried (``/metrics``: mminfer:decode_batches, mminfer:decode_batched_steps)."""
    return tuple(server_counts(url, "mminfer:decode_batches", "mminfer:decode_batched_steps"))


SPILLS = ("mminfer:prefix_cache_spilled_bytes_total", "mminfer:prefix_cache_spill_seconds_total")
COMPILES = ("mminfer:triton_compiles_total", "mminfer:triton_compile_seconds_total")


def _decode_at_once(srv, video, asks, a) -> dict:
    """``asks`` ((question, form data) each, every prefix cached) sent at once, against the
    first asked alone (twice: the second is the one timed). ``mean_batch``: the answers a
    batched step carried meanwhile, on average (the server's counts)."""
    n = len(asks)
    alone = [ask(srv.url, video, *asks[0], a.timeout_s) for _ in range(2)][-1]
    before = decode_batches(srv.url)
    rows = [None] * n

    def one(i):
        rows[i] = ask(srv.url, video, *asks[i], a.timeout_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in rows if r["status"] == 200]
    after = decode_batches(srv.url)
    batches = after[0] - before[0]

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
           "alone_tokens_per_s": round(one_rate, 2) if one_rate else None,
           "batches": batches,
           "mean_batch": round((after[1] - before[1]) / batches, 2) if batches else None}
    if agg and one_rate:
        out["aggregate_vs_alone"] = round(agg / one_rate, 3)
        out["worst_per_token_vs_alone"] = round(
            max(out["ms_per_token"]) / out["alone_ms_per_token"], 3)
    return out


SELFCAL_MARGIN = 1.05     # the target: no request's TTFT more than 5 % above dense's


def selfcal_status(url) -> dict | None:
    """The server's self-calibration status (``/v1/models``, the served model's
    ``mminfer.self_calibration``), or None where it says none."""
    for d in httpx.get(f"{url}/v1/models", timeout=30).json().get("data", []):
        sc = (d.get("mminfer") or {}).get("self_calibration")
        if sc is not None:
            return sc
    return None


def _stream(srv, a, n_max: int, until_s: float, stop_after_sparse: int | None,
            on_row=None) -> list:
    """Requests for ``--selfcal-video`` at ``--selfcal-rate`` (open loop: each in its own
    connection, sent on time whatever the earlier ones are doing), request i under cache key
    ``max_frames`` = ``--max-frames`` + i, at most ``n_max`` of them, none sent after
    ``until_s`` s since the server started, none after ``stop_after_sparse`` sparse answers;
    then the ones in flight are awaited. Rows in send order, times since the server start."""
    video, rows, lock = Path(a.selfcal_video), [], threading.Lock()
    base = dict(max_new_tokens=a.max_new_tokens, attention="auto")
    sparse = threading.Event()
    n_sparse = [0]

    def one(i):
        r = ask(srv.url, video, a.question, {**base, "max_frames": a.max_frames + i},
                a.timeout_s)
        r["i"] = i
        r["sent_s"] = round(r["start"] - srv.started, 3)
        if "end" in r:
            r["answered_s"] = round(r["end"] - srv.started, 3)
        with lock:
            rows.append(r)
            if r["status"] == 200 and r["attention"] == "sparse":
                n_sparse[0] += 1
                if stop_after_sparse and n_sparse[0] >= stop_after_sparse:
                    sparse.set()
            if on_row is not None:
                on_row(sorted(rows, key=lambda x: x["i"]))

    threads = []
    next_at = time.monotonic()
    for i in range(n_max):
        if next_at - srv.started > until_s or sparse.is_set():
            break
        sparse.wait(max(0.0, next_at - time.monotonic()))
        if sparse.is_set():
            break
        th = threading.Thread(target=one, args=(i,))
        th.start()
        threads.append(th)
        next_at += 1.0 / a.selfcal_rate
    for th in threads:
        th.join()
    return sorted(rows, key=lambda x: x["i"])


def _row(r, ref_cold, ref_warm) -> dict:
    out = {k: r.get(k) for k in ("i", "status", "sent_s", "answered_s", "ttft_ms", "attention",
                                 "density", "cache", "latency_ms")}
    out["stages_ms"] = r.get("stages")     # where its time went (queue, vision, prefill...)
    if r["status"] != 200:
        out["error"] = str(r.get("error"))[:300]
    ref = ref_cold if r["i"] == 0 else ref_warm
    if r["status"] == 200 and r.get("ttft_ms") and ref:
        out["ttft_vs_dense"] = round(r["ttft_ms"] / ref, 4)
    return out


def _busy(rows) -> int:
    """Requests sent while an earlier one was still unanswered (the stream was faster than
    the server: their TTFT counts a wait for the other's work)."""
    n, until = 0, float("-inf")
    for r in rows:
        n += r["sent_s"] < until
        until = max(until, r.get("answered_s") or float("inf"))
    return n


def selfcal_summary(rows: list, limit_s: float) -> dict:
    """The phase's figures from its rows (:func:`_row`, send order): answers dense and
    sparse, the first sparse answer (by its arrival) or that none came within ``limit_s``,
    the TTFT ratios against dense's (max, p99, p50, how many over ``SELFCAL_MARGIN``), and a
    one-line verdict."""
    ok = [r for r in rows if r["status"] == 200]
    sparse = sorted((r for r in ok if r["attention"] == "sparse"),
                    key=lambda r: r["answered_s"])
    ratios = [r["ttft_vs_dense"] for r in ok if "ttft_vs_dense" in r]
    over = [r["i"] for r in ok if r.get("ttft_vs_dense", 0) > SELFCAL_MARGIN]
    first = sparse[0] if sparse else None
    verdict = (f"first sparse answer {first['answered_s']:.1f} s after the server started "
               f"(request {first['i']})" if first else
               f"no sparse answer within {limit_s:g} s ({len(ok)} answered, all dense)")
    dense_max = max((r["ttft_vs_dense"] for r in ok
                     if r["attention"] == "dense" and "ttft_vs_dense" in r), default=None)
    verdict += (f"; TTFT at most {max(ratios):.3f}x dense's ("
                + (f"{dense_max:.3f}x" if dense_max is not None else "none") +
                f" over the answers still dense), {len(over)} of {len(ratios)} requests over "
                f"{SELFCAL_MARGIN:g}x" if ratios else "; no TTFT to compare")
    return {
        "requests": rows, "errors": len(rows) - len(ok), "sent_while_busy": _busy(rows),
        "answers": {"dense": sum(r["attention"] == "dense" for r in ok),
                    "sparse": len(sparse)},
        "first_sparse_s": first["answered_s"] if first else None,
        "first_sparse": first and {
            "answered_s": first["answered_s"], "request": first["i"],
            "sent_s": first["sent_s"], "ttft_ms": first["ttft_ms"],
            "within_limit": first["answered_s"] <= limit_s},
        "ttft_vs_dense": {
            "n": len(ratios), "max": max(ratios) if ratios else None,
            "p99": pct(ratios, 0.99), "p50": pct(ratios, 0.5), "over_margin": len(over),
            "over_margin_requests": over,
            "dense_answers_max": dense_max},
        "verdict": verdict}


def _baseline(common, a, env) -> dict:
    """The dense baseline: ``--selfcal-baseline`` requests of the phase's stream on a server
    that does not calibrate. Its TTFT references: the first (cold) request's, and the median
    of the others' (with one request, its own)."""
    try:
        srv = start_server(a, "selfcal-baseline", common + ["--no-self-calibrate"], env)
    except Exception as e:  # noqa: BLE001 - reported; no baseline, no phase
        return {"failed": f"baseline: {type(e).__name__}: {e}"}
    try:
        base = _stream(srv, a, a.selfcal_baseline, float("inf"), None)
        st = selfcal_status(srv.url)
    except Exception as e:  # noqa: BLE001 - reported; no baseline, no phase
        return {"failed": f"baseline: {type(e).__name__}: {e}",
                "server_log": "".join(srv.tail)[-8000:]}
    finally:
        srv.close()
    rows = [_row(r, None, None) for r in base]
    ok = [r for r in base if r["status"] == 200]
    bad = [r["attention"] for r in ok if r["attention"] != "dense"]
    if len(ok) < len(base) or bad or not ok:
        return {"failed": f"baseline: {len(base) - len(ok)} of {len(base)} lost, {len(bad)} "
                f"not dense ({st and st.get('summary')})", "baseline": {"requests": rows}}
    warm = [r["ttft_ms"] for r in ok if r["i"] > 0] or [r["ttft_ms"] for r in ok]
    return {"requests": rows, "sent_while_busy": _busy(rows),
            "ttft_ms_first": ok[0]["ttft_ms"] if ok[0]["i"] == 0 else None,
            "ttft_ms_median": pct(warm, 0.5), "ready_s": round(srv.ready_s, 3)}


def run_selfcal(common, a, env, save=None) -> dict:
    """The self-calibration phase (the module doc): the dense baseline's stream on a server
    that does not calibrate, then a new server with an empty calibration folder under the
    stream until its answers come sparse or ``--selfcal-s`` runs out. ``save(result)`` is
    called as answers come (a run stopped later keeps what it had)."""
    save = save or (lambda _r: None)
    out: dict = {"video": a.selfcal_video, "rate_per_s": a.selfcal_rate,
                 "limit_s": a.selfcal_s, "margin": SELFCAL_MARGIN}
    # the baseline: the same stream, no calibration (auto on the uncalibrated config: dense);
    # one measured earlier on this machine for the same stream is reused (--selfcal-baseline-file)
    same = {"model": a.model, "video": a.selfcal_video, "rate_per_s": a.selfcal_rate,
            "max_frames": a.max_frames, "max_new_tokens": a.max_new_tokens,
            "question": a.question, "requests": a.selfcal_baseline, "serve_arg": a.serve_arg}
    kept = Path(a.selfcal_baseline_file) if a.selfcal_baseline_file else None
    b = json.loads(kept.read_text()) if kept is not None and kept.is_file() else None
    if b is not None and b.get("stream") == same:
        b["reused_from"] = str(kept)
    else:
        b = _baseline(common, a, env)
        if "failed" in b:
            return {**out, "failed": b.pop("failed"), **b}
        b["stream"] = same
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(json.dumps(b, indent=1))
    out["baseline"] = b
    ref_cold, ref_warm = b["ttft_ms_first"] or b["ttft_ms_median"], b["ttft_ms_median"]
    save(out)

    caldir = tempfile.TemporaryDirectory(prefix="mminfer-selfcal-")
    assert not any(Path(caldir.name).iterdir())   # no config measured for any weights
    try:
        # random weights hold the thresholds only near-dense (0.999 on an H100), which the
        # server's default --calibration-max-density rightly refuses: the phase measures the
        # way to a sparse answer, so it lets any density serve
        srv = start_server(a, "selfcal", common + ["--calibration-dir", caldir.name,
                                                   "--calibration-max-density", "1"], env)
    except Exception as e:  # noqa: BLE001 - reported with the baseline
        caldir.cleanup()
        return {**out, "failed": f"{type(e).__name__}: {e}"}
    timeline, done = [], threading.Event()
    out["ready_s"] = round(srv.ready_s, 3)
    try:            # what it says before any request: calibrating, or why not
        st = selfcal_status(srv.url) or {}
    except Exception as e:  # noqa: BLE001 - the poll below reports the same
        st = {"state": f"unreadable: {type(e).__name__}: {e}"}
    out["at_start"] = {k: st.get(k) for k in ("state", "serving", "config", "why", "summary")}

    def poll():
        last = None
        while not done.is_set():
            try:
                st = selfcal_status(srv.url)
            except Exception as e:  # noqa: BLE001 - a poll that failed is a data point
                st = {"state": f"unreadable: {type(e).__name__}"}
            st = st or {"state": "none"}
            prog = st.get("progress") or {}
            key = (st.get("state"), st.get("serving"), json.dumps(prog.get("inputs")),
                   prog.get("gate"), prog.get("round"))
            if key != last:
                c = st.get("counts") or {}
                timeline.append({"t_s": round(time.monotonic() - srv.started, 3),
                                 "state": st.get("state"), "serving": st.get("serving"),
                                 "inputs": prog.get("inputs"), "gate": prog.get("gate"),
                                 "round": prog.get("round"),
                                 "steps_run": c.get("steps_run"),
                                 "steps_stopped": c.get("steps_stopped"),
                                 "steps_paused": c.get("steps_paused"),
                                 "references_from_answers": c.get("references_from_answers")})
                last = key
            done.wait(a.selfcal_poll_s)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()

    def report(rows, final_status=None):
        res = {**out, **selfcal_summary([_row(r, ref_cold, ref_warm) for r in rows],
                                        a.selfcal_s)}
        res["timeline"] = list(timeline)
        if final_status is not None:
            res["status_after"] = final_status
        return res

    try:
        rows = _stream(srv, a, 1 + int(a.selfcal_s * a.selfcal_rate), a.selfcal_s,
                       a.selfcal_sparse, on_row=lambda rows: save(report(rows)))
        done.set()
        poller.join(60)
        final = selfcal_status(srv.url)
        res = report(rows, final)
        res["stored"] = sorted(p.name for p in Path(caldir.name).iterdir())
        if res["errors"]:
            res["server_log"] = "".join(srv.tail)[-8000:]
        return res
    except Exception as e:  # noqa: BLE001 - reported with what came
        done.set()
        return {**out, "failed": f"{type(e).__name__}: {e}", "timeline": timeline,
                "server_log": "".join(srv.tail)[-8000:]}
    finally:
        done.set()
        srv.close()
        caldir.cleanup()


# A mode named with one of these suffixes runs its server with these CUDA allocator settings,
# side by side with the same mode without: -expandable, PyTorch's expandable segments instead
# of fixed ones (the 80 GB H100 load runs lost prefills out of memory with 9-10 GB reserved in
# fragments); -hostalloc, host memory pinned by cudaHostAlloc (PyTorch's default) instead of
# the command's cudaHostRegister (mminfer.cli.PINNED_HOST: the video cache's spills).
ALLOCATORS = {"-expandable": "expandable_segments:True",
              "-hostalloc": "pinned_use_cuda_host_register:False"}


def _allocator(name: str) -> tuple[str, str | None]:
    """(the mode without its allocator suffix, that suffix's settings or None)."""
    for suffix, conf in ALLOCATORS.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), conf
    return name, None


def mode_env(name: str, env: dict) -> dict:
    """The environment of mode ``name``'s server."""
    conf = _allocator(name)[1]
    return {**env, "PYTORCH_CUDA_ALLOC_CONF": conf} if conf else env


def modes_of(a, common: list[str]) -> list[tuple[str, list[str], int]]:
    """(name, `mminfer serve` arguments, engines) of each server mode the flags ask for."""
    named = {"serial": common + ["--max-num-seqs", "1"], "scheduler": common}
    # the scheduler first: where a device call runs out of time, its figures are the ones kept
    chosen = a.modes if a.modes is not None else \
        ("" if a.data_parallel else "scheduler,serial")
    out = []
    for name in (n for n in chosen.split(",") if n):
        base = _allocator(name)[0]               # the allocator: mode_env
        if base.startswith("scheduler@"):       # the scheduler with another --decode-share
            out.append((name, common + ["--decode-share", base.split("@", 1)[1]], 1))
        else:
            out.append((name, named[base], 1))
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
    p.add_argument("--new-video", help="the long video sent back to back (the modes')")
    p.add_argument("--cached-video", action="append", default=[],
                   help="a video cached before the load; questions about it arrive at "
                        "--hit-rate (repeatable; the modes')")
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
                   help="serial (--max-num-seqs 1), scheduler (the default server), "
                        "scheduler@F (with --decode-share F), each with the suffix "
                        "-expandable (PyTorch's expandable CUDA segments) or -hostalloc "
                        "(host memory pinned by cudaHostAlloc), "
                        "comma-separated; "
                        "default: scheduler,serial, or none with --data-parallel")
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
    p.add_argument("--decode-kv-cache-gb", type=float, default=None,
                   help="the decode phase's --kv-cache-gb: room for every decoder's entry at "
                        "once (default: the server's, half the GPU: 6 of 8 115K-token 7B "
                        "entries on an 80 GB card)")
    p.add_argument("--decode-video", default=None,
                   help="the video of the decode phase (default: the first --cached-video)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--selfcal-video", default=None,
                   help="run the self-calibration phase on this video: the dense baseline's "
                        "stream on a server that does not calibrate, then a server with no "
                        "measured config under a steady stream of it, each request its own "
                        "cache key (--max-frames + i), reported as selfcal")
    p.add_argument("--selfcal-rate", type=float, default=1 / 30,
                   help="the self-calibration stream's requests a second (open loop)")
    p.add_argument("--selfcal-s", type=float, default=600.0,
                   help="the stream's length at most, seconds since the server started")
    p.add_argument("--selfcal-sparse", type=int, default=2,
                   help="the stream stops after this many sparse answers (0: runs --selfcal-s)")
    p.add_argument("--selfcal-baseline", type=int, default=4,
                   help="requests of the dense baseline's stream (the first is compared with "
                        "the phase's cold first request, the median of the others with the "
                        "rest)")
    p.add_argument("--selfcal-baseline-file", default=None,
                   help="the dense baseline is kept in this file and, where it holds one of "
                        "the same stream (model, video, rate, frames, tokens, question, serve "
                        "arguments, requests), read from it instead of measured: measure it "
                        "on the same machine, e.g. a device call before")
    p.add_argument("--selfcal-poll-s", type=float, default=2.0,
                   help="how often the calibration state is read from /v1/models")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for `mminfer serve` (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--server-log-level", default="warning",
                   help="each server's --log-level (its output goes to OUT/server-MODE.log)")
    a = p.parse_args(argv)
    if a.modes is None and not a.new_video and not a.data_parallel:
        a.modes = ""                    # no load's videos: the other phases alone
    if modes_of(a, []) and not (a.new_video and a.cached_video):
        p.error("the load modes need --new-video and --cached-video")
    if a.decoders and not (a.decode_video or a.cached_video):
        p.error("--decoders needs --decode-video or a --cached-video")
    if a.selfcal_video and not (a.selfcal_rate > 0 and a.selfcal_s > 0
                                and a.selfcal_baseline >= 1 and a.selfcal_sparse >= 0):
        p.error("--selfcal-rate and --selfcal-s must be positive, --selfcal-baseline >= 1")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    n_selfcal = 2 + int(a.selfcal_s * a.selfcal_rate) + a.selfcal_baseline \
        if a.selfcal_video else 0
    common = (["--model", a.model] if a.model else []) + a.serve_arg + [
        "--queue-size", "256", "--timeout-s", str(a.timeout_s), "--shadow-rate", "0",
        "--max-frames-limit", str(max(a.max_frames + a.key_span + a.decoders + 1,
                                      a.max_frames + n_selfcal, 768))]
    # the modes and the decode phase measure serving, not calibration's idle-time work
    # (a checkpoint without a measured config would calibrate under them): --selfcal-video
    # measures that
    fixed = common + ["--no-self-calibrate"]
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "modes": {}}
    for name, args, scale in modes_of(a, fixed):
        out["modes"][name] = m = run_mode(name, args, a, mode_env(name, env), scale)
        print(f"{name}: " + (f"FAILED {m['failed']}\n{m['server_log'][-3000:]}" if "failed" in m
              else json.dumps({c: m[c] for c in ("new_video", "hit")})), flush=True)
        if a.out is not None:       # each mode as it ends: a run stopped later keeps it
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "load.json").write_text(json.dumps(out, indent=1))
    if a.decoders:
        a.decode_video = a.decode_video or a.cached_video[0]
        room = [] if a.decode_kv_cache_gb is None else ["--kv-cache-gb",
                                                        str(a.decode_kv_cache_gb)]
        out["decode"] = d = run_decoders(fixed + room, a, env)
        print("decode: " + json.dumps({k: v for k, v in d.items()
                                       if k not in ("server_log", "shared")}), flush=True)
        if "shared" in d:
            print("decode (one shared prefix): " + json.dumps(d["shared"]), flush=True)
        if "failed" in d:
            print(d["server_log"][-3000:])
        if a.out is not None:
            (a.out / "load.json").write_text(json.dumps(out, indent=1))
    if a.selfcal_video:
        def save(res):
            out["selfcal"] = res
            if a.out is not None:
                a.out.mkdir(parents=True, exist_ok=True)
                (a.out / "load.json").write_text(json.dumps(out, indent=1))
        res = run_selfcal(common, a, env, save)
        save(res)
        if "failed" in res:
            print(f"selfcal: FAILED {res['failed']}\n{res.get('server_log', '')[-3000:]}")
        else:
            b = res["baseline"]
            print(f"selfcal: dense baseline TTFT first {b['ttft_ms_first']} ms, median of the "
                  f"others {b['ttft_ms_median']} ms ({b['sent_while_busy']} of "
                  f"{len(b['requests'])} sent while one was in flight); at the start: "
                  f"{res['at_start']['summary']}", flush=True)
            print("selfcal: " + res["verdict"], flush=True)
            for r in res["requests"]:
                print(f"  request {r['i']:>3} sent {r['sent_s']:>8.1f} s  ttft "
                      f"{r['ttft_ms'] or 0:>10.1f} ms  {r['attention'] or r['status']!s:<7}"
                      f" x{r.get('ttft_vs_dense', 0):.3f}")
            for t in res["timeline"]:
                print(f"  state at {t['t_s']:>8.1f} s: {t['state']} ({t['serving']}) "
                      f"inputs {t['inputs']} gate {t['gate']}")
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
    sc = out.get("selfcal", {})
    return 1 if lost or failed or "failed" in out.get("decode", {}) or "failed" in sc \
        or sc.get("errors") else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_sigterm)
    atexit.register(stop_live)
    sys.exit(main())
