"""Prometheus metrics, named in vLLM's style with an ``mminfer:`` prefix.

Each app gets its own registry, so several apps in one process (tests) do not collide and
``/metrics`` shows only this service's series.
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

# Seconds, from a short CPU request to a million-token prefill.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160,
                   320, 640)
TOKEN_BUCKETS = (256, 1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)
PREFILL_STAGES = ("index", "attention", "llm_other")


class Metrics:
    def __init__(self, model: str = ""):
        disable_created_metrics()      # *_created series only clutter dashboards (vLLM too)
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("mminfer:time_to_first_token_seconds",
                              "Request arrival to first answer token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("mminfer:e2e_request_latency_seconds",
                             "Request arrival to answer", registry=r, buckets=LATENCY_BUCKETS)
        self.prefill = Histogram("mminfer:request_prefill_time_seconds",
                                 "LLM prefill (index estimation + attention + the rest)",
                                 registry=r, buckets=LATENCY_BUCKETS)
        self.queue = Histogram("mminfer:request_queue_time_seconds",
                               "Time waiting for the model worker", registry=r,
                               buckets=LATENCY_BUCKETS)
        self.stage = Histogram("mminfer:stage_seconds", "Time per pipeline stage",
                               ["stage"], registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Histogram("mminfer:request_prompt_tokens",
                                       "Prompt tokens (text + visual) per request", registry=r,
                                       buckets=TOKEN_BUCKETS)
        self.density = Histogram("mminfer:attention_density",
                                 "Mean prefill attention density per request (1 = dense)",
                                 registry=r, buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0))
        self.requests = Counter("mminfer:requests", "Requests answered, by HTTP status",
                                ["status"], registry=r)
        self.errors = Counter("mminfer:errors", "Errors, by error code", ["code"], registry=r)
        self.generation_tokens = Counter("mminfer:generation_tokens",
                                         "Answer tokens generated", registry=r)
        self.waiting = Gauge("mminfer:num_requests_waiting", "Requests queued for the worker",
                             registry=r)
        self.running = Gauge("mminfer:num_requests_running", "Requests the worker is running",
                             registry=r)
        self.stop_latency = Histogram(
            "mminfer:request_stop_seconds",
            "From asking a running request to stop (client gone, deadline, shutdown) to the "
            "worker being free", registry=r, buckets=LATENCY_BUCKETS)
        self.worker_up = Gauge("mminfer:worker_up", "1 when the model worker is alive and loaded",
                               registry=r)
        info = Gauge("mminfer:model_info", "The served model", ["model_name"], registry=r)
        info.labels(model_name=model).set(1)

    def observe_success(self, timings_ms: dict, tokens: int, generated: int, density: float):
        s = lambda k: timings_ms.get(k, 0.0) / 1e3     # noqa: E731
        self.ttft.observe(s("ttft"))
        self.e2e.observe(s("total"))
        self.queue.observe(s("queue"))
        self.prefill.observe(sum(s(k) for k in PREFILL_STAGES))
        for stage, ms in timings_ms.items():
            self.stage.labels(stage=stage).observe(ms / 1e3)
        self.prompt_tokens.observe(tokens)
        self.generation_tokens.inc(generated)
        self.density.observe(density)

    def count(self, status: int, code: str | None = None):
        self.requests.labels(status=str(status)).inc()
        if code:
            self.errors.labels(code=code).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
