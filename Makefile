# `make test` bootstraps .venv (idempotent: the stamp file names the pyproject hash,
# so a second run only runs the tests) and runs the test suite on the CPU, with the
# Triton kernels under the interpreter.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup test test-gpu bench-kernels clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first, so that nothing pulls a CUDA build; no torchvision.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@rm -f $(VENV)/.installed-*
	@touch $@

test: $(STAMP)
	TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra

# On a CUDA machine: the same tests compiled for the GPU, bf16 included.
test-gpu:
	python3 -m pytest -q -ra tests/test_kernels.py tests/test_kernels_gpu.py

bench-kernels:
	python3 benchmarks/kernels.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
