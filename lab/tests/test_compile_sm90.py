"""The lab's decode kernels build for Hopper (sm_90), checked without a GPU: the Triton
interpreter the CPU tests run accepts code the compiler refuses (found on an H100: the ragged
attention's branches gave one variable two types)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lab_decode_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_compile_sm90.py"))],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 11
    failed = [r for r in rows if "error" in r]
    assert not failed, failed
    assert all(r["cubin_bytes"] > 0 for r in rows)
