"""The shadow-dense monitor: how far sparse prefill is from dense on this server's own traffic.

On a sample of live requests (``--shadow-rate``), a request whose prefill ran sparse keeps
what a dense re-run needs (mminfer.engine.rerun: the prompt embeddings and positions on the
CPU, at most ``--shadow-max-mb``; the sparse last-token logits and answer tokens). When the
worker is idle afterwards, it re-runs that prefill dense and compares:

* ``kl``: KL(dense || sparse) of the last-token distributions (nats), the sparse error in the
  distribution the first answer token is drawn from;
* ``argmax_agree``: the first answer token is the same;
* ``answer_agree``: the greedy answers agree over the first ``compared_tokens`` tokens (the
  sparse answer's length, at most ``--shadow-max-new-tokens``; the dense re-run generates that
  many tokens on its own cache).

It never delays a user: a re-run starts only when no request is queued, reserved (uploading)
or running; at most one job is pending, and it is dropped when a request arrives before it
starts; a running re-run is stopped when one arrives (the engine's cancel check before every
decoder layer and generated token, and an interrupt for a layer that runs long; on CUDA the host
waits for each layer, so at most one layer's kernels are ahead of the next request's). A job
is not resumed: the next sample gives the next comparison. What it costs: the sampled request
copies its prompt embeddings to the CPU before its prefill (size / PCIe bandwidth of GPU time),
the copy is held until the re-run ends or is dropped, and idle GPU time runs one dense prefill
per comparison.

Figures: Prometheus (``mminfer:shadow_*``, per model and prompt-length bucket), and rows in the
latency store's SQLite file (table ``shadow_comparisons``, the report's retention) that the
latency report (JSON and page) summarises per model and length bucket: agreement rates and KL
quantiles.
"""

from __future__ import annotations

import html
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from mminfer.engine.interrupt import Guard, Interrupted
from mminfer.errors import Cancelled

from .store import BUCKET_LABELS, RetainedTable, bucket_index, sql_quantile, time_window
from .worker import _is_oom, is_fatal

log = logging.getLogger("mminfer.serve")

# Why a sampled sparse request got no comparison (mminfer:shadow_skipped_total's reason).
SKIP_REASONS = ("too_large", "busy", "interrupted", "error")


@dataclass
class ShadowJob:
    kept: object                       # mminfer.engine.rerun.ShadowInputs
    request_id: str | None
    model: str
    stop: threading.Event = field(default_factory=threading.Event)
    guard: Guard = field(default_factory=Guard)


def compare(kept, rerun, max_new_tokens: int) -> dict:
    """The comparison of a sparse run (``kept``) with its dense re-run, which generated the
    first ``max(1, min(max_new_tokens, len(sparse answer)))`` tokens (fewer where it met EOS:
    a dense answer that ends where the sparse one goes on is a different answer)."""
    ld = torch.log_softmax(rerun.logits.double(), -1)
    ls = torch.log_softmax(kept.sparse_logits.double(), -1)
    kl = float((ld.exp() * (ld - ls)).sum())
    steps = max(1, min(int(max_new_tokens), len(kept.sparse_tokens)))
    return {"kl": max(kl, 0.0),       # rounding can make a zero KL a hair negative
            "argmax_agree": int(rerun.logits.argmax()) == int(kept.sparse_logits.argmax()),
            "answer_agree": list(rerun.token_ids) == list(kept.sparse_tokens[:steps]),
            "compared_tokens": steps}


class ShadowMonitor:
    """Sampling, the idle re-run and its figures. The worker calls :meth:`params` before a job,
    :meth:`offer` after it, :meth:`ready` / :meth:`run_pending` while idle and
    :meth:`preempt` when a request arrives; everything else reads."""

    def __init__(self, rate: float, max_bytes: int | None, max_new_tokens: int = 8, *,
                 metrics=None, store=None, seed: int | None = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the shadow rate must be in [0, 1], not {rate}")
        if max_new_tokens < 1:
            raise ValueError("the shadow re-run generates at least the first token")
        self.rate = float(rate)
        self.max_bytes = max_bytes
        self.max_new_tokens = int(max_new_tokens)
        self.metrics = metrics
        self.store = store
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._pending: ShadowJob | None = None
        self._running: ShadowJob | None = None
        self.compared = 0
        self.skipped = {r: 0 for r in SKIP_REASONS}
        self.on_compare = None         # called with each comparison (serve/selfcal.py)

    # ------------------------------------------------------------ the worker's hooks
    def params(self, job, pipeline) -> dict:
        """A job's Pipeline.answer keywords, with keep_for_shadow when this one is sampled
        (``job.shadow_sampled`` says so afterwards)."""
        params = job.params
        sampling = params.get("sampling_params")
        if (self.rate <= 0 or params.get("attention") == "dense"
                or (sampling is not None and not sampling.greedy)   # compared with greedy
                or not hasattr(pipeline, "shadow_dense")
                or getattr(pipeline, "tensor_parallel", 1) > 1   # the re-run is one rank's
                or self._rng.random() >= self.rate):
            return params
        job.shadow_sampled = True
        return {**params, "keep_for_shadow": True, "shadow_max_bytes": self.max_bytes}

    def offer(self, job, result):
        """After a job answered: take what its sparse run kept (the answer keeps no reference)
        as the pending shadow job, replacing any older one."""
        kept, result.shadow = getattr(result, "shadow", None), None
        if kept is None:
            # too large: this request built its prefix sparse and kept nothing. A prefix
            # from the video cache ("hit", "host") was not built here: nothing to compare,
            # and no skip to count
            if job.shadow_sampled and getattr(result, "attention", None) == "sparse" \
                    and getattr(result, "cache", None) not in ("hit", "host"):
                self._skip("too_large")
            return
        with self._lock:
            replaced, self._pending = self._pending, ShadowJob(
                kept, getattr(job, "request_id", None), getattr(result, "model", ""))
        if replaced is not None:
            self._skip("busy")

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def running(self) -> bool:
        return self._running is not None

    def ready(self, busy: bool) -> bool:
        """A job is pending and the worker is idle. When it is busy the job is dropped."""
        with self._lock:
            if self._pending is None:
                return False
            if not busy:
                return True
            self._pending = None
        self._skip("busy")
        return False

    def preempt(self):
        """A request arrived: drop the pending job, stop the running one."""
        with self._lock:
            dropped, self._pending = self._pending, None
            running = self._running
        if dropped is not None:
            self._skip("busy")
        if running is not None:
            running.stop.set()
            running.guard.interrupt()

    def run_pending(self, pipeline):
        """Run the pending job (on the worker thread, which owns the model) and record it.
        Raises only what the worker must die of."""
        with self._lock:
            job, self._pending = self._pending, None
            self._running = job
        if job is None:
            return
        try:
            try:
                rerun = job.guard.run(pipeline.shadow_dense, job.kept,
                                      max_new_tokens=self.max_new_tokens,
                                      cancel=job.stop.is_set)
            except Interrupted:
                job.guard.disarm()
                raise Cancelled("the shadow re-run was interrupted") from None
        except Cancelled:
            self._skip("interrupted")
            return
        except BaseException as e:     # noqa: BLE001
            if is_fatal(e) and not _is_oom(e):
                raise
            if _is_oom(e):
                _empty_cache()
            log.warning("shadow re-run of request %s failed: %s", job.request_id, e)
            self._skip("error")
            return
        finally:
            with self._lock:
                self._running = None
        self.record(job, compare(job.kept, rerun, self.max_new_tokens), rerun.seconds)

    # ------------------------------------------------------------ figures
    def record(self, job: ShadowJob, c: dict, seconds: float):
        self.compared += 1
        kept = job.kept
        if self.on_compare is not None:
            self.on_compare(c)
        bucket = BUCKET_LABELS[bucket_index(kept.tokens)]
        if self.metrics is not None:
            self.metrics.observe_shadow(bucket, c["kl"], c["argmax_agree"], c["answer_agree"],
                                        seconds)
        if self.store is not None:
            try:
                self.store.add(request_id=job.request_id, model=job.model, tokens=kept.tokens,
                               density=kept.density, rerun_ms=seconds * 1e3, **c)
            except Exception:          # noqa: BLE001 - a full disk must not stop the worker
                log.exception("could not record a shadow comparison")

    def _skip(self, reason: str):
        with self._lock:        # the worker thread and the event loop (preempt) both count
            self.skipped[reason] += 1
        if self.metrics is not None:
            self.metrics.shadow_skip(reason)

    def settings(self) -> dict:
        return {"rate": self.rate, "max_new_tokens": self.max_new_tokens,
                "max_mb": None if self.max_bytes is None else round(self.max_bytes / 2**20, 3)}


def _empty_cache():
    try:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:                  # noqa: BLE001 - best effort
        pass


# ---------------------------------------------------------------------- the store
SCHEMA = """
CREATE TABLE IF NOT EXISTS shadow_comparisons (
    ts REAL NOT NULL,              -- unix seconds, when the comparison was made
    request_id TEXT,               -- the sampled request
    model TEXT,
    tokens INTEGER NOT NULL,       -- prompt tokens
    b INTEGER NOT NULL,            -- length bucket (index into store.BUCKET_LABELS)
    density REAL,                  -- the sparse prefill's mean density
    kl REAL NOT NULL,              -- KL(dense || sparse) of the last-token distributions
    argmax_agree INTEGER NOT NULL, -- 1: the same first answer token
    answer_agree INTEGER NOT NULL, -- 1: the same greedy tokens over compared_tokens
    compared_tokens INTEGER NOT NULL,
    rerun_ms REAL                  -- the dense re-run's wall time
);
CREATE INDEX IF NOT EXISTS shadow_ts ON shadow_comparisons (ts);
CREATE INDEX IF NOT EXISTS shadow_order ON shadow_comparisons (model, b, kl);
"""
KL_QUANTILES = (("kl_p50", 0.50), ("kl_p95", 0.95), ("kl_p99", 0.99))


class ShadowStore(RetainedTable):
    """The comparisons, in their own table of the latency store's SQLite file (its own
    connection; WAL lets both write), pruned with the same retention as the requests."""

    TABLE = "shadow_comparisons"
    PRUNE_EVERY = 100

    def _create(self):
        self._db.executescript(SCHEMA)

    def add(self, *, request_id, model, tokens: int, density, kl: float, argmax_agree: bool,
            answer_agree: bool, compared_tokens: int, rerun_ms: float | None = None,
            ts: float | None = None):
        row = (time.time() if ts is None else ts, request_id, model, int(tokens),
               bucket_index(int(tokens)), density, float(kl), int(bool(argmax_agree)),
               int(bool(answer_agree)), int(compared_tokens), rerun_ms)
        self._write(lambda db: db.execute("INSERT INTO shadow_comparisons VALUES "
                                          "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row))

    def report(self, since: float | None = None, until: float | None = None) -> dict:
        """Per model and length bucket: count, agreement rates, KL mean / quantiles / max."""
        window, args = time_window(since, until)
        with self._lock:
            groups = self._db.execute(
                "SELECT model, b, COUNT(*), AVG(argmax_agree), AVG(answer_agree), AVG(kl), "
                "MAX(kl), AVG(density), AVG(rerun_ms) FROM shadow_comparisons WHERE 1=1" +
                window + " GROUP BY model, b ORDER BY model, b", args).fetchall()
            picks = {}
            for model, b, n, *_ in groups:        # each quantile: one seek in (model, b, kl)
                for name, q in KL_QUANTILES:
                    picks[(model, b, name)] = sql_quantile(
                        self._db, "SELECT kl FROM shadow_comparisons WHERE model IS ? AND b = ?"
                        + window + " ORDER BY kl", [model, b, *args], n, q)
        rows = []
        for model, b, n, arg, ans, mean, top, density, rerun in groups:
            row = {"model": model, "bucket": BUCKET_LABELS[b], "count": n,
                   "argmax_agreement": round(arg, 6), "answer_agreement": round(ans, 6),
                   "kl_mean": _r(mean)}
            for name, q in KL_QUANTILES:
                row[name] = _r(picks[(model, b, name)])
            row.update(kl_max=_r(top), mean_density=None if density is None else round(density, 6),
                       mean_rerun_ms=None if rerun is None else round(rerun, 3))
            rows.append(row)
        return {"comparisons": sum(r["count"] for r in rows), "rows": rows}


def _r(x: float) -> float:
    return float(f"{x:.6g}")       # KL spans 1e-12 to 10: significant digits, not decimals


# ---------------------------------------------------------------------- the report page
def html_section(rep: dict | None) -> str:
    """The report page's section: one row per model and length bucket, the numbers also as
    ``data-*`` attributes (as the page's charts carry theirs)."""
    if rep is None:
        return ""
    e = html.escape
    s = rep.get("settings") or {}
    rate = s.get("rate")
    intro = (f'<p>Sampled rate {rate:g} of sparse requests; each re-run dense while the worker '
             f'is idle, comparing the last-token distribution (KL(dense || sparse), nats), '
             f'the first answer token and up to {s.get("max_new_tokens")} greedy tokens.</p>'
             if rate is not None else "")
    if not rep.get("rows"):
        off = " (the monitor is off: --shadow-rate 0)" if rate == 0 else ""
        return (f'<h2>Sparse against dense (shadow monitor)</h2>{intro}'
                f'<p class="empty" id="shadow-empty">No shadow comparisons in this window'
                f'{off}.</p>')
    head = ("<tr><th>model</th><th>length</th><th>count</th><th>first token agrees</th>"
            "<th>answer agrees</th><th>KL p50</th><th>KL p95</th><th>KL p99</th><th>KL max</th>"
            "<th>mean density</th></tr>")
    body = []
    for r in rep["rows"]:
        dens = "-" if r["mean_density"] is None else f'{r["mean_density"]:.3f}'
        body.append(
            f'<tr class="shadow" data-model="{e(str(r["model"]))}" data-bucket="{e(r["bucket"])}" '
            f'data-count="{r["count"]}" data-argmax-agreement="{r["argmax_agreement"]}" '
            f'data-answer-agreement="{r["answer_agreement"]}" data-kl-p50="{r["kl_p50"]}" '
            f'data-kl-p95="{r["kl_p95"]}" data-kl-p99="{r["kl_p99"]}" '
            f'data-kl-max="{r["kl_max"]}"><td>{e(str(r["model"]))}</td><td>{e(r["bucket"])}</td>'
            f'<td>{r["count"]}</td><td>{r["argmax_agreement"]:.1%}</td>'
            f'<td>{r["answer_agreement"]:.1%}</td><td>{r["kl_p50"]:.3g}</td>'
            f'<td>{r["kl_p95"]:.3g}</td><td>{r["kl_p99"]:.3g}</td><td>{r["kl_max"]:.3g}</td>'
            f'<td>{dens}</td></tr>')
    return (f'<h2>Sparse against dense (shadow monitor)</h2>{intro}'
            f'<table id="shadow-table">{head}{"".join(body)}</table>')
