#!/usr/bin/env bash
# Rebuild the embedded default model (mminfer/models/mminfer-embedded) the way the shipped one was made, on one
# H200 (torch 2.11 + CUDA 13, transformers 5.17): two training runs, calibration, the quality
# benchmark. About 15 minutes of GPU time. Training is not bit-reproducible (GPU kernels,
# worker processes), so a rebuild gives an equivalent model, not the same bytes.
#
#   bash scripts/build_embedded.sh [WORK_DIR]      # then: cp -r WORK_DIR/mminfer-embedded mminfer/models/
#
# Run from the repository root (PYTHONPATH is set here, no install needed).
set -euo pipefail
WORK=${1:-out/embedded}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$WORK"

# 1. from scratch: curriculum from 64 to ~17K visual tokens inside the time box
python3 scripts/train_embedded.py --minutes 8.6 --out "$WORK/run1" 2>&1 | tee "$WORK/train1.log"
# 2. continue at the long lengths with a lower peak rate (the folder name "mminfer-embedded" is the
#    identity the calibrated config below is written for)
python3 scripts/train_embedded.py --init "$WORK/run1" --start-pairs 2048 --lr 6e-4 --warmup 20 \
    --minutes 4.2 --out "$WORK/mminfer-embedded" 2>&1 | tee "$WORK/train2.log"
# 3. head patterns from four 16K-token synthetic videos (calibration seeds 900,000+, used by
#    no training or evaluation set)
python3 -m mminfer calibrate --model "$WORK/mminfer-embedded" --device cuda --budget 0.1 0.25 \
    --videos synth:needle:2048:900000 synth:colour:2048:900001 synth:order:2048:900002 \
             synth:count:2048:900003 \
    --capture-dir "$WORK/captures" --out "$WORK/mminfer-embedded/mminfer_patterns.json"
# 4. sparse vs dense on held-out videos (BENCHMARKS.md section 4)
python3 benchmarks/quality.py --model "$WORK/mminfer-embedded" --out "$WORK/quality" \
    --lengths 1024 4096 8192 16384 32768 --needle-reps 4 --per-task 6 --max-minutes 4.3
