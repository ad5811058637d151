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
#   EXTRAS            the extras of pyproject.toml to add to the runtime, each from its own lock
#                     (requirements-<extra>.lock): milvus (FRAGSEARCH_INDEX_BACKEND=milvus), bulk (ray:
#                     python -m index.bulk --engine ray), stanza (the stanza parser), bench; "" by default:
#                     the image holds the runtime lock only (the FAISS backend, the spaCy parser)
#   STANZA_MODELS     true: fetch stanza's English models (the processors the stanza parser uses; needs
#                     EXTRAS to name stanza); the default parser is spaCy, shipped in a package, so this is
#                     off by default
#   UID / GID         the user the image runs as and owner of /artifacts (10001 by default): the data folder
#                     must be readable by it; match the host user to bind-mount a folder of your own
# Every other Python package is pinned by the locks compiled from pyproject.toml (`./run lock`), the ones
# the project's venv installs too; the image takes torch from PyTorch's index and, for gpu, faiss-gpu (the
# `gpu` extra) for faiss-cpu: see README, Docker.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG VARIANT=gpu
ARG TORCH_CUDA=cu126
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl
ARG EXTRAS=""
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
COPY pyproject.toml requirements.lock requirements-milvus.lock requirements-bulk.lock requirements-stanza.lock \
     requirements-bench.lock ./
# torch and torchvision first, from PyTorch's index for the variant (a +cu126 / +cpu build of the lock's
# version: the lock's `torch==` line is then already satisfied); then the runtime lock and the lock of each
# extra in EXTRAS (one pin per package: the locks agree), without PyPI torch's CUDA 13 libraries; gpu:
# the `gpu` extra's faiss-gpu for faiss-cpu, its CUDA 12 runtime the one torch pins. `pip check` and the
# CUDA line torch reports are verified before the layer is kept.
# hadolint ignore=DL3013
RUN torch_line="$(grep '^torch==' requirements.lock)" && vision_line="$(grep '^torchvision==' requirements.lock)" \
    && if [ "$VARIANT" = gpu ]; then flavour="$TORCH_CUDA"; \
       elif [ "$VARIANT" = cpu ]; then flavour=cpu; \
       else echo "VARIANT must be gpu or cpu, not $VARIANT" >&2; exit 2; fi \
    && locks=requirements.lock && for extra in $EXTRAS; do \
        if [ ! -f "requirements-$extra.lock" ]; then \
            echo "EXTRAS: no lock for '$extra' (milvus, bulk, stanza, bench)" >&2; exit 2; fi; \
        locks="$locks requirements-$extra.lock"; done \
    && if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir --extra-index-url "$TORCH_INDEX_URL/$flavour" \
            "$torch_line+$flavour" "$vision_line+$flavour"; \
       elif [ "$VARIANT" = gpu ]; then \
        echo "VARIANT=gpu needs torch built for CUDA 12 like faiss-gpu: TORCH_INDEX_URL must name PyTorch's index" >&2; \
        exit 2; fi \
    && if [ "$VARIANT" = gpu ]; then drop='^(nvidia-|cuda-|triton==|faiss-cpu==)'; \
        python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu'], sep='\n')" \
            > /tmp/requirements-gpu.txt; \
       else drop='^(nvidia-|cuda-|triton==)'; : > /tmp/requirements-gpu.txt; fi \
    && cat $locks | grep -E '^[A-Za-z0-9]' | grep -vE "$drop" | sort -u > /tmp/requirements-image.txt \
    && pip install --no-cache-dir -r /tmp/requirements-image.txt -r /tmp/requirements-gpu.txt \
    && rm /tmp/requirements-image.txt /tmp/requirements-gpu.txt \
    && pip check \
    && if [ "$VARIANT" = gpu ]; then \
        python -c "import sys, torch; cuda = torch.version.cuda or ''; print('torch', torch.__version__, 'CUDA', cuda); sys.exit(0 if cuda.startswith('12.') else 'torch is not a CUDA 12 build')"; fi

# Opt-in: stanza's English models (only the processors the stanza parser uses). stanza fetches them
# through huggingface_hub, so this step runs before the hubs are switched offline.
RUN if [ "$STANZA_MODELS" = true ]; then \
        { python -c "import stanza" || { echo "STANZA_MODELS=true needs EXTRAS to name stanza" >&2; exit 2; }; } \
        && python -c "import stanza; stanza.download('en', model_dir='$STANZA_RESOURCES_DIR', processors='tokenize,pos,lemma,depparse')" \
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
