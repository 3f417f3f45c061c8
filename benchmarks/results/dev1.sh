set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/device.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/sparse tests/kernels 2>&1 | tail -15 | tee $OUT/gpu_tests.log
echo "== before (25423dc)"
(cd .before && PYTHONPATH=$PWD/.before timeout 100 python3 benchmarks/estimate.py --lengths 131072 1048576 --out $OUT/before 2>&1 | tail -3)
echo "== after"
timeout 120 python3 benchmarks/estimate.py --lengths 131072 1048576 --profile --out $OUT 2>&1 | grep -E "^N=|^ +[0-9]+ |torch ms" 
timeout 150 python3 benchmarks/prefill.py --model qwen --lengths 131072 --out $OUT 2>&1 | tail -8
