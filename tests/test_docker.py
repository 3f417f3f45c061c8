"""The Docker image builds and answers the sample inside, on the sparse path (Triton builds
its launcher with the image's C compiler on a GPU; on a CPU-only host the kernels run under
the interpreter). Skipped, with the reason, where no Docker engine runs."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "mminfer:docker-check"


def _engine() -> str | None:
    """Why Docker cannot be used here, or None."""
    if shutil.which("docker") is None:
        return "no docker command"
    r = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return f"no Docker engine answers ({r.stderr.strip()[:200]})"
    return None


pytestmark = pytest.mark.skipif(_engine() is not None, reason=f"Docker: {_engine()}")


def test_image_builds_and_answers_the_sample_sparse():
    subprocess.run(["docker", "build", "-t", IMAGE, str(ROOT)], check=True, timeout=3600)
    cc = subprocess.run(["docker", "run", "--rm", "--entrypoint", "gcc", IMAGE, "--version"],
                        capture_output=True, text=True, timeout=120)
    assert cc.returncode == 0, cc.stderr
    runtimes = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"],
                              capture_output=True, text=True).stdout
    gpu = ["--gpus", "all"] if "nvidia" in runtimes else ["-e", "TRITON_INTERPRET=1"]
    r = subprocess.run(["docker", "run", "--rm", *gpu, "--entrypoint", "mminfer", IMAGE,
                        "answer", "samples/videos/needle_0.mp4",
                        "What number appears in the video?", "--attention", "sparse", "--json"],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["attention"] == "sparse" and d["answer"] == "99", d
