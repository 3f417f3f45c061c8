"""The `mminfer serve` process: the CUDA allocator it runs with (expandable segments unless the
operator's environment names a configuration; on a GPU the configuration PyTorch's allocator
then runs, CUDA graphs included), and SIGUSR1 printing every thread's stack while it serves
(what benchmarks/load.py asks of a server whose request never came back)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from mminfer.serve.cli import CUDA_ALLOC_CONF, default_allocator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import load  # noqa: E402 - benchmarks/ is not a package


def test_expandable_segments_unless_the_operator_says_otherwise():
    env = {}
    default_allocator(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOC_CONF}
    assert "expandable_segments:True" in CUDA_ALLOC_CONF
    for key, value in (("PYTORCH_CUDA_ALLOC_CONF", ""),
                       ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512"),
                       ("PYTORCH_ALLOC_CONF", "expandable_segments:False")):
        env = {key: value}
        default_allocator(env)
        assert env == {key: value}


PROBE = """
import torch
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
y = torch.ones(1024, device="cuda")
with torch.cuda.stream(s):
    y.mul_(2)
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    z = y * 3
g.replay()
torch.cuda.synchronize()
assert float(z[0]) == 6.0
print(all(seg.get("is_expandable") for seg in torch.cuda.memory._snapshot()["segments"]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("conf, expandable", [(None, "True"), ("", "False")])
def test_the_allocator_runs_the_configuration_and_graphs(conf, expandable):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    code = "from mminfer.serve.cli import default_allocator; default_allocator()\n" + PROBE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == expandable


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
