#!/usr/bin/env bash
# One device call on two H200s (kind nvidia-h200-x2), issue 15: the tensor-parallel GPU tests
# (NCCL), then benchmarks/tensor_parallel.py: the Qwen2.5-VL-7B shape at 512K tokens, TP=2
# against TP=1 in the same run (target: ratio <= 0.6), and the 72B shape at 128K tokens
# with TP=2 (random weights: prefill + greedy decode steps, peak memory per rank).
# Logs and JSON under $OUT. Carry .whl (PyAV/decord wheels) for the GPU test's video clip;
# without them that test is skipped and the benchmarks still run.
#   bash benchmarks/run_tp_h200x2.sh
# QWEN7B_ARGS / QWEN72B_ARGS replace the benchmarks' arguments; *_S their time limits (0: skip).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/tp}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONPATH=$PWD
# NVLink multicast stays off (KINDS.md: it can take the host's shared GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
if [ "${TESTS_S:-150}" -gt 0 ]; then
  timeout -k 5 "${TESTS_S:-150}" python3 -m pytest -q -ra -m gpu tests/engine/test_parallel_gpu.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -8
fi
if [ "${QWEN7B_S:-240}" -gt 0 ]; then
  timeout -k 10 "${QWEN7B_S:-240}" python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/tensor_parallel.py \
    ${QWEN7B_ARGS:---shape qwen7b --lengths 524288 --modes sparse --baseline} --out "$OUT" \
    2>&1 | tee "$OUT/qwen7b.log" | tail -6
fi
if [ "${QWEN72B_S:-180}" -gt 0 ]; then
  timeout -k 10 "${QWEN72B_S:-180}" python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/tensor_parallel.py \
    ${QWEN72B_ARGS:---shape qwen72b --lengths 131072 --modes sparse} --out "$OUT" \
    2>&1 | tee "$OUT/qwen72b.log" | tail -6
fi
