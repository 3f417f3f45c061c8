#!/usr/bin/env bash
# One device call: issue 34's FP8 checks and figures, bf16 and FP8 side by side in one call.
#   1. the GPU tests of the FP8 paths (the kernels at real sizes in bf16, _scaled_mm, graph
#      decode with FP8 layers and over an FP8 cache, the prefill's peak memory);
#   2. benchmarks/e2e.py twice on the same case(s), videos and checkpoints (written once under
#      /tmp/mminfer_e2e): as served today (bf16), then --quantization fp8 --kv-cache-dtype fp8;
#      TTFT by stage, follow-ups (decode ms/token), peak GPU memory per request; each after
#      Pipeline.warmup (--pipeline-warmup), as `mminfer serve` starts;
#   3. FP8 against bf16 answers of the embedded model (quality.py --fp8: agreement, KL);
#   4. where the time goes (BREAKDOWN_S): benchmarks/prefill.py at 276K (Qwen2.5-VL-7B text
#      model) bf16 then FP8 and benchmarks/vision.py (fused vs fp8 tower, 384 pairs), each
#      with its kernels by device time under torch.profiler; all in $OUT/breakdown.tgz.
#   5. the vision tower before/after (VISION_S): benchmarks/vision.py, bf16 and FP8, each with
#      the window layers through the rotary kernel + SDPA (@sdpa) and through
#      mminfer.kernels.window_attention, side by side;
#   6. the lab's sweeps behind issue 34's tuning (LAB_S, each): the window-attention tiles, FP8
#      GEMM accumulation, the FP8 cache's decode tiles; logs and JSON in $OUT/lab.tgz;
#   7. LongVILA's SigLIP tower (SIGLIP_S): benchmarks/siglip.py, bf16 / FP8 / FP8 fused, one
#      encoder call of each profiled, and the 1.05M video's vision stage (SIGLIP_FRAMES).
#   E2E_COMMIT=$(git rev-parse --short HEAD) CASES="qwen276k" bash benchmarks/run_fp8_h200.sh
# Budgets (s; 0 skips a step): TESTS_S, E2E_S (each of the two runs), QUALITY_S, BREAKDOWN_S,
# VISION_S, LAB_S, SIGLIP_S.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/fp8}; mkdir -p "$OUT"
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
if [ "${TESTS_S:-150}" -gt 0 ]; then
  timeout -k 5 "${TESTS_S:-150}" python3 -m pytest -q -ra -m gpu --tb=short \
    tests/models/test_fp8.py tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_gemm.py \
    tests/models/test_fp8_kv.py tests/kernels/test_fp8_attention.py \
    tests/engine/test_fp8_video_cache.py tests/kernels/test_window_attention.py \
    tests/kernels/test_vision_elementwise.py tests/models/test_vision_fused.py \
    tests/models/test_vision.py tests/models/test_siglip.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -15
fi
COMMON="--pipeline-warmup --warmup short --no-baseline --no-dense --no-host-tier --follow-ups ${FOLLOW_UPS:-2} --cases ${CASES:-qwen276k}"
if [ "${E2E_S:-200}" -gt 0 ]; then
  for variant in bf16 fp8; do
    extra=""; [ "$variant" = fp8 ] && extra="--quantization fp8 --kv-cache-dtype fp8"
    echo "== e2e $variant"
    timeout -k 10 "${E2E_S:-200}" python3 benchmarks/e2e.py --out "/tmp/e2e_$variant" \
      --deadline-s $(( ${E2E_S:-200} - 20 )) $COMMON $extra > "$OUT/e2e_$variant.log" 2>&1
    tail -20 "$OUT/e2e_$variant.log"
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
both = {v: json.loads(pathlib.Path(f"/tmp/e2e_{v}/e2e.json").read_text())
        for v in ("bf16", "fp8") if pathlib.Path(f"/tmp/e2e_{v}/e2e.json").is_file()}
(out / "e2e_bf16_fp8.json").write_text(json.dumps(both, indent=1))
PY
fi
if [ "${QUALITY_S:-0}" -gt 0 ]; then
  timeout -k 5 "$QUALITY_S" python3 benchmarks/quality.py --fp8 ${QUALITY_ARGS:---lengths 16384 \
    --per-task 3 --depths 0 0.5 1} --max-minutes "${QUALITY_MIN:-3}" --out /tmp/quality_fp8 \
    > "$OUT/quality_fp8.log" 2>&1; tail -30 "$OUT/quality_fp8.log"
  cp /tmp/quality_fp8/quality.json "$OUT/quality_fp8.json" 2>/dev/null
fi
if [ "${BREAKDOWN_S:-0}" -gt 0 ]; then
  BD="$OUT/breakdown"; mkdir -p "$BD"
  for q in none fp8; do
    timeout -k 5 "$BREAKDOWN_S" python3 benchmarks/prefill.py --model qwen \
      --lengths ${BD_TOKENS:-276480} --dense-full-max 0 --quantization $q --profile \
      --out "$BD/prefill_$q" > "$BD/prefill_$q.log" 2>&1; tail -4 "$BD/prefill_$q.log"
  done
  timeout -k 5 "$BREAKDOWN_S" python3 benchmarks/vision.py --pairs ${BD_PAIRS:-384} \
    --variants fused fp8 --hf-max-pairs 0 --reps 2 --no-preprocess --profile --gemms \
    --out "$BD/vision" > "$BD/vision.log" 2>&1; tail -8 "$BD/vision.log"
  tar czf "$OUT/breakdown.tgz" -C "$OUT" breakdown && rm -rf "$BD"
fi
if [ "${VISION_S:-0}" -gt 0 ]; then
  timeout -k 5 "$VISION_S" python3 benchmarks/vision.py --pairs ${VISION_PAIRS:-384} \
    --variants fused@sdpa fused fp8@sdpa fp8 --hf-max-pairs 0 --reps ${VISION_REPS:-3} \
    --no-preprocess --out "$OUT/vision" > "$OUT/vision.log" 2>&1; tail -8 "$OUT/vision.log"
fi
if [ "${LAB_S:-0}" -gt 0 ]; then
  mkdir -p "$OUT/lab"
  for x in ${LAB:-window_attention fp8_gemm_accum fp8_decode_tiles}; do
    echo "== lab $x"
    timeout -k 5 "$LAB_S" python3 "lab/experiments/$x.py" --out "$OUT/lab" \
      > "$OUT/lab/$x.log" 2>&1; tail -30 "$OUT/lab/$x.log"
  done
  tar czf "$OUT/lab.tgz" -C "$OUT" lab && rm -rf "$OUT/lab"
fi
if [ "${SIGLIP_S:-0}" -gt 0 ]; then
  timeout -k 5 "$SIGLIP_S" python3 benchmarks/siglip.py --profile \
    --video-frames ${SIGLIP_FRAMES:-4096} --out "$OUT/siglip" > "$OUT/siglip.log" 2>&1
  tail -6 "$OUT/siglip.log"
  tar czf "$OUT/siglip.tgz" -C "$OUT" siglip && rm -rf "$OUT/siglip"
fi
