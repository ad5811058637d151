# fragsearch: the service, and the one-shot preparation (extract, train, index) that compose runs first.
#   docker compose up --build                                                    (GPU host)
#   docker compose -f docker-compose.yml -f docker-compose.cpu.yml up --build    (no GPU)
# Build arguments:
#   VARIANT=gpu|cpu   gpu: torch and torchvision built for CUDA 12 (TORCH_CUDA, from PyTorch's index) and faiss-gpu,
#                     whose CUDA 12 runtime they share; cpu: PyTorch's CPU-only wheels (no CUDA libraries)
#                     and faiss-cpu
#   TORCH_CUDA        the CUDA flavour of the gpu variant's torch: cu126 (CUDA 12.6: NVIDIA driver >= 560.28,
#                     Volta to Hopper, compute capability 7.0-9.0, the range faiss-gpu's kernels cover); cu128
#                     for Blackwell (driver >= 570.26). Any cu12x matches faiss-gpu (nvidia-*-cu12 >= 12.6, < 13)
#   TORCH_INDEX_URL   PyTorch's wheel index; the flavour's folder (/cu126, /cpu) is appended. "" (cpu only):
#                     torch from the pip configuration's indexes, i.e. PyPI's build of the lock's version
#   STANZA_MODELS     true: fetch stanza's English models (the processors the stanza parser uses); the
#                     default parser is spaCy, shipped in a package, so this is off by default
#   UID / GID         the user the image runs as and owner of /artifacts (10001 by default): the data folder
#                     must be readable by it; match the host user to bind-mount a folder of your own
# Every other Python package is pinned by requirements.lock, the lock the project's venv installs too; the
# image swaps its torch lines (and faiss-cpu for faiss-gpu on the GPU variant): see README, Docker.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG VARIANT=gpu
ARG TORCH_CUDA=cu126
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl
ARG FAISS_GPU=faiss-gpu==1.15.1
ARG STANZA_MODELS=false
ARG UID=10001
ARG GID=10001

# TOKENIZERS_PARALLELISM is a switch, not a secret. The model hubs are switched offline further down,
# after the one step that may fetch from one (stanza's models).
# hadolint ignore=DL3064
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
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
# torch and torchvision first, from PyTorch's index for the variant (a +cu126 / +cpu build of the lock's
# version: the lock's `torch==` line is then already satisfied); the lock without PyPI torch's CUDA 13
# libraries; gpu: faiss-gpu for faiss-cpu, its CUDA 12 runtime the one torch pins. `pip check` and the
# CUDA line torch reports are verified before the layer is kept. (The torch pins come from the lock.)
# hadolint ignore=DL3013
RUN torch_line="$(grep '^torch==' requirements.lock)" && vision_line="$(grep '^torchvision==' requirements.lock)" \
    && if [ "$VARIANT" = gpu ]; then flavour="$TORCH_CUDA"; \
       elif [ "$VARIANT" = cpu ]; then flavour=cpu; \
       else echo "VARIANT must be gpu or cpu, not $VARIANT" >&2; exit 2; fi \
    && if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir --extra-index-url "$TORCH_INDEX_URL/$flavour" \
            "$torch_line+$flavour" "$vision_line+$flavour"; \
       elif [ "$VARIANT" = gpu ]; then \
        echo "VARIANT=gpu needs torch built for CUDA 12 like faiss-gpu: TORCH_INDEX_URL must name PyTorch's index" >&2; \
        exit 2; fi \
    && grep -vE '^(nvidia-|cuda-|triton==)' requirements.lock \
        | if [ "$VARIANT" = gpu ]; then sed "s/^faiss-cpu==.*/$FAISS_GPU/"; else cat; fi > /tmp/requirements-image.txt \
    && pip install --no-cache-dir -r /tmp/requirements-image.txt \
    && rm /tmp/requirements-image.txt \
    && pip check \
    && if [ "$VARIANT" = gpu ]; then \
        python -c "import sys, torch; cuda = torch.version.cuda or ''; print('torch', torch.__version__, 'CUDA', cuda); sys.exit(0 if cuda.startswith('12.') else 'torch is not a CUDA 12 build')"; fi

# Opt-in: stanza's English models (only the processors the stanza parser uses). stanza fetches them
# through huggingface_hub, so this step runs before the hubs are switched offline.
RUN if [ "$STANZA_MODELS" = true ]; then \
        python -c "import stanza; stanza.download('en', model_dir='$STANZA_RESOURCES_DIR', processors='tokenize,pos,lemma,depparse')" \
        && chmod -R a+rX "$STANZA_RESOURCES_DIR"; fi

# From here on (and at run time) nothing is fetched from a model hub: MiniLM ships in a package.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

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
