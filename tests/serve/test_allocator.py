"""The CUDA allocator a server runs with: expandable segments unless the operator's environment
names a configuration (mminfer.serve.cli.default_allocator), and on a GPU that configuration
is the one PyTorch's allocator runs, CUDA graphs included."""

import os
import subprocess
import sys

import pytest
import torch

from mminfer.serve.cli import CUDA_ALLOC_CONF, default_allocator


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
