# `make run` bootstraps .venv with the runtime alone and serves; `make test` adds the test
# extras (pytest, Ray) and runs the test suite on the CPU, with the Triton kernels under the
# interpreter. Both are idempotent: a stamp file per install names the pyproject hash, so a
# second run installs nothing, `make run` after `make test` installs nothing, and `make test`
# after `make run` adds only the test extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HASH   := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
STAMP      := $(VENV)/.installed-$(HASH)
STAMP_TEST := $(VENV)/.installed-test-$(HASH)

# The CPU set-up's versions (scripts/check_deps.py reads them from here).
TORCH_CPU       := 2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TRITON          := 3.6.0
# A machine with an NVIDIA GPU (its driver lists one) gets the Dockerfile's CUDA torch from
# PyPI instead, and its kernels compiled; GPU=1 or GPU= overrides the guess.
TORCH_CUDA      := 2.11.0
ifndef GPU
GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1)
endif

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test system-deps test-gpu bench-kernels clean docker-check loadtest check-deps

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first, from PyTorch's CPU index, so that nothing pulls a CUDA
	# build (PyPI's Linux torch is the CUDA one); no torchvision. Then Triton for the kernel
	# interpreter, and the package's runtime (torch's own dependencies come with it, from
	# PyPI). On a GPU machine torch's CUDA wheel, which brings its Triton. The versions:
	# pyproject.toml's "one torch story".
ifeq ($(GPU),1)
	$(PY) -m pip install -q 'torch==$(TORCH_CUDA)'
else
	$(PY) -m pip install -q --no-deps 'torch==$(TORCH_CPU)' --extra-index-url $(TORCH_CPU_INDEX)
endif
	$(PY) -m pip install -q 'triton==$(TRITON)' -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

# The test extras (pytest, Ray for `mminfer batch --ray` and `mminfer serve --ray`) on top
# of the runtime.
$(STAMP_TEST): $(STAMP)
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# The main job: the service on loopback with the embedded default model (mminfer/models/mminfer-embedded), or
# MODEL=<checkpoint dir or hub id>; ARGS passes any other server flag, e.g.
#   make run ARGS="--allowed-local-media-path $$PWD/samples/videos --max-upload-mb 64"
# (`.venv/bin/mminfer serve --help` lists them with their defaults). The embedded model is
# served offline (HF_HUB_OFFLINE=1); a MODEL is fetched from the hub unless the environment
# says HF_HUB_OFFLINE=1. Without a GPU the Triton kernels run under the interpreter (the
# only way they run on a CPU); on a GPU they are compiled, unless TRITON_INTERPRET=1 is set.
MODEL ?=
ARGS  ?=
run: $(STAMP)
	$(if $(MODEL),,HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1}) $(if $(GPU),,TRITON_INTERPRET=$${TRITON_INTERPRET:-1}) \
	  $(VENV)/bin/mminfer serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

# Build the Docker image and answer the sample inside it (skips where no Docker engine runs).
docker-check: $(STAMP_TEST)
	$(PY) -m pytest -q -ra tests/test_docker.py

# Headless Chromium for the report-page test and ffmpeg for the live-stream pull test (a
# sample served in real time over loopback) (Debian): installed with apt-get, as root only,
# and said so; SKIP_SYSTEM_DEPS=1 (or not root, or no apt-get) skips them and their tests.
system-deps:
	@command -v chromium >/dev/null 2>&1 || [ -n "$(SKIP_SYSTEM_DEPS)" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  echo "system-deps: installing chromium with apt-get (for the report-page browser test; SKIP_SYSTEM_DEPS=1 skips it)" && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); } \
	  || echo "system-deps: chromium not installed: the report-page browser test will be skipped"
	@command -v ffmpeg >/dev/null 2>&1 || [ -n "$(SKIP_SYSTEM_DEPS)" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  echo "system-deps: installing ffmpeg with apt-get (for the live-stream pull test; SKIP_SYSTEM_DEPS=1 skips it)" && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ffmpeg >/dev/null); } \
	  || echo "system-deps: ffmpeg not installed: the live-stream test with ffmpeg will be skipped"

# The pins resolve against the public index alone (no local wheels), CPU and CUDA set-ups.
check-deps:
	$(PYTHON) scripts/check_deps.py

test: $(STAMP_TEST) system-deps
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
