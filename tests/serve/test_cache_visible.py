"""The video cache made visible: the latency store's ``cache`` column (old stores migrate),
the report's hit rate and the time to first token of hits and misses apart (JSON and page),
and /metrics counting lookups, hits, evictions and bytes per tier on a live server whose GPU
tier holds one prefix and spills the other to the host tier."""

import json
import re
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from conftest import write_video
from prometheus_client.parser import text_string_to_metric_families

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.serve.app import Settings, create_app
from mminfer.serve.report import render
from mminfer.serve.store import LatencyStore


def test_report_splits_hits_and_misses_and_old_stores_migrate(tmp_path):
    path = tmp_path / "old.sqlite3"
    # a store as the previous version wrote it: no cache column in either table
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE requests (id TEXT NOT NULL, ts REAL NOT NULL, endpoint TEXT NOT NULL,
            status INTEGER NOT NULL, code TEXT, model TEXT, attention TEXT, tokens INTEGER,
            visual_tokens INTEGER, generated INTEGER, density REAL, timings TEXT NOT NULL);
        CREATE TABLE stage_times (req INTEGER NOT NULL, stage TEXT NOT NULL, b INTEGER NOT NULL,
            ms REAL NOT NULL, ts REAL NOT NULL, density REAL, attention TEXT);""")
    now = time.time()
    cur = db.execute("INSERT INTO requests VALUES ('old', ?, 'answer', 200, NULL, 'm', 'dense', "
                     "500, 400, 2, 1.0, ?)", (now, json.dumps({"ttft": 5000.0})))
    db.execute("INSERT INTO stage_times VALUES (?, 'ttft', 0, 5000.0, ?, 1.0, 'dense')",
               (cur.lastrowid, now))
    db.commit()
    db.close()
    st = LatencyStore(path)
    for i, (cache, ttft) in enumerate([("miss", 1000.0), ("hit", 50.0), ("miss", 1200.0),
                                       ("hit", 90.0), ("host", 300.0), ("hit", 70.0),
                                       ("off", 900.0)]):
        st.add(id=f"r{i}", endpoint="chat", status=200, attention="dense", tokens=500,
               density=1.0, cache=cache, timings={"ttft": ttft, "total": ttft + 10})
    st.add(id="err", endpoint="answer", status=400, code="bad_input", timings={"total": 1.0})
    rep = st.report()
    rows = st.rows()
    st.close()
    c = rep["cache"]
    assert (c["lookups"], c["hits"], c["host_hits"], c["misses"], c["off"]) == (6, 4, 1, 2, 1)
    assert c["hit_rate"] == round(4 / 6, 6)                 # the old row is no lookup
    ttft = {r["cache"]: r for r in c["ttft"]}
    assert [r["cache"] for r in c["ttft"]] == ["miss", "hit", "host", "off"]
    assert (ttft["miss"]["count"], ttft["miss"]["p50_ms"]) == (2, 1100.0)
    assert (ttft["hit"]["count"], ttft["hit"]["p50_ms"], ttft["hit"]["p99_ms"]) == \
        (3, 70.0, pytest.approx(89.6))
    assert ttft["host"]["mean_ms"] == 300.0 and ttft["off"]["p95_ms"] == 900.0
    assert rows[0]["id"] == "old" and rows[0]["cache"] is None
    assert [r["cache"] for r in rows[1:3]] == ["miss", "hit"]
    # every stage row still counts the old request (its stage_times survived the migration)
    assert next(r for r in rep["rows"] if r["stage"] == "ttft")["count"] == 8

    page = render(rep, rows, "m")
    summary = re.search(r'<p id="cache-summary" data-hit-rate="([^"]*)" '
                        r'data-lookups="(\d+)" data-hits="(\d+)"', page)
    assert summary.groups() == (str(round(4 / 6, 6)), "6", "4")
    assert "66.7 %" in page
    got = re.findall(r'<tr class="cache-row" data-cache="(\w+)" data-count="(\d+)" '
                     r'data-p50-ms="([\d.]+)"', page)
    assert got == [("miss", "2", "1100.000"), ("hit", "3", "70.000"),
                   ("host", "1", "300.000"), ("off", "1", "900.000")]


def metrics(url) -> dict:
    """{(name, tier or cache label or None): value} of this server's cache series."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name.startswith(("mminfer:prefix_cache", "mminfer:kv_cache",
                                  "mminfer:video_store", "mminfer:request_prefix_cache")):
                out[(s.name, s.labels.get("tier") or s.labels.get("cache"))] = s.value
    return out


def ask(url, clip: Path):
    r = httpx.post(f"{url}/v1/answer", timeout=120,
                   data={"question": "what color is it?", "max_frames": "8",
                         "max_new_tokens": "2"},
                   files={"video": (clip.name, clip.read_bytes(), "video/mp4")})
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_and_report_count_the_cache_per_tier(tmp_path, live_server):
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "tiny-qwen")
    a = write_video(tmp_path / "a.mp4", n_frames=10, fps=4.0)
    b = write_video(tmp_path / "b.mp4", n_frames=11, fps=4.0)
    # how many bytes one prefix takes, from a server with the default budget
    first = live_server(create_app(Settings(model=str(ckpt), device="cpu", api_key=None,
                                            data_dir=str(tmp_path / "d1"))))
    assert ask(first.url, a)["cache"] == "miss"
    entry = metrics(first.url)[("mminfer:kv_cache_bytes", "gpu")]
    assert entry > 0
    # a GPU tier for one prefix and a host tier for several: b's prefix spills a's to the host
    gib = 2 ** 30
    srv = live_server(create_app(Settings(
        model=str(ckpt), device="cpu", api_key=None, data_dir=str(tmp_path / "d2"),
        kv_cache_gb=entry * 1.5 / gib, kv_host_cache_gb=entry * 10 / gib)))
    assert srv.app.state.worker.wait_ready(60)     # the cache exists once the model is in
    before = metrics(srv.url)
    assert before[("mminfer:prefix_cache_queries_total", None)] == 0
    assert before[("mminfer:kv_cache_budget_bytes", "gpu")] == int(entry * 1.5)
    assert before[("mminfer:video_store_videos", None)] == 0
    results = [ask(srv.url, clip) for clip in (a, b, a, a)]
    assert [r["cache"] for r in results] == ["miss", "miss", "host", "hit"]
    assert results[2]["timings_ms"]["restore"] > 0 and results[0]["timings_ms"]["restore"] == 0
    # the spills go to the host on a thread of their own: b's may land after a's answer
    assert srv.app.state.worker.pipeline.video_cache.settle(30)
    m = metrics(srv.url)
    assert m[("mminfer:prefix_cache_queries_total", None)] == 4
    assert m[("mminfer:prefix_cache_hits_total", None)] == 2          # vLLM's pair
    assert m[("mminfer:prefix_cache_host_hits_total", None)] == 1
    assert m[("mminfer:prefix_cache_misses_total", None)] == 2
    # one question at a time: each decoded in its entry's tail; no prefill waited for memory
    assert m[("mminfer:prefix_cache_tail_reads_total", None)] == 4
    assert m[("mminfer:prefix_cache_room_waits_total", None)] == 0
    # a spilled for b, then b for a coming back
    assert m[("mminfer:prefix_cache_evictions_total", "gpu")] == 2
    # both spills landed on the host: b's bytes are there now, a's went before them
    assert m[("mminfer:prefix_cache_spilled_bytes_total", None)] > \
        m[("mminfer:kv_cache_bytes", "host")] > 0
    assert m[("mminfer:prefix_cache_spill_seconds_total", None)] > 0
    assert m[("mminfer:prefix_cache_evictions_total", "host")] == 0
    assert m[("mminfer:kv_cache_entries", "gpu")] == 1 and m[("mminfer:kv_cache_entries",
                                                              "host")] == 1
    assert m[("mminfer:kv_cache_bytes", "gpu")] == entry and \
        m[("mminfer:kv_cache_bytes", "host")] > 0
    assert (m[("mminfer:request_prefix_cache_total", "miss")],
            m[("mminfer:request_prefix_cache_total", "host")],
            m[("mminfer:request_prefix_cache_total", "hit")]) == (2, 1, 1)

    rep = httpx.get(f"{srv.url}/v1/latency-report").json()["cache"]
    assert (rep["lookups"], rep["hits"], rep["host_hits"], rep["misses"]) == (4, 2, 1, 2)
    assert rep["hit_rate"] == 0.5
    ttft = {r["cache"]: r for r in rep["ttft"]}
    assert (ttft["miss"]["count"], ttft["host"]["count"], ttft["hit"]["count"]) == (2, 1, 1)
    assert ttft["hit"]["p50_ms"] == pytest.approx(results[3]["timings_ms"]["ttft"], abs=1e-3)
    page = httpx.get(f"{srv.url}/report").text
    assert 'data-hit-rate="0.5"' in page and 'data-cache="host"' in page
