"""Latency records in SQLite, so the latency report survives restarts.

One row per finished request (successes and errors alike). Timings are kept as a JSON object
per row: the stage list grows with the pipeline, and the report reads whatever stages the rows
carry. The report groups successful requests by prompt length (tokens), because the cost of
prefill attention depends on length far more than on anything else.

The report is computed by SQLite (json_each, window functions), not by loading rows into
Python: sqlite3 gives up the GIL while a query runs, so a report over many rows, run in a
thread, never holds the event loop. Rows older than ``retention_days`` and beyond the newest
``max_rows`` are deleted as new ones arrive.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

# Upper edges (tokens, exclusive) of the length buckets, and their labels.
BUCKET_EDGES = (1024, 4096, 16384, 65536, 131072, 262144, 1048576)
BUCKET_LABELS = ("<1K", "1K-4K", "4K-16K", "16K-64K", "64K-128K", "128K-256K", "256K-1M", ">=1M")
# Stages in report order; rows may carry more (they are appended after these).
REPORT_STAGES = ("upload", "queue", "decode", "preprocess", "vision", "index", "attention",
                 "llm_other", "generate", "ttft", "total")

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id TEXT NOT NULL,              -- request id (client-chosen ids may repeat)
    ts REAL NOT NULL,              -- unix seconds, when the request finished
    endpoint TEXT NOT NULL,
    status INTEGER NOT NULL,       -- HTTP status answered
    code TEXT,                     -- error code, NULL on success
    model TEXT,
    attention TEXT,                -- what the prefill ran: sparse | dense
    tokens INTEGER,                -- prompt tokens (text + visual)
    visual_tokens INTEGER,
    generated INTEGER,
    density REAL,                  -- mean attention density (1.0 for dense)
    timings TEXT NOT NULL          -- JSON {stage: ms}
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
"""


def bucket_of(tokens: int) -> str:
    for edge, label in zip(BUCKET_EDGES, BUCKET_LABELS):
        if tokens < edge:
            return label
    return BUCKET_LABELS[-1]


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on a sorted list."""
    if not sorted_xs:
        return math.nan
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def parse_time(value: str | None) -> float | None:
    """A window bound: unix seconds, or ISO 8601 (naive means UTC). ValueError if neither."""
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except ValueError:
        try:
            dt = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{value!r} is neither unix seconds nor an ISO 8601 time") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        return dt.timestamp()
    if not math.isfinite(x):
        raise ValueError(f"{value!r} is not a finite time")
    return x


def _bucket_sql(col: str) -> str:
    whens = " ".join(f"WHEN {col} < {edge} THEN {i}" for i, edge in enumerate(BUCKET_EDGES))
    return f"CASE {whens} ELSE {len(BUCKET_EDGES)} END"


QUANTILES = (("p50_ms", 0.50), ("p95_ms", 0.95), ("p99_ms", 0.99))

# Per (stage, bucket): count, mean, mean density and, for each quantile q, the two ranks
# around (n - 1) q, interpolated in Python as numpy's default ("linear") does.
_REPORT_SQL = """
WITH t AS (
    SELECT j.key AS stage, {bucket} AS b, CAST(j.value AS REAL) AS ms, r.density AS density,
           r.ts AS ts
    FROM requests r, json_each(r.timings) j
    WHERE r.status = 200 AND r.tokens IS NOT NULL AND j.type IN ('integer', 'real') {window}
), ranked AS (
    SELECT stage, b, ms, density, ts,
           ROW_NUMBER() OVER (PARTITION BY stage, b ORDER BY ms) - 1 AS i,
           COUNT(*) OVER (PARTITION BY stage, b) AS n
    FROM t
)
SELECT stage, b, n, AVG(ms), AVG(density), MIN(ts), {picks}
FROM ranked GROUP BY stage, b
"""


def _picks() -> str:
    out = []
    for _, q in QUANTILES:
        lo = f"CAST((n - 1) * {q!r} AS INTEGER)"
        out.append(f"MAX(CASE WHEN i = {lo} THEN ms END)")
        out.append(f"MAX(CASE WHEN i = MIN({lo} + 1, n - 1) THEN ms END)")
    return ", ".join(out)


class LatencyStore:
    PRUNE_EVERY = 1000        # inserts between retention passes

    def __init__(self, path, retention_days: float | None = 30.0, max_rows: int | None = None):
        self.path = Path(path)
        self.retention_days = retention_days
        self.max_rows = max_rows
        self._adds = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the event loop and the worker thread, behind a lock:
        # writes are a few hundred bytes, far cheaper than a connection per call.
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._db.commit()
        self.prune()

    def prune(self, now: float | None = None) -> int:
        """Delete rows past the retention; returns how many went."""
        now = time.time() if now is None else now
        gone = 0
        with self._lock:
            if self.retention_days is not None:
                gone += self._db.execute("DELETE FROM requests WHERE ts < ?",
                                         (now - self.retention_days * 86400,)).rowcount
            if self.max_rows is not None:
                gone += self._db.execute(
                    "DELETE FROM requests WHERE rowid <= (SELECT rowid FROM requests "
                    "ORDER BY rowid DESC LIMIT 1 OFFSET ?)", (int(self.max_rows),)).rowcount
            self._db.commit()
        return gone

    def close(self):
        with self._lock:
            self._db.close()

    def add(self, *, id: str, endpoint: str, status: int, code: str | None = None,
            model: str | None = None, attention: str | None = None, tokens: int | None = None,
            visual_tokens: int | None = None, generated: int | None = None,
            density: float | None = None, timings: dict | None = None, ts: float | None = None):
        row = (id, time.time() if ts is None else ts, endpoint, int(status), code, model,
               attention, tokens, visual_tokens, generated, density,
               json.dumps(timings or {}))
        with self._lock:
            self._db.execute("INSERT INTO requests VALUES "
                             "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            self._db.commit()
            self._adds += 1
            due = self._adds % self.PRUNE_EVERY == 0
        if due:
            self.prune()

    def rows(self, since: float | None = None, until: float | None = None,
             limit: int | None = None) -> list[dict]:
        """Records in the window [since, until), oldest first (the newest ``limit``)."""
        sql, args = "SELECT * FROM requests WHERE 1=1", []
        if since is not None:
            sql += " AND ts >= ?"
            args.append(since)
        if until is not None:
            sql += " AND ts < ?"
            args.append(until)
        sql += " ORDER BY ts DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        with self._lock:
            cur = self._db.execute(sql, args)
            names = [d[0] for d in cur.description]
            out = [dict(zip(names, r)) for r in cur.fetchall()]
        for r in out:
            r["timings"] = json.loads(r["timings"])
        out.reverse()
        return out

    def report(self, since: float | None = None, until: float | None = None) -> dict:
        window, args = "", []
        if since is not None:
            window += " AND ts >= ?"
            args.append(since)
        if until is not None:
            window += " AND ts < ?"
            args.append(until)
        sql = _REPORT_SQL.format(bucket=_bucket_sql("r.tokens"), window=window.replace(
            "ts", "r.ts"), picks=_picks())
        with self._lock:
            cells = self._db.execute(sql, args).fetchall()
            total, ok = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(status = 200 AND tokens IS NOT NULL), 0) FROM "
                "requests WHERE 1=1" + window, args).fetchone()
            errs = self._db.execute(
                "SELECT COALESCE(code, CAST(status AS TEXT)), COUNT(*) FROM requests "
                "WHERE status != 200" + window + " GROUP BY 1 ORDER BY 1", args).fetchall()
        first_seen: dict[str, float] = {}
        by_cell = {}
        for stage, b, n, mean, density, ts, *picks in cells:
            first_seen[stage] = min(ts, first_seen.get(stage, ts))
            row = {"stage": stage, "bucket": BUCKET_LABELS[b], "count": n}
            for k, (name, q) in enumerate(QUANTILES):
                lo, hi = picks[2 * k], picks[2 * k + 1]
                pos = (n - 1) * q
                row[name] = round(lo + (hi - lo) * (pos - math.floor(pos)), 3)
            row["mean_ms"] = round(mean, 3)
            row["mean_density"] = round(density, 6) if density is not None else None
            by_cell[(stage, b)] = row
        extra = sorted((s for s in first_seen if s not in REPORT_STAGES), key=first_seen.get)
        stages = [s for s in (*REPORT_STAGES, *extra) if s in first_seen]
        present = sorted({b for _, b in by_cell})
        table = [by_cell[(s, b)] for s in stages for b in range(len(BUCKET_LABELS))
                 if (s, b) in by_cell]
        return {"since": since, "until": until, "requests": total, "succeeded": ok,
                "errors": dict(errs), "stages": stages,
                "buckets": [BUCKET_LABELS[b] for b in present],
                "bucket_edges_tokens": list(BUCKET_EDGES), "rows": table}
