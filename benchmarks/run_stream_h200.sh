#!/usr/bin/env bash
# One device call per part of benchmarks/stream_ingest.py (issue 43, live video) on one H200.
# Checkpoints and videos under /tmp/mminfer_e2e (local disk, shared with run_e2e_h200.sh: a
# warm machine reuses them); stream_ingest.json, stream.log, server-realtime.log and
# device.txt come back in $OUT (default out/stream-PART). Carry .whl (decord and PyAV
# wheels, docs/development.md "Device runs" says how to fetch them): the pipeline decodes
# files and the script writes them with PyAV.
#
#   bash benchmarks/run_stream_h200.sh ingest     # targets 1-2, ~4-5 min (estimated)
# LongVILA-7B (random weights), the 4096-frame 640x360 video of e2e's longvila1m case
# (1,052,672 visual tokens): a one-shot sparse prefill, then the same video as a stream in
# one-minute pieces (120 frames, 30,840 rows each: 35 pieces), questions after 25, 50 and
# 100 % of them. Targets: the pieces' vision + prefill <= 1.3x the one-shot's; every TTFT
# <= 0.3 s. The stream's KV at the end: 60.4 GB bf16 (fits the default streams' budget,
# half the card; on an H100 add --kv-cache-dtype fp8). `--piece-lines 0.5`: the pieces take
# half of the config's vertical_slash line budgets (estimation.piece_lines; at full budgets
# they visit 1.74x the one-shot's tiles, lab/NOTES.md §19); a second OUT in the same warm
# machine's next call gives the two side by side.
#
#   bash benchmarks/run_stream_h200.sh realtime   # target 3, ~6-7 min (estimated)
# `mminfer serve` on 127.0.0.1 with Qwen2.5-VL-7B (random weights, max_position_embeddings
# 327,680), 8 streams of 560x420 frames at 2 fps: each takes 7 minutes of media unpaced (the
# head start: one-minute pieces), then 3 minutes paced in real time (4-second pieces, each
# sent when its media time has passed): per stream, the lag of each piece and whether it kept
# up. Target: >= 8 streams keep up over 10 minutes. --stream-kv-gb 100: 8 streams of 10
# minutes hold 82.6 GB of KV (bf16) beside the 16 GB of weights. One count per call; e.g.
#   bash benchmarks/run_stream_h200.sh realtime --streams 12 --kv-cache-dtype fp8
# (12 streams hold 124 GB bf16, 62 GB in FP8).
# Arguments after the part replace its defaults and go to stream_ingest.py as they are.
# E2E_COMMIT=<hash> names the commit in the report (the device's copy has no git history).
# DEADLINE (s, default 540): the script's --max-s (a part past it reports what it measured);
# TIMEOUT (default 585) stops it (it still writes the report) inside the tool's 600 s.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-ingest}
[ "$#" -gt 0 ] && shift
case "$part" in
  ingest) set -- --parts ingest "$@" ;;
  realtime)     # later arguments win: `--streams 12` replaces the 8
    set -- --parts realtime --streams 8 --head-start-minutes 7 --minutes 3 \
      --stream-kv-gb 100 "$@" ;;
  *) echo "usage: $0 ingest|realtime [stream_ingest.py arguments]"; exit 2 ;;
esac
OUT=${OUT:-out/stream-$part}; mkdir -p "$OUT"
source benchmarks/device_env.sh       # PYTHONPATH, the .whl wheels
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  echo "cores $(nproc)"; free -g | head -2; df -h /tmp | tail -1
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  python3 -c "import decord; print('decord', decord.__version__)" 2>&1 | tail -1
  python3 -c "import av; print('av', av.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/device.txt"
timeout -k 10 "${TIMEOUT:-585}" python3 benchmarks/stream_ingest.py --out "$OUT" \
  --max-s "${DEADLINE:-540}" "$@" 2>&1 | tee "$OUT/stream.log"
