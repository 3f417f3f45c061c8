#!/usr/bin/env bash
# One device call: lab/experiments/last_layer.py on Qwen2.5-VL-7B's shapes (random weights, written
# under /tmp) and on the embedded model, through Pipeline.answer; results in $OUT/<model>/.
# Carry .whl (the decord wheel, BENCHMARKS.md, end to end, says how): the GPU machine cannot
# decode a file without it. QWEN_FRAMES (256: 38K tokens at 300 per frame pair),
# EMB_FRAMES (4096: 33K tokens), REPS (2).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/last_layer}; mkdir -p "$OUT"
source benchmarks/device_env.sh       # PYTHONPATH, the .whl wheels
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "cores $(nproc)"
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/device.txt"
timeout -k 10 "${QWEN_TIMEOUT:-330}" python3 lab/experiments/last_layer.py --model qwen7b \
  --frames "${QWEN_FRAMES:-256}" --reps "${REPS:-2}" --out "$OUT/qwen7b" 2>&1 | tee "$OUT/qwen7b.log"
timeout -k 10 "${EMB_TIMEOUT:-200}" python3 lab/experiments/last_layer.py --model embedded \
  --frames "${EMB_FRAMES:-4096}" --size 224 224 --reps "${REPS:-2}" --out "$OUT/embedded" \
  2>&1 | tee "$OUT/embedded.log"
