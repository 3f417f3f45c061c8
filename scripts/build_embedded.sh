#!/usr/bin/env bash
# Rebuild the embedded default model (mminfer/models/mminfer-embedded) the way the shipped one
# was made, on one H200 (torch 2.11 + CUDA 13, transformers 5.17): two training runs on
# synth's look, a third on randomised renderings (mminfer.toy.variety), calibration, the
# quality benchmark on synth and on the evaluation-only renderer. About 25 minutes of GPU
# time. Training is not bit-reproducible (GPU kernels, worker processes), so a rebuild gives
# an equivalent model, not the same bytes. Steps 3-5 are also the two device calls of
# benchmarks/run_embedded_h200.sh (train, eval), which start from the shipped model.
#
#   bash scripts/build_embedded.sh [WORK_DIR]      # then: cp -r WORK_DIR/mminfer-embedded mminfer/models/
#
# Run from the repository root (PYTHONPATH is set here, no install needed).
set -euo pipefail
WORK=${1:-out/embedded}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$WORK"

# 1. from scratch on synth's look: curriculum from 64 to ~17K visual tokens in the time box
python3 scripts/train_embedded.py --variety 0 --minutes 8.6 --out "$WORK/run1" \
    2>&1 | tee "$WORK/train1.log"
# 2. continue at the long lengths (the curriculum run 1 ended at) with a lower peak rate
python3 scripts/train_embedded.py --variety 0 --init "$WORK/run1" --lr 6e-4 --warmup 20 \
    --minutes 4.2 --out "$WORK/run2" 2>&1 | tee "$WORK/train2.log"
# 3. fine-tune on randomised renderings (80 %; synth's look the rest) at every frame size the
#    adapter gives, curriculum restarted at 8 pairs up to 2048 (the folder name
#    "mminfer-embedded" is the identity the calibrated config below is written for)
python3 scripts/train_embedded.py --init "$WORK/run2" --start-pairs 8 --lr 1e-3 --warmup 30 \
    --variety 0.8 --reserve 45 --minutes 8.8 --out "$WORK/mminfer-embedded" \
    2>&1 | tee "$WORK/train3.log"
# 4. head patterns with mass budgets from twelve synth videos, four tasks x 8K / 16K / 32K
#    tokens (calibration seeds 900,000+, used by no training or evaluation set; calibration
#    uses synth only, the evaluation below also render_eval, which nothing trains on)
VIDS=(); s=900000
for n in 1024 2048 4096; do
  for t in needle colour order count; do VIDS+=("synth:$t:$n:$s"); s=$((s + 1)); done
done
python3 -m mminfer calibrate --model "$WORK/mminfer-embedded" --device cuda \
    --budget 0.1 0.25 --gamma 0.8 0.9 0.95 0.99 --max-density 0.3 --max-error 0.05 \
    --videos "${VIDS[@]}" --capture-dir "$WORK/captures" \
    --out "$WORK/mminfer-embedded/mminfer_patterns.json"
# 5. sparse vs dense on held-out videos (BENCHMARKS.md section 4): the evaluation-only
#    renderer, then synth's held-out seeds
python3 benchmarks/quality.py --model "$WORK/mminfer-embedded" --renderer eval \
    --out "$WORK/quality_eval" --lengths 1024 4096 8192 16384 32768 --needle-reps 2 \
    --per-task 6 --densities 0.2 --max-minutes 5
python3 benchmarks/quality.py --model "$WORK/mminfer-embedded" --out "$WORK/quality" \
    --lengths 1024 4096 8192 16384 32768 --needle-reps 4 --per-task 6 --densities 0.2 \
    --max-minutes 4.3
