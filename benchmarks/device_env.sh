# Sourced by the device scripts from the repository root: the environment they run Python in,
# and the wheels carried in .whl (decord, PyAV: the GPU machine has neither, and without one
# the pipeline cannot decode a file) installed to /tmp/site and put on PYTHONPATH.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONPATH=$PWD
# site.tar.xz: the same packages unpacked and packed with xz (decord and PyAV together exceed
# the device tool's 64 MiB as wheels; see docs/development.md)
if [ -f .whl/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz || exit 1
  export PYTHONPATH=$PWD:/tmp/site
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
