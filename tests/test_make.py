"""What `make run` and `make test` would do, read with `make -n` (nothing is installed).

`make run` installs the runtime alone and serves: a hub id downloads (offline only where the
environment says so, or for the embedded model, which is local), and the Triton interpreter
is the default only on a machine without a GPU. `make test` adds the test extras and forces
both. The stamps make every install happen once.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def make_n(*args, venv: Path | None = None) -> list[str]:
    """The commands `make -n` prints for ``args``, continued lines joined."""
    extra = [f"VENV={venv}"] if venv is not None else []
    r = subprocess.run(["make", "-n", "-C", str(ROOT), *args, *extra],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.replace("\\\n", " ").splitlines()


def serve_line(*args) -> str:
    (line,) = [ln for ln in make_n("run", *args) if "mminfer serve" in ln]
    return line


def installs(lines) -> list[str]:
    return [ln for ln in lines if "pip install" in ln and "--upgrade pip" not in ln]


def test_a_hub_id_is_fetched_unless_the_environment_says_offline():
    assert "HF_HUB_OFFLINE" not in serve_line("MODEL=Qwen/Qwen2.5-VL-7B-Instruct")
    # the embedded default is local: served offline unless the user says otherwise
    assert "HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}" in serve_line()


def test_the_interpreter_is_the_default_only_without_a_gpu():
    on_gpu = serve_line("GPU=1", "MODEL=Qwen/Qwen2.5-VL-7B-Instruct")
    assert "TRITON_INTERPRET" not in on_gpu, on_gpu
    assert "TRITON_INTERPRET=${TRITON_INTERPRET:-1}" in serve_line("GPU=")


def test_a_gpu_machine_gets_the_cuda_torch():
    cpu = installs(make_n("setup", "GPU=", venv=Path("/nonexistent-venv")))
    gpu = installs(make_n("setup", "GPU=1", venv=Path("/nonexistent-venv")))
    assert any("+cpu" in ln and "download.pytorch.org/whl/cpu" in ln for ln in cpu), cpu
    (torch,) = [ln for ln in gpu if "'torch==" in ln]
    assert "+cpu" not in torch and "--extra-index-url" not in torch
    docker = (ROOT / "Dockerfile").read_text()
    version = re.search(r"torch==(\S+)'", torch).group(1)
    assert f"uv pip install torch=={version}" in docker


def test_tests_force_offline_and_the_interpreter():
    (line,) = [ln for ln in make_n("test") if "pytest" in ln]
    assert "TRITON_INTERPRET=1" in line and "HF_HUB_OFFLINE=1" in line


def _stamp_names() -> tuple[str, str]:
    lines = make_n("setup", venv=Path("/nonexistent-venv"))
    (touch,) = [ln for ln in lines if ln.startswith("touch ")]
    runtime = Path(touch.split()[1]).name
    return runtime, runtime.replace(".installed-", ".installed-test-")


def test_run_installs_the_runtime_alone(tmp_path):
    lines = installs(make_n("run", venv=tmp_path))
    assert lines, "a fresh venv is installed"
    assert not any("[test]" in ln or "ray" in ln for ln in lines), lines
    assert any(ln.rstrip().endswith(" -e .") for ln in lines), lines


def test_stamps_install_once(tmp_path):
    runtime, test = _stamp_names()
    # after `make run`: `make run` installs nothing, `make test` adds only the test extras
    (tmp_path / runtime).touch()
    assert installs(make_n("run", venv=tmp_path)) == []
    added = installs(make_n("test", venv=tmp_path))
    assert len(added) == 1 and "'.[test]'" in added[0], added
    # after `make test`: neither installs anything
    (tmp_path / test).touch()
    assert installs(make_n("run", venv=tmp_path)) == []
    assert installs(make_n("test", venv=tmp_path)) == []
