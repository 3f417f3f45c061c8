"""lab/experiments/last_layer.py: what computing only the last row of the last layer saves."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_last_layer_benchmark_alternates_the_setting_through_the_pipeline(tmp_path):
    """lab/experiments/last_layer.py on the tiny checkpoint: both settings answer alike, every
    stage is timed, and only the served requests report a last-row-only layer."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "experiments" / "last_layer.py"), "--tiny",
                           "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "last_layer.json").read_text())
    assert rep["model"] == "qwen7b (tiny)" and set(rep["modes"]) == {"sparse", "dense"}
    for mode, r in rep["modes"].items():
        assert r["same_answer"] and r["prefill_full_over_served"] > 0
        for rec in r["requests"]["served"] + r["requests"]["full"]:
            assert rec["attention_ran"] == mode and rec["prefill_ms"] > 0
    sparse = rep["modes"]["sparse"]["requests"]
    assert all(x["last_row_only"] == rep["layers"] - 1 for x in sparse["served"])
    assert all(x["last_row_only"] is None for x in sparse["full"])
