#!/usr/bin/env bash
# Issue 12, one device call: are the per-family fastest kernel variants (the default since
# this check) faster through the product's prefill
# engine (key-grouped launches included), side by side? Then where the 256K estimation time goes,
# and the GPU tests of kernels and estimation.
#
#   E2E_COMMIT=$(git rev-parse --short HEAD) bash lab/experiments/run_variants_ab_h200.sh
#
# prefill.py runs four times, alternating MMINFER_KERNEL_VARIANT=current / fastest: the first
# pair fills Triton's on-disk cache (prefill.py warms only two layers, so a variant a later
# layer needs would otherwise compile inside the timing); the second pair is the comparison.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/variants_ab}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
echo "${E2E_COMMIT:-unknown}" > "$OUT/COMMIT.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
LEN=${LENGTHS:-131072}
for pass in 1 2; do
  for v in current fastest; do
    export MMINFER_KERNEL_VARIANT=$v
    echo "== pass $pass variant $v"
    timeout -k 5 "${PREFILL_S:-100}" python3 benchmarks/prefill.py --model qwen --lengths $LEN \
      --dense-full-max 0 --out "$OUT/prefill_${v}_$pass" 2>&1 | tail -6
  done
done
unset MMINFER_KERNEL_VARIANT
timeout -k 5 "${EST_S:-90}" python3 benchmarks/estimate.py --lengths 262144 --profile --no-dense \
  --out "$OUT/estimate" 2>&1 | tee "$OUT/estimate.log" | tail -30
timeout -k 5 "${TESTS_S:-200}" python3 -m pytest -q -ra -m gpu tests/kernels tests/sparse 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -8
