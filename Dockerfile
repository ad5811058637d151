# fragsearch: the service, and the one-shot preparation (extract, train, index) that compose runs first.
#   docker compose up --build                                                    (GPU host)
#   docker compose -f docker-compose.yml -f docker-compose.cpu.yml up --build    (no GPU)
# Build arguments:
#   VARIANT=gpu|cpu   gpu: torch and torchvision built for CUDA (TORCH_CUDA, from PyTorch's index) and a faiss-gpu
#                     whose CUDA runtime they share; cpu: PyTorch's CPU-only wheels (no CUDA libraries) and faiss-cpu
#   TORCH_CUDA        the CUDA flavour of the gpu variant, one of two pairs (any other value stops the build at once):
#                     cu126  torch +cu126 and faiss-gpu (CUDA 12.6 runtime): NVIDIA driver >= 560.28, Volta to Hopper
#                            (compute capability 7.0-9.0: no Blackwell kernels in either)
#                     cu132  torch +cu132 and faiss-gpu-cuvs (CUDA 13.2 runtime): Turing to Blackwell (torch's sm_100 and
#                            sm_120 kernels; FAISS's GPU code from its sm_90 PTX), a CUDA 13 driver (>= 580)
#   TORCH_INDEX_URL   PyTorch's wheel index; the flavour's folder (/cu126, /cu132, /cpu) is appended and torch is
#                     installed from it alone (--index-url). "" (cpu only): torch from the pip configuration's
#                     indexes, i.e. PyPI's build of the lock's version
#   EXTRAS            the extras of pyproject.toml to add to the runtime, each from its own lock
#                     (requirements-<extra>.lock): milvus (FRAGSEARCH_INDEX_BACKEND=milvus), bulk (ray:
#                     python -m index.bulk --engine ray), stanza (the stanza parser), bench; "" by default:
#                     the image holds the runtime lock only (the FAISS backend, the spaCy parser)
#   INDEX_BACKEND     faiss (default) or milvus: milvus adds the milvus extra (pymilvus) whatever EXTRAS says;
#                     compose passes FRAGSEARCH_INDEX_BACKEND, so the Milvus profile gets an image that can use it
#   STANZA_MODELS     true: fetch stanza's English models (the processors the stanza parser uses; needs
#                     EXTRAS to name stanza); the default parser is spaCy, shipped in a package, so this is
#                     off by default
#   UID / GID         the user the image runs as and owner of /artifacts (10001 by default): the data folder
#                     must be readable by it; match the host user to bind-mount a folder of your own. A GID
#                     or UID the base image has already (GID 20, 50, 100, a system user) is used as it is;
#                     UID 0 is refused (the image does not run as root)
# Every other Python package is pinned by the locks compiled from pyproject.toml (`./run lock`), the ones
# the project's venv installs too; the image takes torch from PyTorch's index and, for gpu, a faiss-gpu (the
# `gpu` extra's release) for faiss-cpu: see docs/guide/docker.md.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG VARIANT=gpu
ARG TORCH_CUDA=cu126
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl
ARG EXTRAS=""
ARG INDEX_BACKEND=faiss
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
    FRAGSEARCH_HOST=0.0.0.0 \
    FRAGSEARCH_PORT=8000 \
    FRAGSEARCH_DEVICE=auto \
    FRAGSEARCH_DATA=/data \
    FRAGSEARCH_ARTIFACTS=/artifacts

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The build arguments, checked before anything is fetched: a combination that cannot build stops here with
# the reason. What the later steps need of them is kept in /etc/fragsearch-build.
RUN case "$VARIANT/$TORCH_CUDA" in \
        gpu/cu126) echo "flavour=cu126 faiss_gpu=faiss-gpu" ;; \
        gpu/cu132) echo "flavour=cu132 faiss_gpu=faiss-gpu-cuvs" ;; \
        gpu/*) echo "TORCH_CUDA=$TORCH_CUDA: no faiss-gpu shares a CUDA runtime with torch +$TORCH_CUDA; use cu126" \
                    "(Volta to Hopper) or cu132 (Turing to Blackwell: torch's sm_100/sm_120 kernels)" >&2; exit 2 ;; \
        cpu/*) echo "flavour=cpu faiss_gpu=" ;; \
        *) echo "VARIANT must be gpu or cpu, not $VARIANT" >&2; exit 2 ;; \
    esac > /etc/fragsearch-build \
    && case "$INDEX_BACKEND" in \
        faiss) ;; milvus) echo "backend_extra=milvus" >> /etc/fragsearch-build ;; \
        *) echo "INDEX_BACKEND must be faiss or milvus, not $INDEX_BACKEND" >&2; exit 2 ;; esac \
    && if [ "$UID" = 0 ]; then echo "UID=0: the image does not run as root; build with --build-arg UID=\$(id -u)" \
            "as a user other than root, or leave UID at 10001" >&2; exit 2; fi

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libglib2.0-0 libgomp1 ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /app
COPY pyproject.toml requirements.lock requirements-milvus.lock requirements-bulk.lock requirements-stanza.lock \
     requirements-bench.lock ./
# torch and torchvision first, from PyTorch's index alone for the variant (a +cu126 / +cu132 / +cpu build of
# the lock's version: the lock's `torch==` line is then already satisfied); then the runtime lock and the lock
# of each extra in EXTRAS (and milvus for INDEX_BACKEND=milvus; one pin per package: the locks agree), without
# PyPI torch's CUDA libraries; gpu: the faiss-gpu of the flavour for faiss-cpu, its CUDA runtime the one torch
# pins. `pip check` and the CUDA version torch reports are verified before the layer is kept.
# hadolint ignore=DL3013,SC1091
RUN torch_line="$(grep '^torch==' requirements.lock)" && vision_line="$(grep '^torchvision==' requirements.lock)" \
    && backend_extra="" && . /etc/fragsearch-build \
    && locks=requirements.lock && for extra in $EXTRAS $backend_extra; do \
        if [ ! -f "requirements-$extra.lock" ]; then \
            echo "EXTRAS: no lock for '$extra' (milvus, bulk, stanza, bench)" >&2; exit 2; fi; \
        locks="$locks requirements-$extra.lock"; done \
    && if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir --index-url "$TORCH_INDEX_URL/$flavour" \
            "$torch_line+$flavour" "$vision_line+$flavour"; \
       elif [ "$VARIANT" = gpu ]; then \
        echo "VARIANT=gpu needs torch built for the CUDA of its faiss-gpu: TORCH_INDEX_URL must name PyTorch's index" >&2; \
        exit 2; fi \
    && if [ "$VARIANT" = gpu ]; then drop='^(nvidia-|cuda-|triton==|faiss-cpu==)'; \
        python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu'], sep='\n')" \
            | sed "s/^faiss-gpu==/$faiss_gpu==/" > /tmp/requirements-gpu.txt; \
       else drop='^(nvidia-|cuda-|triton==)'; : > /tmp/requirements-gpu.txt; fi \
    && cat $locks | grep -E '^[A-Za-z0-9]' | grep -vE "$drop" | sort -u > /tmp/requirements-image.txt \
    && pip install --no-cache-dir -r /tmp/requirements-image.txt -r /tmp/requirements-gpu.txt \
    && rm /tmp/requirements-image.txt /tmp/requirements-gpu.txt \
    && pip check \
    && if [ "$VARIANT" = gpu ]; then want="${flavour:2:2}.${flavour:4}"; \
        python -c "import sys, torch; cuda = torch.version.cuda or ''; print('torch', torch.__version__, 'CUDA', cuda); sys.exit(0 if cuda == sys.argv[1] else f'torch is not a CUDA {sys.argv[1]} build')" "$want"; fi

# Opt-in: stanza's English models (only the processors the stanza parser uses). stanza fetches them
# through huggingface_hub, so this step runs before the hubs are switched offline.
RUN if [ "$STANZA_MODELS" = true ]; then \
        { python -c "import stanza" || { echo "STANZA_MODELS=true needs EXTRAS to name stanza" >&2; exit 2; }; } \
        && python -c "import stanza; stanza.download('en', model_dir='$STANZA_RESOURCES_DIR', processors='tokenize,pos,lemma,depparse')" \
        && chmod -R a+rX "$STANZA_RESOURCES_DIR"; fi

# From here on (and at run time) nothing is fetched from a model hub: MiniLM ships in a package.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# The image's user: a GID or UID the base image has already is used as it is (its group or account: 20,
# 50, 100, a system user; UID 0 was refused above).
RUN if group="$(getent group "$GID")"; then echo "GID $GID: the base image's group ${group%%:*}"; \
       else groupadd --gid "$GID" fragsearch; fi \
    && if account="$(getent passwd "$UID")"; then echo "UID $UID: the base image's user ${account%%:*}"; \
       else useradd --create-home --uid "$UID" --gid "$GID" fragsearch; fi
RUN mkdir -p /data /artifacts \
    && chown "$UID:$GID" /artifacts
COPY --chown=${UID}:${GID} model ./model
COPY --chown=${UID}:${GID} index ./index
COPY --chown=${UID}:${GID} service ./service
COPY --chown=${UID}:${GID} training ./training

USER ${UID}:${GID}
EXPOSE 8000
VOLUME ["/artifacts"]
# The service's: healthy = ready, the model and indexes are loaded (GET /readyz answers 200); compose gives
# `prepare` a check of its own. Shell form on purpose: podman 4.3 splits an exec-form health check on spaces.
# hadolint ignore=DL3025
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('FRAGSEARCH_PORT', '8000'), timeout=4)"
ENTRYPOINT ["tini", "--"]
CMD ["python", "-m", "service"]
