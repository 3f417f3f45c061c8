#!/usr/bin/env bash
# One device call: the end-to-end benchmark through Pipeline.answer (benchmarks/e2e.py) on one
# H200. Writes the random-weight checkpoints and the videos under /tmp/mminfer_e2e (local
# disk, never under $OUT); e2e.json, table.txt, e2e.log and device.txt come back in $OUT.
# Carry .whl (decord and PyAV wheels, docs/development.md "Device runs" says how to fetch
# them): the GPU machine has neither; without them the pipeline cannot decode a file.
#
# Without arguments it runs the dense baselines' check, one call (~7-7.5 min estimated from
# the committed runs; see e2e.py's docstring): qwen276k, longvila1m, qwen115k, in that order
# (the deadline drops the last steps first), --warmup short, no follow-up questions, and
#   - sparse and dense measured at 276K and 115K, beside the transformers baseline;
#   - the dense probe (4 of the 28 layers, each run in full through the product's dense
#     prefill) at each length, validated against the measured dense rows (measured / probe,
#     5 % tolerance; the "Dense probe" table);
#   - our dense prefill's attention TFLOP/s beside a standalone cuDNN SDPA call at 276K and
#     115K (the "Dense attention" table; target ours/cuDNN >= 0.95);
#   - the 1.05M dense and baseline rows from those 4 measured layers (marked x; corrected by
#     the 276K factor where the probe and the measured run disagree by more than 5 %).
#   bash benchmarks/run_e2e_h200.sh                          # the above
#   bash benchmarks/run_e2e_h200.sh --cases qwen115k qwen276k --warmup short
# Arguments replace those defaults and go to e2e.py as they are. DEADLINE (s, default 540)
# makes e2e.py skip steps that would not end in time; TIMEOUT (default 585) stops it (it
# still writes the table) inside the device tool's 600 s limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/e2e}; mkdir -p "$OUT"
source benchmarks/device_env.sh       # PYTHONPATH, the .whl wheels
if [ "$#" -eq 0 ]; then
  set -- --cases qwen276k longvila1m qwen115k --warmup short --follow-ups 0 --dense-layers 4
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  echo "cores $(nproc)"; free -g | head -2; df -h /tmp | tail -1
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  python3 -c "import decord; print('decord', decord.__version__)" 2>&1 | tail -1
  python3 -c "import av; print('av', av.__version__)" 2>&1 | tail -1
  python3 -c "import cv2; print('cv2', cv2.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/device.txt"
timeout -k 10 "${TIMEOUT:-585}" python3 benchmarks/e2e.py --out "$OUT" \
  --deadline-s "${DEADLINE:-540}" "$@" 2>&1 | tee "$OUT/e2e.log"
# CLI=1: the same videos and checkpoints answered by the command users run, `mminfer answer`
# (a fresh process per case: load, compile from the warm Triton cache, one sparse request);
# CLI_CASES="qwen276k longvila1m" picks cases (default: every case e2e.json holds).
if [ "${CLI:-0}" = 1 ] && [ -f "$OUT/e2e.json" ]; then
  python3 - "$OUT/e2e.json" <<'PY' > "$OUT/cli_cases.txt" || echo "no CLI cases: see above"
import json, sys
d = json.load(open(sys.argv[1]))
import os
pick = os.environ.get("CLI_CASES", "").split()
for name, c in d["cases"].items():
    if c.get("checkpoint") and c.get("video") and (not pick or name in pick):
        # a reused video's record has no frame count: the case's own is the same
        frames = c["video"].get("frames") or c["case"]["frames"]
        print(name, c["checkpoint"]["path"], c["video"]["path"], frames)
PY
  while read -r name ckpt video frames; do
    echo "== mminfer answer ($name)"
    ( time timeout -k 5 "${CLI_S:-150}" python3 -m mminfer answer "$video" "$(python3 -c \
        "import json;print(json.load(open('$OUT/e2e.json'))['question'])")" --model "$ckpt" \
        --attention sparse --max-frames "$frames" --json ) > "$OUT/cli_$name.json" \
        2> "$OUT/cli_$name.log"
    tail -4 "$OUT/cli_$name.log"
    python3 -c "import json,sys; r=json.load(open('$OUT/cli_$name.json')); print({k: r.get(k) for k in ('answer','num_tokens','tokens','timings_ms')})" 2>&1 | cut -c1-600
  done < "$OUT/cli_cases.txt"
fi
