"""The `mminfer serve` process: SIGUSR1 prints every thread's stack while it serves (what
benchmarks/load.py asks of a server whose request never came back)."""

import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import load  # noqa: E402 - benchmarks/ is not a package


def test_sigusr1_prints_every_thread_and_the_server_goes_on(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MMINFER_API_KEY", None)
    log = tmp_path / "server.log"
    srv = load.Server(["--device", "cpu"], env, log=log)
    try:
        srv.dump_threads(wait_s=0.0)
        text = ""
        for _ in range(100):           # the dump comes through the server's output pipe
            text = log.read_text()
            if "most recent call first" in text and "Thread 0x" in text:
                break
            time.sleep(0.1)
        assert "most recent call first" in text and "Thread 0x" in text, text[-2000:]
        assert srv.proc.poll() is None
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
    finally:
        srv.close()
