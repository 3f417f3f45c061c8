#!/usr/bin/env bash
# The embedded model on one H200, in two device calls of < 600 s each (issue 14 part 3):
#
#   bash lab/train/run_embedded_h200.sh train                 # -> $OUT/model.tar.gz, train.log
#   bash lab/train/run_embedded_h200.sh eval MODEL_DIR_OR_TAR # -> $OUT/quality*/, calibrate.log
#   bash lab/train/run_embedded_h200.sh compare MODEL_DIR_OR_TAR CONFIG...
#                                           # -> $OUT/compare/ (one mode cfg:<stem> per config)
#
# train: fine-tunes the shipped model (mminfer/models/mminfer-embedded: it already reads synth's
#   digits) on the randomised renderings of lab.toy.variety (80 % of the bank; synth's look
#   the rest), at every frame size the adapter gives real videos, curriculum from 8 pairs to
#   2048 pairs (32K visual tokens at 112 x 112), for MINUTES (default 8.8: the whole run, bank,
#   final eval and save included; python's start is ~10 s more). The checkpoint (hub layout)
#   comes back packed as $OUT/model.tar.gz (folder mminfer-embedded/ inside); the training
#   state (optimizer, 65 MB) stays on the device under /tmp.
# eval: unpacks the model if it is a .tar.gz, calibrates its head patterns with mass budgets
#   (gamma) on synth videos of three lengths and four tasks (seeds 900,000+: disjoint from
#   training's, its evaluation's [800,000, 801,000) and the quality benchmark's [500,000,
#   800,000); calibration uses synth, evaluation the held-out renderer render_eval, which
#   nothing here trains or calibrates on), then benchmarks/quality.py --renderer eval: dense vs
#   the calibrated config vs one generic density, with accuracy per task x length, density
#   per task, last-token KL to dense, markdown tables and the needle heatmap in $OUT. The
#   calibrated model comes back as $OUT/model_calibrated.tar.gz.
#
# eval knobs: CAL_FRAMES (calibration video lengths in frames, default "1024 2048 4096"),
#   CAL_REPS (videos per task and length, 1: --answer-kl needs more than one to transfer),
#   CAL_TIMEOUT (s, 230), QLENGTHS (quality lengths), RENDERER (eval | synth), BUDGET (s, 585),
#   MAX_DENSITY (calibrate --max-density: the mass candidates' ceiling, 0.3), QARGS_EVAL
#   (quality.py's arguments besides --lengths, default "--needle-reps 2 --per-task 6
#   --densities 0.2"), ALSO (other configs of the model measured on the same videos),
#   MAX_ERROR (calibrate's bound on a head's worst-input output error, 0.05), RESELECT (looser
#   bounds, e.g. "0.3 0.5": calibrate --reselect makes each one's config from the same
#   numbers and quality.py measures it too, dense + that config, into $OUT/quality_eval_<bound>;
#   the quality time is shared equally by the runs), SPREAD (calibrate --spread-queries:
#   estimation also reads this many queries spread over the sequence; 0, the default, the
#   last 64 only), GAMMAS (calibrate --gamma, default "0.8 0.9 0.95 0.99"), ANSWER_KL (then
#   calibrate against the answer on the same videos: calibrate --answer-kl, with
#   ANSWER_RUNGS (3) and ANSWER_MINUTES (4); the per-head config comes back as
#   mminfer_patterns.heads.json, the answer step's table as mminfer_patterns.answer.json).
# TINY=1 runs either stage as a CPU smoke test (minutes, tiny lengths, no GPU needed).
# Knobs (env): MINUTES, LR, START_PAIRS, VARIETY, SIZE_WEIGHT (six weights, one per
# variety.SIZES frame size, e.g. "2 4 1 1 1 1" to favour 4:3 video), GROW (train --grow FROM TO:
# the fractions of the run between which the longest video reaches 32K tokens; "0.05 0.3" with
# START_PAIRS=512 spends most of a fine-tune at 16K-32K), LED (train --led: a share of numbers
# drawn as LED-matrix cells, an experiment that un-holds-out render_eval's dot look), DEEPEN
# (train --deepen VISION TEXT: insert identity blocks into the INIT model, lab.toy.grow),
# SHARPEN (the weight of the attention tail-mass term, lab.toy.sharpen: sharper heads,
# sparse-friendly), INIT (train: a model folder or an earlier train stage's model.tar.gz, e.g.
# $OUT/model.tar.gz of an earlier call; default the shipped model); CAL_FRAMES
# (calibration video lengths in frames, default "1024 2048 4096"), CAL_TIMEOUT (s, 230), BUDGET
# (s of the call the eval stage plans for, 585) (eval).
set -uo pipefail
cd "$(dirname "$0")/../.."
STAGE=${1:-}
OUT=${OUT:-out/embedded}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/mminfer_embedded}; mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
TINY=${TINY:-0}
PY=${PYTHON:-python3}
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }

device_info() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no GPU"
    echo "cores $(nproc)"; git rev-parse HEAD 2>/dev/null || true
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  } 2>&1 | tee "$OUT/device.txt"
}

case "$STAGE" in
train)
  device_info
  if [ "$TINY" = 1 ]; then
    ARGS=(--minutes "${MINUTES:-0.6}" --max-tokens 128 --workers 0 --device cpu)
  else
    ARGS=(--minutes "${MINUTES:-8.8}" --reserve 45)
  fi
  rm -rf "$WORK/mminfer-embedded"
  INIT=${INIT:-mminfer/models/mminfer-embedded}
  if [ -f "$INIT" ]; then          # a model.tar.gz of an earlier train stage
    rm -rf "$WORK/init"; mkdir -p "$WORK/init"
    tar -xzf "$INIT" -C "$WORK/init" || exit 1
    INIT=$(dirname "$(ls "$WORK"/init/*/config.json | head -1)")
  fi
  echo "init: $INIT"
  timeout -s INT -k 15 "${TIMEOUT:-585}" $PY lab/train/train_embedded.py \
      --init "$INIT" --start-pairs "${START_PAIRS:-8}" \
      --lr "${LR:-1e-3}" --warmup 30 --variety "${VARIETY:-0.8}" \
      --out "$WORK/mminfer-embedded" --archive "$OUT/model.tar.gz" "${ARGS[@]}" \
      ${SIZE_WEIGHT:+--size-weight $SIZE_WEIGHT} ${SHARPEN:+--sharpen $SHARPEN} \
      ${LED:+--led $LED} ${DEEPEN:+--deepen $DEEPEN} \
      ${GROW:+--grow $GROW} \
      2>&1 | tee "$OUT/train.log"
  rc=${PIPESTATUS[0]}
  cp "$WORK/mminfer-embedded/embedded.json" "$OUT/" 2>/dev/null || true
  ls -la "$OUT"
  exit "$rc"
  ;;
eval)
  SRC=${2:?usage: run_embedded_h200.sh eval MODEL_DIR_OR_TAR}
  device_info
  if [ -f "$SRC" ]; then          # a model.tar.gz from the train stage
    rm -rf "$WORK/eval"; mkdir -p "$WORK/eval"
    tar -xzf "$SRC" -C "$WORK/eval" || exit 1
    MODEL=$(dirname "$(ls "$WORK"/eval/*/config.json | head -1)")
  else
    rm -rf "$WORK/eval"; mkdir -p "$WORK/eval"
    cp -r "$SRC" "$WORK/eval/mminfer-embedded"    # never write into the source folder
    MODEL=$WORK/eval/mminfer-embedded
  fi
  echo "model: $MODEL"
  RENDERER=${RENDERER:-eval}      # synth: the renderer the shipped model was trained on
  if [ "$TINY" = 1 ]; then
    VIDS=(synth:needle:64:900000 synth:count:64:900001 synth:order:96:900002)
    CAL=(--device cpu --budget 0.25 --gamma 0.9 --max-density 0.3 --max-error 0.05)
    QARGS=(--device cpu --lengths 256 512 --depths 0 1 --needle-reps 1 --per-task 1
           --densities 0.2 --max-minutes 2 --long-from 512)
    BUDGET=${BUDGET:-400}
  else
    # four tasks x 8K / 16K / 32K tokens (1024 / 2048 / 4096 frames at 224 x 224)
    VIDS=(); s=900000
    for n in ${CAL_FRAMES:-1024 2048 4096}; do
      for _ in $(seq "${CAL_REPS:-1}"); do
        for t in needle colour order count; do VIDS+=("synth:$t:$n:$s"); s=$((s + 1)); done
      done
    done
    CAL=(--device cuda --budget 0.1 0.25 --gamma 0.8 0.9 0.95 0.99 --max-density "${MAX_DENSITY:-0.3}"
         --max-error "${MAX_ERROR:-0.05}" --spread-queries "${SPREAD:-0}")
    if [ -n "${GAMMAS:-}" ]; then CAL+=(--gamma $GAMMAS); fi
    QARGS=(--lengths ${QLENGTHS:-1024 4096 8192 16384 32768} ${QARGS_EVAL:---needle-reps 2 --per-task 6
           --densities 0.2})
    BUDGET=${BUDGET:-585}
  fi
  if [ -n "${ANSWER_KL:-}" ]; then
    # per-head search, then the answer step on the same videos: OUT is the answer-bound config
    CAL+=(--answer-kl "$ANSWER_KL" --answer-rungs "${ANSWER_RUNGS:-3}"
          --answer-minutes "${ANSWER_MINUTES:-4}")
  fi
  rm -f "$MODEL"/mminfer_patterns*.json
  timeout -k 10 "${CAL_TIMEOUT:-230}" $PY -m mminfer calibrate --model "$MODEL" \
      --videos "${VIDS[@]}" "${CAL[@]}" --capture-dir "$WORK/captures" \
      --out "$MODEL/mminfer_patterns.json" 2>&1 | tee "$OUT/calibrate.log"
  if [ ! -f "$MODEL/mminfer_patterns.json" ]; then
    # keep the call useful: dense on render_eval is the first target; the sparse columns
    # then use the shipped model's config (say so in the tables' log)
    echo "CALIBRATION FAILED OR TIMED OUT: quality runs with the shipped config instead"
    cp mminfer/models/mminfer-embedded/mminfer_patterns.json "$MODEL/" || exit 1
  fi
  cp "$MODEL"/mminfer_patterns*.json "$OUT/" 2>/dev/null
  tar -czf "$OUT/model_calibrated.tar.gz" -C "$(dirname "$MODEL")" "$(basename "$MODEL")"
  # RESELECT="0.3 0.5": the same calibration's choice under looser bounds (calibrate
  # --reselect, nothing re-measured), each a model copy whose sparse answers are measured too
  RUNS=("$MODEL|quality_eval|${QARGS[*]}")
  for e in ${RESELECT:-}; do
    M_E=$WORK/eval_$e/$(basename "$MODEL"); rm -rf "$WORK/eval_$e"; mkdir -p "$WORK/eval_$e"
    cp -r "$MODEL" "$M_E"
    $PY -m mminfer calibrate --reselect "$MODEL/mminfer_patterns.json" --model "$MODEL" \
        --videos "${VIDS[0]}" --max-error "$e" --out "$M_E/mminfer_patterns.json" \
        2>&1 | tee "$OUT/reselect_$e.log" || continue
    cp "$M_E/mminfer_patterns.json" "$OUT/reselect_$e.json"
    # dense and this config only: dense is the reference the points are taken from
    RUNS+=("$M_E|quality_eval_$e|$(printf '%s ' "${QARGS[@]}" | sed 's/--densities[ 0-9.]*//') --densities")
  done
  # ALSO="a.json b.json": other configs of the same model (e.g. the shipped one), measured on
  # the same videos as the calibrated one: the side-by-side comparison in the same call
  for cfg in ${ALSO:-}; do
    NAME=also_$(basename "$cfg" .json)
    M_A=$WORK/$NAME/$(basename "$MODEL"); rm -rf "$WORK/$NAME"; mkdir -p "$WORK/$NAME"
    cp -r "$MODEL" "$M_A" && cp "$cfg" "$M_A/mminfer_patterns.json" || continue
    RUNS+=("$M_A|quality_$NAME|$(printf '%s ' "${QARGS[@]}" | sed 's/--densities[ 0-9.]*//') --densities")
  done
  # the rest of the call for the quality benchmark, shared by the runs (30 s kept for the
  # tables and the exit; SIGINT at the limit: it stops the video in flight and still writes them)
  Q_ALL=$(( $(left "$BUDGET") - 30 ))
  Q_S=$(( Q_ALL / ${#RUNS[@]} ))
  for run in "${RUNS[@]}"; do
    IFS='|' read -r M_R NAME ARGS_R <<< "$run"
    echo "quality ($NAME): $Q_S s"
    # shellcheck disable=SC2086  # ARGS_R is a word list
    timeout -s INT -k 15 $(( Q_S + 15 )) $PY benchmarks/quality.py --model "$M_R" \
        --renderer "$RENDERER" --out "$OUT/$NAME" --max-minutes "$(awk "BEGIN{print $Q_S / 60}")" \
        --markdown "$OUT/$NAME/tables.md" $ARGS_R 2>&1 | tee "$OUT/${NAME/quality_eval/quality}.log"
  done
  ;;
compare)
  # compare MODEL_DIR_OR_TAR CONFIG...: one quality.py run, dense and every head-pattern
  # config (mode cfg:<file stem>) on the same videos, each video rendered and through the
  # vision tower once; QLENGTHS, RENDERER, QARGS_EXTRA (default "--needle-reps 1
  # --per-task 3"), BUDGET.
  SRC=${2:?usage: run_embedded_h200.sh compare MODEL_DIR_OR_TAR CONFIG...}
  shift 2
  [ $# -ge 1 ] || { echo "compare needs at least one config" >&2; exit 2; }
  device_info
  rm -rf "$WORK/cmp"; mkdir -p "$WORK/cmp/base"
  if [ -f "$SRC" ]; then tar -xzf "$SRC" -C "$WORK/cmp/base" || exit 1
  else cp -r "$SRC" "$WORK/cmp/base/mminfer-embedded"; fi
  BASE=$(dirname "$(ls "$WORK"/cmp/base/*/config.json | head -1)")
  BUDGET=${BUDGET:-585}
  Q_S=$(( $(left "$BUDGET") - 20 ))
  echo "quality (dense and $*): $Q_S s"
  # shellcheck disable=SC2086  # word lists
  timeout -s INT -k 15 $(( Q_S + 15 )) $PY benchmarks/quality.py --model "$BASE" \
      --renderer "${RENDERER:-eval}" --out "$OUT/compare" --lengths ${QLENGTHS:-16384 32768} \
      ${QARGS_EXTRA:---needle-reps 1 --per-task 3} --densities --no-config --configs "$@" \
      --max-minutes "$(awk "BEGIN{print $Q_S / 60}")" --markdown "$OUT/compare/tables.md" \
      2>&1 | tee "$OUT/compare.log"
  ;;
*)
  echo "usage: $0 train | eval MODEL_DIR_OR_TAR | compare MODEL_DIR_OR_TAR CONFIG..." >&2
  exit 2
  ;;
esac
