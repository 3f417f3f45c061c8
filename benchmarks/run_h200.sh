#!/usr/bin/env bash
# One device call: GPU kernel tests (bf16/fp16) then the kernel benchmark. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
git log -1 --format=%H >> "$OUT/device.txt" 2>/dev/null || true
python3 -m pytest -q -m gpu tests/test_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
python3 benchmarks/kernels.py "$@" 2>&1 | tee "$OUT/kernels.log"
