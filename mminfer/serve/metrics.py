"""Prometheus metrics, named in vLLM's style with an ``mminfer:`` prefix and, as vLLM's, a
``model_name`` label on every series (one Prometheus can then scrape several servers).

Each app gets its own registry, so several apps in one process (tests) do not collide and
``/metrics`` shows only this service's series. ``stage_seconds`` holds the stages of a request
(upload, queue, the pipeline's); time to first token and the total have their own histograms
and are not stages.

The engine's video cache keeps its own counts (``Pipeline.video_cache.stats()``); they are
read when /metrics is scraped (``CacheCollector``) and exported in vLLM's prefix-cache names:
``mminfer:prefix_cache_queries_total`` and ``mminfer:prefix_cache_hits_total`` (every hit,
either tier; vLLM's pair, so the hit rate is their ratio), ``..._host_hits_total``,
``..._misses_total``, ``mminfer:prefix_cache_evictions_total{tier}`` (gpu: spilled to the
host tier or dropped; host: dropped), ``..._spilled_bytes_total`` and ``..._spill_seconds_total``
(the moves to the host tier: their ratio over a window is the spills' throughput), and gauges
``mminfer:kv_cache_bytes{tier}``, ``mminfer:kv_cache_entries{tier}``,
``mminfer:kv_cache_budget_bytes{tier}``; the video store
(/v1/videos) as ``mminfer:video_store_bytes`` and ``mminfer:video_store_videos``.

Live streams (serve/live.py), read at scrape time as well (``StreamsCollector``; under
--data-parallel the engines' summed): ``mminfer:streams_active``, ``mminfer:streams_full``,
``mminfer:streams_pulling`` (reading a source), ``mminfer:stream_ingest_tokens_per_second``
(over the streams' recent pieces: tokens over their vision and prefill time),
``mminfer:stream_lag_seconds`` (the largest: how far a stream's media trails the wall clock),
``mminfer:stream_kv_bytes{tier}`` and ``mminfer:stream_kv_budget_bytes{tier}`` (gpu: the
model's device; host: the streams' host tier), the counters
``mminfer:stream_pieces_total`` and ``mminfer:stream_ingested_tokens_total``, and the
histogram ``mminfer:stream_piece_seconds`` (one piece's vision and prefill).
"""

from __future__ import annotations

import logging

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from mminfer.engine.timing import PREFILL_STAGES, TOTALS

# Seconds, from a short CPU request to a million-token prefill.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160,
                   320, 640)
# Seconds between answer tokens (vLLM's time_per_output_token buckets, to 10 s).
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                     0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (256, 1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)
# KL(dense || sparse) in nats, from rounding noise to a different answer (the shipped config
# of the embedded model averages 0.022 on held-out videos, BENCHMARKS.md "Quality").
# Seconds of a live stream's piece (vision and prefill): a short CPU piece to a minute of video
PIECE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
KL_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.003, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    def __init__(self, model: str = ""):
        disable_created_metrics()      # *_created series only clutter dashboards (vLLM too)
        self.model = model
        r = self.registry = CollectorRegistry()
        m = ["model_name"]

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, m, registry=r, buckets=buckets).labels(model)

        def gauge(name, doc):
            return Gauge(name, doc, m, registry=r).labels(model)

        self.ttft = hist("mminfer:time_to_first_token_seconds",
                         "Request arrival to first answer token")
        self.e2e = hist("mminfer:e2e_request_latency_seconds", "Request arrival to answer")
        self.prefill = hist("mminfer:request_prefill_time_seconds",
                            "LLM prefill (index estimation + attention + the rest)")
        # vLLM's name for the generation stage (the decode phase): the tokens after the first
        self.generate = hist("mminfer:request_decode_time_seconds",
                             "Answer tokens after the first (the decode steps)")
        self.token_gap = hist("mminfer:time_per_output_token_seconds",
                              "Mean time between answer tokens of a request (one observation "
                              "per request with two tokens or more)", TOKEN_GAP_BUCKETS)
        self.queue = hist("mminfer:request_queue_time_seconds",
                          "Time waiting for the model worker")
        self.stop_latency = hist(
            "mminfer:request_stop_seconds",
            "From asking a running request to stop (client gone, deadline, shutdown) to the "
            "worker being free")
        self.stage = Histogram("mminfer:stage_seconds", "Time per request stage (upload, queue, "
                               "the pipeline's stages)", m + ["stage"], registry=r,
                               buckets=LATENCY_BUCKETS)
        self.prompt_tokens = hist("mminfer:request_prompt_tokens",
                                  "Prompt tokens (text + visual) per request", TOKEN_BUCKETS)
        self.density = hist("mminfer:attention_density",
                            "Mean prefill attention density per request (1 = dense)",
                            (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0))
        self.requests = Counter("mminfer:requests", "Requests answered, by HTTP status",
                                m + ["status"], registry=r)
        self.errors = Counter("mminfer:errors", "Errors, by error code", m + ["code"],
                              registry=r)
        self.refused = Counter(
            "mminfer:refused_connections", "Connections and requests refused before a request "
            "is served (never stored): by reason (unauthorized, header_timeout, bad_http, "
            "connections, connections_per_client)", m + ["reason"], registry=r)
        self.generation_tokens = Counter("mminfer:generation_tokens",
                                         "Answer tokens generated", m, registry=r).labels(model)
        self.waiting = gauge("mminfer:num_requests_waiting", "Requests queued for the worker")
        self.running = gauge("mminfer:num_requests_running",
                             "Requests in progress (computing, paused or generating)")
        self.prefilling = gauge("mminfer:num_requests_prefilling",
                                "Requests building a video's prefix (admitted or waiting to be)")
        self.paused = gauge("mminfer:num_requests_paused",
                            "Long prefills paused at a layer boundary while short work runs")
        self.generating = gauge("mminfer:num_requests_decoding",
                                "Answers generating their tokens (the decode steps)")
        self.turn_switches = gauge("mminfer:scheduler_switches",
                                   "Times the model was handed from one request to another")
        # two running counts, as the switches: their ratio over a window is the mean number
        # of answers a batched decode step carried (the decode batch's size)
        self.decode_batches = gauge("mminfer:decode_batches",
                                    "Batched decode steps run (one pass of the decoder layers "
                                    "over every answer in it)")
        self.decode_batched = gauge("mminfer:decode_batched_steps",
                                    "Answers' decode steps those batches carried")
        self.wait = hist("mminfer:request_wait_time_seconds",
                         "Time a request in progress waited for others' steps before its first "
                         "token (the wait stage)")
        self.worker_up = gauge("mminfer:worker_up", "1 when the model worker is alive and loaded")
        gauge("mminfer:model_info", "The served model").set(1)
        self.cache_answers = Counter(
            "mminfer:request_prefix_cache", "Answered requests by where the video's prefix "
            "came from: miss (prefilled), hit (GPU tier), host (host tier), off (cache off)",
            m + ["cache"], registry=r)
        self._cache = CacheCollector(model)
        r.register(self._cache)
        self._streams = StreamsCollector(model)
        r.register(self._streams)
        self._compiles = CompilesCollector(model)
        r.register(self._compiles)

        # ---- the shadow-dense monitor (serve/shadow.py), per prompt-length bucket
        b = m + ["length_bucket"]
        self.shadow_comparisons = Counter(
            "mminfer:shadow_comparisons", "Sampled sparse requests re-run dense and compared",
            b, registry=r)
        self.shadow_argmax_agreements = Counter(
            "mminfer:shadow_argmax_agreements", "Shadow comparisons whose first answer token "
            "(the last-token argmax) is the same dense and sparse", b, registry=r)
        self.shadow_answer_agreements = Counter(
            "mminfer:shadow_answer_agreements", "Shadow comparisons whose greedy answers agree "
            "(over the compared tokens)", b, registry=r)
        self.shadow_kl = Histogram(
            "mminfer:shadow_kl_divergence", "KL(dense || sparse) of the last-token "
            "distributions, nats", b, registry=r, buckets=KL_BUCKETS)
        self.shadow_rerun = hist("mminfer:shadow_rerun_seconds",
                                 "Wall time of a dense shadow re-run (on an idle worker)")
        self.shadow_skipped = Counter(
            "mminfer:shadow_skipped", "Sampled sparse requests not compared: too_large (inputs "
            "over --shadow-max-mb), busy (a request came first), interrupted (one came during "
            "the re-run), error", m + ["reason"], registry=r)

    def progress(self, state: dict):
        """The scheduler's counts (mminfer.engine.scheduler.Scheduler.state)."""
        self.prefilling.set(state.get("prefilling", 0) + state.get("waiting_admission", 0))
        self.paused.set(state.get("paused", 0))
        self.generating.set(state.get("decoding", 0))
        self.turn_switches.set(state.get("switches", 0))
        self.decode_batches.set(state.get("decode_batches", 0))
        self.decode_batched.set(state.get("decode_batched_steps", 0))

    def observe_success(self, timings_ms: dict, tokens: int, generated: int, density: float):
        s = lambda k: timings_ms.get(k, 0.0) / 1e3     # noqa: E731
        self.ttft.observe(s("ttft"))
        self.e2e.observe(s("total"))
        self.queue.observe(s("queue"))
        self.wait.observe(s("wait"))
        self.prefill.observe(sum(s(k) for k in PREFILL_STAGES))
        self.generate.observe(s("generate"))
        if generated >= 2:
            self.token_gap.observe(s("generate") / (generated - 1))
        for stage, ms in timings_ms.items():
            if stage not in TOTALS:
                self.stage.labels(self.model, stage).observe(ms / 1e3)
        self.prompt_tokens.observe(tokens)
        self.generation_tokens.inc(generated)
        self.density.observe(density)

    def watch_cache(self, stats):
        """``stats()``: the engine's video-cache stats (a dict), or None while there is none."""
        self._cache.cache_stats = stats

    def watch_store(self, stats):
        """``stats()``: the video store's (videos.VideoStore.stats)."""
        self._cache.store_stats = stats

    def watch_streams(self, stats):
        """``stats()``: the live streams' figures (serve/live.py ``stats``), or None."""
        self._streams.stats = stats

    def watch_compiles(self, stats):
        """``stats()``: the engine's Triton compilations (mminfer.kernels.compiles.stats)."""
        self._compiles.stats = stats

    def observe_cache(self, cache: str | None):
        if cache:
            self.cache_answers.labels(self.model, cache).inc()

    def observe_shadow(self, bucket: str, kl: float, argmax_agree: bool, answer_agree: bool,
                       seconds: float):
        # inc(0) too: an agreement series exists (at 0) wherever comparisons do, so
        # agreements / comparisons is defined from the first comparison
        self.shadow_comparisons.labels(self.model, bucket).inc()
        self.shadow_argmax_agreements.labels(self.model, bucket).inc(int(bool(argmax_agree)))
        self.shadow_answer_agreements.labels(self.model, bucket).inc(int(bool(answer_agree)))
        self.shadow_kl.labels(self.model, bucket).observe(kl)
        self.shadow_rerun.observe(seconds)

    def shadow_skip(self, reason: str):
        self.shadow_skipped.labels(self.model, reason).inc()

    def refuse(self, reason: str):
        self.refused.labels(self.model, reason).inc()

    def count(self, status: int, code: str | None = None):
        self.requests.labels(self.model, str(status)).inc()
        if code:
            self.errors.labels(self.model, code).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _scraped(stats, what: str):
    """``stats()`` read at scrape time, None (and the error logged) if it raises: a scrape
    must not fail on a figure."""
    try:
        return stats()
    except Exception:                  # noqa: BLE001
        logging.getLogger("mminfer.serve").exception("reading %s", what)
        return None


class CacheCollector:
    """The video cache's and the video store's figures, read at scrape time."""

    def __init__(self, model: str):
        self.model = model
        self.cache_stats = lambda: None
        self.store_stats = lambda: None

    def describe(self):
        return []                       # no fixed set: collect() names what it has

    def collect(self):
        m, lab = [self.model], ["model_name"]
        c = _scraped(self.cache_stats, "the video cache's stats")
        if c:
            for name, key, doc in (
                    ("queries", "queries", "Requests that looked their video's prefix up"),
                    ("hits", "hits", "Lookups that found the prefix cached (either tier)"),
                    ("host_hits", "host_hits", "Hits served from the host tier"),
                    ("misses", "misses", "Lookups that prefilled the prefix"),
                    ("tail_reads", "tail_reads", "Questions that decoded in their cached "
                     "prefix's tail (alone on it: a cache in one piece)"),
                    ("room_waits", "room_waits", "Times a new prefill waited for other "
                     "requests to give back the device memory it needs"),
                    ("idle_spills", "idle_spills", "Times every idle cached prefix left the "
                     "device at once (a request that ran out of memory runs again after it)"),
                    ("spilled_bytes", "spilled_bytes", "Bytes of cached prefixes moved to "
                     "the host tier"),
                    ("spill_seconds", "spill_seconds", "Seconds spent moving cached prefixes "
                     "to the host tier (allocating pinned memory and copying)")):
                f = CounterMetricFamily(f"mminfer:prefix_cache_{name}", doc, labels=lab)
                f.add_metric(m, c.get(key, 0))
                yield f
            f = CounterMetricFamily("mminfer:prefix_cache_evictions", "Cached prefixes "
                                    "evicted from a tier (gpu: moved to the host tier or "
                                    "dropped; host: dropped)", labels=lab + ["tier"])
            for tier in ("gpu", "host"):
                f.add_metric(m + [tier], c.get(f"evictions_{tier}", 0))
            yield f
            for name, key, doc in (("bytes", "{}_bytes", "Bytes of cached prefixes per tier"),
                                   ("entries", "{}_entries", "Cached prefixes per tier"),
                                   ("budget_bytes", "{}_budget_bytes",
                                    "Byte budget of each tier")):
                f = GaugeMetricFamily(f"mminfer:kv_cache_{name}", doc, labels=lab + ["tier"])
                for tier in ("gpu", "host"):
                    f.add_metric(m + [tier], c.get(key.format(tier), 0) or 0)
                yield f
        st = _scraped(self.store_stats, "the video store's stats")
        if st:
            for name, key, doc in (("bytes", "bytes", "Bytes of stored videos (/v1/videos)"),
                                   ("videos", "videos", "Stored videos (/v1/videos)")):
                f = GaugeMetricFamily(f"mminfer:video_store_{name}", doc, labels=lab)
                f.add_metric(m, st[key])
                yield f


class CompilesCollector:
    """Triton's compilations in the engine, read at scrape time: a kernel compiles on the
    first launch of each specialisation, a second or so inside one request's time."""

    def __init__(self, model: str):
        self.model = model
        self.stats = lambda: None

    def describe(self):
        return []

    def collect(self):
        st = _scraped(self.stats, "the compilations' stats")
        if not st:
            return
        lab = ["model_name", "kernel"]
        n = CounterMetricFamily("mminfer:triton_compiles", "Triton kernel compilations (one "
                                "per new specialisation of a kernel's arguments)", labels=lab)
        t = CounterMetricFamily("mminfer:triton_compile_seconds", "Seconds spent compiling "
                                "Triton kernels", labels=lab)
        for kernel, k in st.get("kernels", {}).items():
            n.add_metric([self.model, kernel], k["compiles"])
            t.add_metric([self.model, kernel], k["seconds"])
        yield n
        yield t


class StreamsCollector:
    """The live streams' figures, read at scrape time (nothing while there are none yet)."""

    def __init__(self, model: str):
        self.model = model
        self.stats = lambda: None

    def describe(self):
        return []

    def collect(self):
        m, lab = [self.model], ["model_name"]
        st = _scraped(self.stats, "the streams' stats")
        if not st:
            return
        for name, key, doc in (
                ("streams_active", "active", "Live streams held (open or full)"),
                ("streams_full", "full", "Live streams past their budget or the context: "
                                         "answerable, taking no more video"),
                ("streams_pulling", "pulling", "Live streams reading their source"),
                ("stream_ingest_tokens_per_second", "ingest_tokens_per_s",
                 "Tokens per second of the streams' recent pieces (vision and prefill time)"),
                ("stream_lag_seconds", "max_lag_seconds",
                 "The largest lag of a stream's media behind the wall clock")):
            f = GaugeMetricFamily(f"mminfer:{name}", doc, labels=lab)
            f.add_metric(m, st.get(key) or 0)
            yield f
        for name, keys, doc in (
                ("stream_kv_bytes", ("gpu_bytes", "host_bytes"),
                 "Bytes the streams' KV caches hold per tier (gpu: the model's device)"),
                ("stream_kv_budget_bytes", ("budget_bytes", "host_budget_bytes"),
                 "The streams' byte budget per tier")):
            f = GaugeMetricFamily(f"mminfer:{name}", doc, labels=lab + ["tier"])
            for tier, key in zip(("gpu", "host"), keys):
                f.add_metric(m + [tier], st.get(key) or 0)
            yield f
        for name, key, doc in (("stream_pieces", "pieces", "Pieces appended to live streams"),
                               ("stream_ingested_tokens", "tokens_ingested",
                                "Tokens the live streams' pieces prefilled")):
            f = CounterMetricFamily(f"mminfer:{name}", doc, labels=lab)
            f.add_metric(m, st.get(key) or 0)
            yield f
        counts = st.get("piece_buckets")
        if counts:
            f = HistogramMetricFamily("mminfer:stream_piece_seconds", "One live-stream "
                                      "piece's vision and prefill", labels=lab)
            acc, buckets = 0, []
            for bound, n in zip([*map(str, PIECE_BUCKETS), "+Inf"], counts):
                acc += n
                buckets.append((bound, acc))
            f.add_metric(m, buckets, st.get("piece_sum_s") or 0.0)
            yield f
