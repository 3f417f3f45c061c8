"""Latency records in SQLite, so the latency report survives restarts.

One row per finished request (successes and errors alike). Timings are kept as a JSON object
per row: the stage list grows with the pipeline, and the report reads whatever stages the rows
carry. The report groups successful requests by prompt length (tokens), because the cost of
prefill attention depends on length far more than on anything else.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from mminfer.engine.timing import SERVED_STAGES as REPORT_STAGES

# Upper edges (tokens, exclusive) of the length buckets, and their labels.
BUCKET_EDGES = (1024, 4096, 16384, 65536, 131072, 262144, 1048576)
BUCKET_LABELS = ("<1K", "1K-4K", "4K-16K", "16K-64K", "64K-128K", "128K-256K", "256K-1M", ">=1M")
# Stages in report order (SERVED_STAGES); rows may carry more (they are appended after these).

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


class LatencyStore:
    def __init__(self, path):
        self.path = Path(path)
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
        rows = self.rows(since, until)
        ok = [r for r in rows if r["status"] == 200 and r["tokens"] is not None]
        groups: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
        stages = list(REPORT_STAGES)
        for r in ok:
            b = bucket_of(r["tokens"])
            for stage, ms in r["timings"].items():
                if not isinstance(ms, (int, float)):
                    continue
                if stage not in stages:
                    stages.append(stage)
                groups.setdefault((stage, b), []).append((float(ms), r["density"]))
        table = []
        for stage in stages:
            for b in BUCKET_LABELS:
                vals = groups.get((stage, b))
                if not vals:
                    continue
                ms = sorted(v for v, _ in vals)
                dens = [d for _, d in vals if d is not None]
                table.append({
                    "stage": stage, "bucket": b, "count": len(ms),
                    "p50_ms": round(percentile(ms, 0.50), 3),
                    "p95_ms": round(percentile(ms, 0.95), 3),
                    "p99_ms": round(percentile(ms, 0.99), 3),
                    "mean_ms": round(sum(ms) / len(ms), 3),
                    "mean_density": round(sum(dens) / len(dens), 6) if dens else None,
                })
        errors: dict[str, int] = {}
        for r in rows:
            if r["status"] != 200:
                errors[r["code"] or str(r["status"])] = errors.get(r["code"] or
                                                                   str(r["status"]), 0) + 1
        present = {b for _, b in groups}
        return {"since": since, "until": until, "requests": len(rows), "succeeded": len(ok),
                "errors": errors, "stages": [s for s in stages if any(
                    (s, b) in groups for b in BUCKET_LABELS)],
                "buckets": [b for b in BUCKET_LABELS if b in present],
                "bucket_edges_tokens": list(BUCKET_EDGES), "rows": table}
