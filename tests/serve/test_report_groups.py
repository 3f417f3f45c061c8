"""The latency report keeps dense and sparse requests apart: one row per stage, length bucket
and attention, in the JSON and on the page (a real server, a real sparse prefill)."""

import json
import re
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from mminfer.serve.app import Settings, create_app
from mminfer.serve.store import LatencyStore
from lab.toy.tiny import save_tiny_qwen2_5_vl

NEEDLE = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"


def ask(url, attention):
    r = httpx.post(f"{url}/v1/answer", timeout=600,
                   data={"question": "what number?", "fps": "1", "max_frames": "4",
                         "max_new_tokens": "2", "attention": attention},
                   files={"video": ("needle.mp4", NEEDLE.read_bytes(), "video/mp4")})
    assert r.status_code == 200, r.text
    return r.json()


def test_dense_and_sparse_are_separate_rows_in_json_and_page(tmp_path, live_server):
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "tiny-qwen")
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path / "d"),
                              api_key=None))
    s = live_server(app)
    dense = [ask(s.url, "dense") for _ in range(2)]
    sparse = ask(s.url, "sparse")
    assert sparse["attention"] == "sparse" and {d["attention"] for d in dense} == {"dense"}
    assert {d["tokens"]["total"] for d in dense} == {sparse["tokens"]["total"]}  # one bucket

    rep = httpx.get(f"{s.url}/v1/latency-report").json()
    assert rep["buckets"] == ["<1K"] and rep["attentions"] == ["dense", "sparse"]
    assert rep["groups"] == [{"bucket": "<1K", "attention": "dense"},
                             {"bucket": "<1K", "attention": "sparse"}]
    rows = {(r["stage"], r["bucket"], r["attention"]): r for r in rep["rows"]}
    d, sp = rows[("ttft", "<1K", "dense")], rows[("ttft", "<1K", "sparse")]
    assert (d["count"], sp["count"]) == (2, 1)
    assert d["mean_density"] == 1.0
    assert sp["mean_density"] == pytest.approx(sparse["sparsity"]["mean_density"], abs=1e-6)
    assert sp["p50_ms"] == pytest.approx(sparse["timings_ms"]["ttft"], abs=1e-3)
    want = sorted(x["timings_ms"]["ttft"] for x in dense)
    assert d["p50_ms"] == pytest.approx(sum(want) / 2, abs=1e-3)
    assert ("index", "<1K", "sparse") in rows and rows[("index", "<1K", "dense")][
        "p99_ms"] == 0.0                                     # no estimation in a dense prefill

    page = httpx.get(f"{s.url}/report").text
    chart = page[page.index('id="stage-chart"'):]
    chart = chart[:chart.index("</svg>")]
    bars = re.findall(r'<g class="bucket" data-bucket="([^"]+)" data-attention="([^"]*)" '
                      r'data-count="(\d+)">', chart)
    assert bars == [("&lt;1K", "dense", "2"), ("&lt;1K", "sparse", "1")]
    assert "&lt;1K tok sparse" in chart
    ttft_rows = re.findall(r'<tr data-stage="ttft" data-bucket="&lt;1K" '
                           r'data-attention="(\w+)">', page)
    assert ttft_rows == ["dense", "sparse"]


def test_store_groups_by_attention_and_migrates_old_rows(tmp_path):
    path = tmp_path / "old.sqlite3"
    # a store as the previous version wrote it: stage_times without the attention column
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE requests (id TEXT NOT NULL, ts REAL NOT NULL, endpoint TEXT NOT NULL,
            status INTEGER NOT NULL, code TEXT, model TEXT, attention TEXT, tokens INTEGER,
            visual_tokens INTEGER, generated INTEGER, density REAL, timings TEXT NOT NULL);
        CREATE TABLE stage_times (req INTEGER NOT NULL, stage TEXT NOT NULL, b INTEGER NOT NULL,
            ms REAL NOT NULL, ts REAL NOT NULL, density REAL);
        CREATE INDEX stage_times_order ON stage_times (stage, b, ms, ts, density);""")
    now = time.time()
    for i in range(1, 5):
        attn, ms, dens = ("dense", 10.0 * i, 1.0) if i % 2 else ("sparse", 100.0 * i, 0.2)
        cur = db.execute("INSERT INTO requests VALUES (?, ?, 'answer', 200, NULL, 'm', ?, 500, "
                         "400, 2, ?, ?)", (f"r{i}", now, attn, dens, json.dumps({"ttft": ms})))
        db.execute("INSERT INTO stage_times VALUES (?, 'ttft', 0, ?, ?, ?)",
                   (cur.lastrowid, ms, now, dens))
    db.commit()
    db.close()
    st = LatencyStore(path)
    st.add(id="new", endpoint="chat", status=200, attention="sparse", tokens=600, density=0.4,
           timings={"ttft": 500.0})
    st.add(id="none", endpoint="answer", status=200, tokens=700, timings={"ttft": 1.0})
    rep = st.report()
    st.close()
    rows = {r["attention"]: r for r in rep["rows"] if r["stage"] == "ttft"}
    assert rep["attentions"] == ["dense", "sparse", None]
    assert (rows["dense"]["count"], rows["dense"]["p50_ms"]) == (2, 20.0)       # 10, 30
    assert (rows["sparse"]["count"], rows["sparse"]["p50_ms"]) == (3, 400.0)    # 200, 400, 500
    assert rows["sparse"]["mean_density"] == round((0.2 + 0.2 + 0.4) / 3, 6)
    assert rows[None]["count"] == 1
    idx = {r[1] for r in sqlite3.connect(path).execute("PRAGMA index_list(stage_times)")}
    assert "stage_times_group" in idx and "stage_times_order" not in idx
