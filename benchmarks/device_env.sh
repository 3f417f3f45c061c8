# Sourced by the device scripts from the repository root: the environment they run Python in,
# and the wheels carried in .whl (decord, PyAV: the GPU machine has neither, and without one
# the pipeline cannot decode a file) installed to /tmp/site and put on PYTHONPATH.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
