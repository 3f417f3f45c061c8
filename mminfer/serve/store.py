"""Latency records in SQLite, so the latency report survives restarts.

One row per finished request (successes and errors alike). Timings are kept as a JSON object
per row: the stage list grows with the pipeline, and the report reads whatever stages the rows
carry. The report groups successful requests by prompt length (tokens), because the cost of
prefill attention depends on length far more than on anything else, and by the attention the
prefill ran (dense or sparse): the two cost differently at the same length.

The report is computed by SQLite, not by loading rows into Python: each successful request's
stages are also rows of ``stage_times``, indexed by (stage, bucket, ms), so a group's count
and mean are one index range and each percentile one seek to its rank. sqlite3 gives up the
GIL while a query runs, so a report, run in a thread, never holds the event loop. Rows older than ``retention_days`` and beyond the newest
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
    timings TEXT NOT NULL,         -- JSON {stage: ms}
    cache TEXT,                    -- the video's prefix: miss | hit | host | off (NULL: before
                                   -- the video cache, or an error)
    tenant TEXT                    -- the API key's tenant (serve/tenants.py)
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
-- One row per stage of each successful request: what the report reads. The covering index
-- gives each (stage, bucket) its values in order, so a percentile is one index seek.
CREATE TABLE IF NOT EXISTS stage_times (
    req INTEGER NOT NULL,          -- requests.rowid
    stage TEXT NOT NULL,
    b INTEGER NOT NULL,            -- length bucket (index into BUCKET_LABELS)
    ms REAL NOT NULL,
    ts REAL NOT NULL,
    density REAL,
    attention TEXT,                -- the request's: a report group, as the bucket is
    cache TEXT,                    -- the request's (hits and misses are reported apart)
    tenant TEXT                    -- the request's: a tenant's report reads its own rows
);
"""
# Created after any migration (a store from before the attention column has the table
# without it). The covering index gives each (stage, bucket, attention) its values in order.
INDEXES = """
DROP INDEX IF EXISTS stage_times_order;
CREATE INDEX IF NOT EXISTS stage_times_group ON stage_times
    (stage, b, attention, ms, ts, density);
CREATE INDEX IF NOT EXISTS stage_times_req ON stage_times (req);
CREATE INDEX IF NOT EXISTS stage_times_ts ON stage_times (ts);
CREATE INDEX IF NOT EXISTS stage_times_cache ON stage_times (stage, cache, ms, ts);
CREATE INDEX IF NOT EXISTS stage_times_tenant ON stage_times
    (tenant, stage, b, attention, ms, ts, density);
CREATE INDEX IF NOT EXISTS stage_times_tenant_cache ON stage_times (tenant, stage, cache, ms, ts);
CREATE INDEX IF NOT EXISTS requests_tenant ON requests (tenant, ts);
"""
CACHE_ORDER = ("miss", "hit", "host", "off")   # report order of the cache outcomes
ATTENTION_ORDER = ("dense", "sparse")     # report order; any other value (or none) after


def bucket_index(tokens: int) -> int:
    for i, edge in enumerate(BUCKET_EDGES):
        if tokens < edge:
            return i
    return len(BUCKET_EDGES)


def bucket_of(tokens: int) -> str:
    return BUCKET_LABELS[bucket_index(tokens)]


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


def time_window(since: float | None, until: float | None,
                tenant: str | None = None) -> tuple[str, list]:
    """``AND ts >= ? AND ts < ?`` for the bounds given (either may be None), and
    ``AND tenant = ?`` for a tenant's own rows (None: every tenant's), and its arguments:
    the report queries' one filter."""
    sql, args = "", []
    if tenant is not None:
        sql += " AND tenant = ?"
        args.append(tenant)
    if since is not None:
        sql += " AND ts >= ?"
        args.append(since)
    if until is not None:
        sql += " AND ts < ?"
        args.append(until)
    return sql, args


def sql_quantile(db, sql: str, args: list, n: int, q: float) -> float:
    """The q-quantile (linear between neighbours) of the ``n`` values ``sql`` selects in
    ascending order (it ends in ``ORDER BY``): two rows read at the quantile's position
    through the index, not ``n`` rows into Python."""
    pos = (n - 1) * q
    vals = [v for v, in db.execute(sql + " LIMIT 2 OFFSET ?", [*args, math.floor(pos)])]
    lo, hi = vals[0], vals[-1]
    return lo + (hi - lo) * (pos - math.floor(pos))


def connect(path: Path) -> sqlite3.Connection:
    """The report file, shared by threads (callers hold a lock) and by more than one
    connection (WAL: the latency store and the shadow monitor's table write side by side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


QUANTILES = (("p50_ms", 0.50), ("p95_ms", 0.95), ("p99_ms", 0.99))


class RetainedTable:
    """Rows of one table (plus tables keyed to it) in the latency store's SQLite file, behind one
    connection and a lock, deleted past ``retention_days`` and beyond the newest ``max_rows``.
    One connection is shared by the event loop and the worker thread: writes are a few hundred
    bytes, far cheaper than a connection per call. Subclasses name the table and create it."""

    TABLE = ""
    CHILDREN: tuple[str, ...] = ()   # tables whose rows carry ``ts`` and ``req`` (the parent rowid)
    PRUNE_EVERY = 1000               # inserts between retention passes

    def __init__(self, path, retention_days: float | None = 30.0, max_rows: int | None = None):
        self.path = Path(path)
        self.retention_days = retention_days
        self.max_rows = max_rows
        self._adds = 0
        self._lock = threading.Lock()
        self._db = connect(self.path)
        with self._lock:
            self._create()
            self._db.commit()
        self.prune()

    def _create(self):
        raise NotImplementedError

    def _write(self, statements):
        """``statements(db)`` under the lock, committed as one; prunes every PRUNE_EVERY."""
        with self._lock:
            statements(self._db)
            self._db.commit()
            self._adds += 1
            due = self._adds % self.PRUNE_EVERY == 0
        if due:
            self.prune()

    def prune(self, now: float | None = None) -> int:
        """Delete rows past the retention; returns how many of the table's went."""
        now = time.time() if now is None else now
        gone = 0
        with self._lock:
            if self.retention_days is not None:
                cut = now - self.retention_days * 86400
                gone += self._db.execute(f"DELETE FROM {self.TABLE} WHERE ts < ?",
                                         (cut,)).rowcount
                for child in self.CHILDREN:
                    self._db.execute(f"DELETE FROM {child} WHERE ts < ?", (cut,))
            if self.max_rows is not None:
                edge = self._db.execute(f"SELECT rowid FROM {self.TABLE} ORDER BY rowid DESC "
                                        "LIMIT 1 OFFSET ?", (int(self.max_rows),)).fetchone()
                if edge is not None:
                    gone += self._db.execute(f"DELETE FROM {self.TABLE} WHERE rowid <= ?",
                                             edge).rowcount
                    for child in self.CHILDREN:
                        self._db.execute(f"DELETE FROM {child} WHERE req <= ?", edge)
            self._db.commit()
        return gone

    def close(self):
        with self._lock:
            self._db.close()


class LatencyStore(RetainedTable):
    TABLE, CHILDREN = "requests", ("stage_times",)

    def _create(self):
        self._db.executescript(SCHEMA)
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(stage_times)")}
        if "attention" not in cols:        # a store written before the attention group
            self._db.execute("ALTER TABLE stage_times ADD COLUMN attention TEXT")
            self._db.execute("UPDATE stage_times SET attention = (SELECT r.attention FROM "
                             "requests r WHERE r.rowid = stage_times.req)")
        # a store written before the video cache: its rows have no cache outcome (NULL)
        # ... or before tenants: its rows have no tenant (NULL: the admin's report alone
        # reads them)
        for table in ("requests", "stage_times"):
            for col in ("cache", "tenant"):
                if col not in {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {col} TEXT")
        if self._db.execute("SELECT NOT EXISTS (SELECT 1 FROM stage_times) AND EXISTS "
                            "(SELECT 1 FROM requests)").fetchone()[0]:
            self._fill_stage_times()       # a store written before stage_times existed
        self._db.executescript(INDEXES)

    def _fill_stage_times(self):
        whens = " ".join(f"WHEN r.tokens < {e} THEN {i}" for i, e in enumerate(BUCKET_EDGES))
        self._db.execute(
            f"INSERT INTO stage_times SELECT r.rowid, j.key, CASE {whens} ELSE "
            f"{len(BUCKET_EDGES)} END, j.value, r.ts, r.density, r.attention, r.cache, "
            f"r.tenant FROM "
            f"requests r, "
            f"json_each(r.timings) j WHERE r.status = 200 AND r.tokens IS NOT NULL AND "
            f"j.type IN ('integer', 'real')")

    def add(self, *, id: str, endpoint: str, status: int, code: str | None = None,
            model: str | None = None, attention: str | None = None, tokens: int | None = None,
            visual_tokens: int | None = None, generated: int | None = None,
            density: float | None = None, timings: dict | None = None, ts: float | None = None,
            cache: str | None = None, tenant: str | None = None):
        row = (id, time.time() if ts is None else ts, endpoint, int(status), code, model,
               attention, tokens, visual_tokens, generated, density,
               json.dumps(timings or {}), cache, tenant)
        stages = [(k, float(v)) for k, v in (timings or {}).items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)]
        def statements(db):
            cur = db.execute("INSERT INTO requests (id, ts, endpoint, status, code, model, "
                             "attention, tokens, visual_tokens, generated, density, timings, "
                             "cache, tenant) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             row)
            if int(status) == 200 and tokens is not None:
                b = bucket_index(tokens)
                db.executemany("INSERT INTO stage_times (req, stage, b, ms, ts, density, "
                               "attention, cache, tenant) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                               [(cur.lastrowid, k, b, ms, row[1], density, attention, cache,
                                 tenant) for k, ms in stages])
        self._write(statements)

    def rows(self, since: float | None = None, until: float | None = None,
             limit: int | None = None, tenant: str | None = None) -> list[dict]:
        """Records in the window [since, until), oldest first (the newest ``limit``); a
        tenant's own (None: every tenant's)."""
        window, args = time_window(since, until, tenant)
        sql = "SELECT * FROM requests WHERE 1=1" + window + " ORDER BY ts DESC"
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

    def report(self, since: float | None = None, until: float | None = None,
               tenant: str | None = None) -> dict:
        """The report of the window [since, until): a tenant's own requests (None: every
        tenant's)."""
        window, args = time_window(since, until, tenant)
        with self._lock:
            groups = self._db.execute(
                "SELECT stage, b, attention, COUNT(*), AVG(ms), AVG(density), MIN(ts) FROM "
                "stage_times WHERE 1=1" + window + " GROUP BY stage, b, attention",
                args).fetchall()
            picks = {}
            for stage, b, attn, n, *_ in groups:
                for name, q in QUANTILES:
                    picks[(stage, b, attn, name)] = sql_quantile(
                        self._db, "SELECT ms FROM stage_times WHERE stage = ? AND b = ? AND "
                        "attention IS ?" + window + " ORDER BY ms", [stage, b, attn, *args], n, q)
            total, ok = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(status = 200 AND tokens IS NOT NULL), 0) FROM "
                "requests WHERE 1=1" + window, args).fetchone()
            errs = self._db.execute(
                "SELECT COALESCE(code, CAST(status AS TEXT)), COUNT(*) FROM requests "
                "WHERE status != 200" + window + " GROUP BY 1 ORDER BY 1", args).fetchall()
            cache = self._cache_report(window, args)
        first_seen: dict[str, float] = {}
        by_cell = {}
        for stage, b, attn, n, mean, density, ts in groups:
            first_seen[stage] = min(ts, first_seen.get(stage, ts))
            row = {"stage": stage, "bucket": BUCKET_LABELS[b], "attention": attn, "count": n}
            for name, q in QUANTILES:
                row[name] = round(picks[(stage, b, attn, name)], 3)
            row["mean_ms"] = round(mean, 3)
            row["mean_density"] = round(density, 6) if density is not None else None
            by_cell[(stage, b, attn)] = row
        extra = sorted((s for s in first_seen if s not in REPORT_STAGES), key=first_seen.get)
        stages = [s for s in (*REPORT_STAGES, *extra) if s in first_seen]
        attentions = sorted({a for _, _, a in by_cell}, key=attention_rank)
        groups_present = sorted({(b, a) for _, b, a in by_cell},
                                key=lambda g: (g[0], attention_rank(g[1])))
        table = [by_cell[(s, b, a)] for s in stages for b, a in groups_present
                 if (s, b, a) in by_cell]
        return {"since": since, "until": until, "requests": total, "succeeded": ok,
                "errors": dict(errs), "stages": stages,
                "buckets": [BUCKET_LABELS[b] for b in sorted({b for b, _ in groups_present})],
                "attentions": attentions,
                "groups": [{"bucket": BUCKET_LABELS[b], "attention": a}
                           for b, a in groups_present],
                "bucket_edges_tokens": list(BUCKET_EDGES), "rows": table, "cache": cache}

    def _cache_report(self, window: str, args: list) -> dict:
        """(Under the lock.) The video cache as the answered requests saw it: the hit rate
        (hits of either tier over the requests that looked the cache up: miss, hit or host)
        and the time to first token of each outcome apart, a hit's and a miss's being
        different things."""
        counts = dict(self._db.execute(
            "SELECT cache, COUNT(*) FROM requests WHERE status = 200 AND cache IS NOT NULL"
            + window + " GROUP BY cache", args).fetchall())
        lookups = sum(counts.get(c, 0) for c in ("miss", "hit", "host"))
        hits = counts.get("hit", 0) + counts.get("host", 0)
        ttft = []
        for outcome in sorted(counts, key=cache_rank):
            n, mean = self._db.execute(
                "SELECT COUNT(*), AVG(ms) FROM stage_times WHERE stage = 'ttft' AND cache = ?"
                + window, [outcome, *args]).fetchone()
            if not n:
                continue
            row = {"cache": outcome, "count": n}
            for name, q in QUANTILES:
                row[name] = round(sql_quantile(
                    self._db, "SELECT ms FROM stage_times WHERE stage = 'ttft' AND cache = ?"
                    + window + " ORDER BY ms", [outcome, *args], n, q), 3)
            row["mean_ms"] = round(mean, 3)
            ttft.append(row)
        return {"lookups": lookups, "hits": hits, "host_hits": counts.get("host", 0),
                "misses": counts.get("miss", 0), "off": counts.get("off", 0),
                "hit_rate": round(hits / lookups, 6) if lookups else None, "ttft": ttft}


def cache_rank(cache):
    return (CACHE_ORDER.index(cache), "") if cache in CACHE_ORDER else (len(CACHE_ORDER),
                                                                          cache or "")


def attention_rank(attention):
    """dense, sparse, then any other value, then none: the report's order."""
    if attention in ATTENTION_ORDER:
        return (ATTENTION_ORDER.index(attention), "")
    return (len(ATTENTION_ORDER) + (attention is None), attention or "")
