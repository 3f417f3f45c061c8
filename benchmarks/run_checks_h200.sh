#!/usr/bin/env bash
# One device call after a merge: GPU tests (bf16/fp16 kernels, towers, prefill engine, video
# cache), the vision-tower benchmark, and by their *_S budgets: sparse-vs-dense quality of the
# embedded model (QUALITY_S: both sparse policies, the prefix's own estimate and the
# question's), the sandboxed decode's overhead (DECODE_S), the decode step (STEP_S), kernels,
# prefill, a short end-to-end case; logs and JSON under $OUT (at most 8 files come back).
#   E2E_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_checks_h200.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/checks}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then     # decord/PyAV: the tests that decode need them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
timeout -k 5 "${TESTS_S:-170}" python3 -m pytest -q -ra -m gpu ${TESTS:-tests} 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -12
if [ "${VISION_S:-190}" -gt 0 ]; then
  timeout -k 5 "${VISION_S:-190}" python3 benchmarks/vision.py --pairs 256 1024 --reps 2 \
    --out "$OUT" 2>&1 | tee "$OUT/vision.log" | tail -14
fi
if [ "${PREFILL_S:-0}" -gt 0 ]; then      # TTFT and decode steps after each prefill
  timeout -k 5 "$PREFILL_S" python3 benchmarks/prefill.py ${PREFILL_ARGS:---model qwen --lengths 131072} \
    --out "$OUT" 2>&1 | tee "$OUT/prefill.log" | tail -8
fi
if [ "${STEP_S:-0}" -gt 0 ]; then         # ms per decode step: transformers' step, lean, graph
  timeout -k 5 "$STEP_S" python3 benchmarks/decode_step.py ${STEP_ARGS:-} --out /tmp/step.json \
    2>&1 | tee "$OUT/decode_step.log" | tail -12
fi
if [ "${QUALITY_S:-0}" -gt 0 ]; then     # stops taking videos at QUALITY_MIN, writes tables
  timeout -k 5 "$QUALITY_S" python3 benchmarks/quality.py ${QUALITY_ARGS:---lengths 16384 32768 \
    --per-task 3 --depths 0 0.5 1 --densities} --max-minutes "${QUALITY_MIN:-3}" \
    --out /tmp/quality > "$OUT/quality.log" 2>&1; tail -40 "$OUT/quality.log"
  cp /tmp/quality/quality.json "$OUT/" 2>/dev/null
fi
if [ "${DECODE_S:-0}" -gt 0 ]; then       # in-process vs sandboxed decode of the 1.05M video
  timeout -k 5 "$DECODE_S" python3 benchmarks/decode.py ${DECODE_ARGS:---repeats 3} \
    --out /tmp/decode.json 2>&1 | tee "$OUT/decode.log" | tail -12
fi
if [ "${KERNELS_S:-0}" -gt 0 ]; then
  timeout -k 5 "$KERNELS_S" python3 benchmarks/kernels.py ${KERNELS_ARGS:---lengths 131072 --densities 0.1} \
    2>&1 | tee "$OUT/kernels.log" | tail -16
fi
if [ "${E2E_S:-0}" -gt 0 ]; then
  DEADLINE=$((E2E_S - 30)) TIMEOUT=$E2E_S bash benchmarks/run_e2e_h200.sh ${E2E_ARGS:-} \
    2>&1 | tail -25
fi
