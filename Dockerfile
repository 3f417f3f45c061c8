# mminfer service: CUDA runtime base, Python 3.11, the package with the CUDA build of torch.
#
#   docker build -t mminfer .
#   docker run --gpus all -p 8000:8000 -v mminfer-data:/app/mminfer-data mminfer
#   docker run --gpus all -p 8000:8000 -e MMINFER_API_KEY=... -v /models:/models mminfer \
#       --model /models/Qwen2.5-VL-7B-Instruct
#   make docker-check      # build, then answer the sample inside (sparse), skipped without Docker
#
# torch 2.11.0 (pyproject.toml's "one torch story"): its CUDA wheel requires triton 3.6.0,
# the Triton the kernels were validated with, and it is what the H200 machine runs
# (scripts/check_deps.py resolves this set against PyPI). The wheel brings its own CUDA 13
# libraries; the host driver must support CUDA 13 (R580 or newer).
FROM nvidia/cuda:13.0.0-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/app/hf-cache

# gcc (with libc6-dev): Triton compiles its small C launcher with it at the first sparse
# kernel launch; without a compiler the sparse path fails inside the container.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && echo 'int main(void) { return 0; }' | gcc -x c - -o /tmp/cc-check && rm /tmp/cc-check

# uv fetches a standalone CPython 3.11 (Ubuntu 22.04 ships 3.10).
COPY --from=ghcr.io/astral-sh/uv:0.8.22 /uv /usr/local/bin/uv
RUN uv venv --python 3.11 /opt/venv

WORKDIR /app
# The heavy layer first, so code changes do not reinstall it.
RUN uv pip install torch==2.11.0

COPY pyproject.toml README.md* ./
COPY mminfer mminfer
COPY samples samples
# A plain install: configs and the embedded default model are package data.
RUN uv pip install . && rm -rf mminfer

RUN useradd --create-home --uid 1000 mminfer \
    && mkdir -p /app/mminfer-data /app/hf-cache \
    && chown mminfer /app/mminfer-data /app/hf-cache
USER mminfer

EXPOSE 8000
# Loading a 7B model takes a while: the start period keeps an early probe from failing it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)" || exit 1

# With no --model, the embedded default model (package data) is served.
ENTRYPOINT ["mminfer", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/app/mminfer-data"]
