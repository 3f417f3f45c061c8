"""benchmarks/tensor_parallel.py on the CPU (2 gloo ranks, the tiny shape): it runs the TP=1
baseline and the sharded prefill for both modes, the ranks agree on the tokens, and the
sharded model built layer by layer from name-seeded weights is the baseline's model (the
same logits and tokens), so on the GPU its ratio compares like with like."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_benchmark_runs_and_matches_tp1(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), str(ROOT / "benchmarks" / "tensor_parallel.py"),
         "--shape", "tiny", "--device", "cpu", "--lengths", "82", "--modes", "dense",
         "sparse", "--baseline", "--decode-steps", "3", "--out", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.wait(30) == 0, out[-3000:]
    rep = json.loads((tmp_path / "tensor_parallel_tiny.json").read_text())
    assert rep["world"] == 2
    assert [r["mode"] for r in rep["rows"]] == ["dense", "sparse"]
    for r in rep["rows"]:
        assert r["tp"] == 2 and r["ranks_agree"] is True
        assert r["tokens_equal_tp1"] is True and len(r["tokens"]) == 4
        assert r["logits_max_diff"] <= 1e-5 * max(1.0, r["logits_scale"]), r
        assert r["ttft_ms"] > 0 and r["tp1_ttft_ms"] > 0 and r["ratio_to_tp1"] > 0
        assert r["kv_cache_gib"] > 0
    assert rep["rows"][1]["index_ms"] > 0            # the sparse run estimated
