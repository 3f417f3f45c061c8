#!/usr/bin/env bash
# One device call: GPU kernel tests (bf16/fp16), the tile sweep at 128K, then the kernel
# benchmark for the lengths given. Logs and JSON under $OUT.
#   bash benchmarks/run_h200.sh 32768 131072
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu tests/kernels tests/sparse 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
if [ "${SKIP_TUNE:-0}" != 1 ]; then
  python3 benchmarks/kernels.py --lengths 131072 --densities 0.1 --tune --rep 100 \
    --patterns a_shape grid vertical_slash block 2>&1 | tee "$OUT/kernels_tune.log"
fi
python3 benchmarks/kernels.py --lengths "$@" --rep 100 2>&1 | tee "$OUT/kernels.log"
