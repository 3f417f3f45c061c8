#!/usr/bin/env bash
# One device call: `mminfer calibrate` on the full-size Qwen2.5-VL-7B and LongVILA-7B shapes
# (random weights written under /tmp, a ~32K-token synthetic video each; FRAMES_QWEN /
# FRAMES_LONGVILA change that), measured by benchmarks/calibrate.py: minutes (capture,
# search, total) and peak GPU / host memory. calibrate.json and calibrate.log come back in $OUT.
#   E2E_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_calibrate_h200.sh
# Budgets per model: QWEN_S, LONGVILA_S (s; 0 skips one). Extra calibrate arguments: CAL_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/calibrate}; mkdir -p "$OUT"
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
if [ "${QWEN_S:-280}" -gt 0 ]; then
  timeout -k 10 "${QWEN_S:-280}" python3 benchmarks/calibrate.py --model qwen \
    --frames "${FRAMES_QWEN:-448}" --deadline-s $(( ${QWEN_S:-280} - 15 )) --out "$OUT" -- ${CAL_ARGS:-} 2>&1 | tail -12
fi
if [ "${LONGVILA_S:-280}" -gt 0 ]; then
  timeout -k 10 "${LONGVILA_S:-280}" python3 benchmarks/calibrate.py --model longvila \
    --frames "${FRAMES_LONGVILA:-128}" --deadline-s $(( ${LONGVILA_S:-280} - 15 )) --out "$OUT" -- ${CAL_ARGS:-} 2>&1 | tail -12
fi
