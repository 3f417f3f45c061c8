# `make test` bootstraps .venv (idempotent: the stamp file names the pyproject hash,
# so a second run only runs the tests) and runs the test suite on the CPU, with the
# Triton kernels under the interpreter.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

# The CPU set-up's versions (scripts/check_deps.py reads them from here).
TORCH_CPU       := 2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TRITON          := 3.6.0

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test system-deps test-gpu bench-kernels clean docker-check loadtest check-deps

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first, from PyTorch's CPU index, so that nothing pulls a CUDA
	# build (PyPI's Linux torch is the CUDA one); no torchvision. Then Triton for the kernel
	# interpreter, and the package (torch's own dependencies come with it, from PyPI). The
	# versions: pyproject.toml's "one torch story".
	$(PY) -m pip install -q --no-deps 'torch==$(TORCH_CPU)' --extra-index-url $(TORCH_CPU_INDEX)
	$(PY) -m pip install -q 'triton==$(TRITON)' -e '.[test]'
	@rm -f $(VENV)/.installed-*
	@touch $@

# The main job: the service on loopback with the embedded default model (mminfer/models/mminfer-embedded), or
# MODEL=<checkpoint dir or hub id>; ARGS passes any other server flag, e.g.
#   make run ARGS="--allowed-local-media-path $$PWD/samples/videos --max-upload-mb 64"
# (`.venv/bin/mminfer serve --help` lists them with their defaults).
MODEL ?=
ARGS  ?=
run: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} TRITON_INTERPRET=$${TRITON_INTERPRET:-1} \
	  $(VENV)/bin/mminfer serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

# Build the Docker image and answer the sample inside it (skips where no Docker engine runs).
docker-check:
	$(PY) -m pytest -q -ra tests/test_docker.py

# Headless Chromium for the report-page test (Debian): installed with apt-get, as root only,
# and said so; SKIP_SYSTEM_DEPS=1 (or not root, or no apt-get) skips it and the browser test.
system-deps:
	@command -v chromium >/dev/null 2>&1 || [ -n "$(SKIP_SYSTEM_DEPS)" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  echo "system-deps: installing chromium with apt-get (for the report-page browser test; SKIP_SYSTEM_DEPS=1 skips it)" && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); } \
	  || echo "system-deps: chromium not installed: the report-page browser test will be skipped"

# The pins resolve against the public index alone (no local wheels), CPU and CUDA set-ups.
check-deps:
	$(PYTHON) scripts/check_deps.py

test: $(STAMP) system-deps
	TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra

# On a CUDA machine: the same tests compiled for the GPU, bf16 included.
test-gpu:
	python3 -m pytest -q -ra -m gpu tests/kernels

# Slow uploads, slow headers, huge JSON bodies, a keyless flood, 50 uploads and 5 abandoned
# sparse requests against `mminfer serve` (loopback); its data folder is removed after.
loadtest: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) scripts/loadtest.py

bench-kernels:
	python3 benchmarks/kernels.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
