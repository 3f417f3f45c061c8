"""The Docker image: what its build copies is enough for a plain ``pip install .`` with every
package file (configs, the embedded model, fonts) in the wheel, and it installs a C compiler
(Triton builds its launcher with one at the first sparse kernel launch) — checked here without
Docker. Where a Docker engine runs, the image is built and answers the sample inside, on the
sparse path (on a CPU-only host the kernels run under the interpreter); elsewhere that test is
skipped with the reason."""

import fnmatch
import glob
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "mminfer:docker-check"


def _engine() -> str | None:
    """Why Docker cannot be used here, or None."""
    if shutil.which("docker") is None:
        return "no docker command"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the docker command does not answer ({type(e).__name__})"
    if r.returncode != 0:
        return f"no Docker engine answers ({r.stderr.strip()[:200]})"
    return None


def _copies() -> list[tuple[list[str], str]]:
    """The Dockerfile's ``COPY src... dest`` lines from the build context."""
    out = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            out.append((parts[1:-1], parts[-1]))
    return out


def _ignored(rel: str) -> bool:
    pats = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
            if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p.removeprefix("**/"))
               or rel.split("/")[0] == p for p in pats)


def test_the_build_context_installs_every_package_file(tmp_path):
    """A wheel built from exactly what the Dockerfile copies holds every tracked file of the
    package: the install in the image is complete without the source tree."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for sources, _ in _copies():
        for pattern in sources:
            for src in glob.glob(str(ROOT / pattern)):
                rel = str(Path(src).relative_to(ROOT))
                assert not _ignored(rel), f"{rel} is copied but .dockerignore drops it"
                dst = ctx / rel
                if Path(src).is_dir():
                    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(src, dst)
    copied = {p for ps, _ in _copies() for p in ps}
    assert {"pyproject.toml", "mminfer"} <= copied and "samples" in copied
    (readme,) = re.findall(r'^readme = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                           re.M)
    assert (ctx / readme).is_file(), "pyproject's readme is not in the build context"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ctx), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("mminfer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "mminfer"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked and [t for t in tracked if t not in names] == []
    for data in ("mminfer/models/configs/qwen2_5_vl_7b.json",
                 "mminfer/models/mminfer-embedded/model.safetensors"):
        assert data in names
    assert not [n for n in names if n.endswith(".ttf") or n.startswith("lab/")]  # no lab code


def test_the_image_has_a_c_compiler_and_installs_plainly():
    text = (ROOT / "Dockerfile").read_text()
    run = " ".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "gcc" in run and "libc6-dev" in run        # Triton's launcher build needs both
    assert "pip install ." in run and "pip install -e" not in run
    entry = json.loads(text.split("ENTRYPOINT", 1)[1].strip().splitlines()[0])
    assert entry[:2] == ["mminfer", "serve"]


NO_DOCKER = _engine()


@pytest.mark.skipif(NO_DOCKER is not None, reason=f"Docker: {NO_DOCKER}")
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
