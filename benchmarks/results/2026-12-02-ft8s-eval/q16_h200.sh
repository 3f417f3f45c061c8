#!/usr/bin/env bash
# The ft8s reselected configs at 16K on the held-out renderer, on the GPU: the same 28 videos
# (two seed ranges) as the CPU measurements of ft5 and ft7 in BENCHMARKS.md §4, one bound per
# process, the two bounds side by side.  bash q16_h200.sh OUTDIR "0.4 0.5"
set -u
cd "$(dirname "$0")/../../.."
O=${1:?outdir}; B=${2:-"0.4 0.5"}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
R=benchmarks/results/2026-12-02-ft8s-eval
for e in $B; do
  ( M=/tmp/q16_$e; rm -rf $M; mkdir -p $M; tar -xzf benchmarks/results/2026-12-02-ft8s/model.tar.gz -C $M
    cp $R/reselect_$e.json $M/mminfer-embedded/mminfer_patterns.json
    for s in 500000 500100; do
      timeout -s INT -k 15 ${QT:-200} python3 benchmarks/quality.py --model $M/mminfer-embedded \
        --renderer eval --lengths 16384 --depths 0 0.25 0.5 0.75 1 --needle-reps 1 --per-task 3 \
        --densities --seed0 $s --workers 4 --max-minutes ${QM:-3.1} --out $O/q_${e}_$s > $O/q_${e}_$s.log 2>&1
    done ) &
done
wait
