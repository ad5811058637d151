# fragsearch: the service, and the one-shot preparation (extract, train, index) that compose runs first.
#   docker compose up --build                                                    (GPU host)
#   docker compose -f docker-compose.yml -f docker-compose.cpu.yml up --build    (no GPU)
# Build arguments:
#   VARIANT=gpu|cpu   gpu: PyPI's torch (CUDA build) and faiss-gpu; cpu: torch from TORCH_INDEX_URL
#                     (PyTorch's CPU-only wheels by default: no CUDA libraries in the image) and faiss-cpu
#   TORCH_INDEX_URL   extra index torch and torchvision come from ("" = the pip configuration's indexes)
#   STANZA_MODELS     true: fetch stanza's English models (only the processors the stanza parser uses)
#   UID / GID         owner of /artifacts inside the image (match the host user to bind-mount a folder)
# Every Python package is pinned by requirements.lock, the lock the project's venv installs too.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG VARIANT=gpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG FAISS_GPU=faiss-gpu==1.15.1
ARG STANZA_MODELS=true
ARG UID=10001
ARG GID=10001

# TOKENIZERS_PARALLELISM is a switch, not a secret
# hadolint ignore=DL3064
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    STANZA_RESOURCES_DIR=/opt/stanza_resources \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    FRAGSEARCH_HOST=0.0.0.0 \
    FRAGSEARCH_PORT=8000 \
    FRAGSEARCH_DEVICE=auto \
    FRAGSEARCH_DATA=/data \
    FRAGSEARCH_ARTIFACTS=/artifacts

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libglib2.0-0 libgomp1 ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /app
COPY requirements.lock .
# cpu: the lock without the CUDA libraries torch's CUDA build pulls in; gpu: faiss-gpu for faiss-cpu.
RUN if [ "$VARIANT" = cpu ]; then \
        grep -vE '^(nvidia-|cuda-|triton==)' requirements.lock > /tmp/requirements-image.txt; \
    elif [ "$VARIANT" = gpu ]; then \
        sed "s/^faiss-cpu==.*/$FAISS_GPU/" requirements.lock > /tmp/requirements-image.txt; \
    else echo "VARIANT must be gpu or cpu, not $VARIANT" >&2; exit 2; fi \
    && if [ "$VARIANT" = cpu ] && [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir --extra-index-url "$TORCH_INDEX_URL" \
            "$(grep '^torch==' requirements.lock)" "$(grep '^torchvision==' requirements.lock)"; fi \
    && pip install --no-cache-dir -r /tmp/requirements-image.txt \
    && rm /tmp/requirements-image.txt \
    && if [ "$STANZA_MODELS" = true ]; then \
        python -c "import stanza; stanza.download('en', model_dir='$STANZA_RESOURCES_DIR', processors='tokenize,pos,lemma,depparse')" \
        && chmod -R a+rX "$STANZA_RESOURCES_DIR"; fi

RUN groupadd --gid "$GID" fragsearch \
    && useradd --create-home --uid "$UID" --gid "$GID" fragsearch \
    && mkdir -p /data /artifacts \
    && chown fragsearch:fragsearch /artifacts
COPY --chown=fragsearch:fragsearch model ./model
COPY --chown=fragsearch:fragsearch index ./index
COPY --chown=fragsearch:fragsearch service ./service
COPY --chown=fragsearch:fragsearch training ./training

USER ${UID}:${GID}
EXPOSE 8000
VOLUME ["/artifacts"]
# healthy = ready: the model and indexes are loaded (GET /readyz answers 200). Shell form on purpose:
# podman 4.3 splits an exec-form health check on spaces.
# hadolint ignore=DL3025
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('FRAGSEARCH_PORT', '8000'), timeout=4)"
ENTRYPOINT ["tini", "--"]
CMD ["python", "-m", "service"]
