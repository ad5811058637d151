# fragsearch: the service, and the one-shot preparation (extract, index) that compose runs first. The runtime only:
# NumPy, ONNX Runtime (MiniLM and the int8 image backbone as graphs, shipped in model/released/ with the model in
# its runtime form), spaCy and FAISS. No torch, torchvision, triton, transformers, sentence-transformers,
# scikit-learn or onnx: the trainer (pyproject's `train` extra) is not in either image.
#   docker compose up --build                                                    (GPU host)
#   docker compose -f docker-compose.yml -f docker-compose.cpu.yml up --build    (no GPU)
# Build arguments:
#   VARIANT=gpu|cpu   cpu: the runtime lock as it is (onnxruntime, faiss-cpu). gpu: the same runtime with the `gpu`
#                     extra of pyproject.toml for the lock's onnxruntime and faiss-cpu lines: onnxruntime-gpu (the
#                     lock's onnxruntime release), faiss-gpu-cuvs (the lock's faiss-cpu release) and the CUDA 13
#                     libraries both load (PyPI's nvidia-* wheels: onnxruntime-gpu's extras cuda and cudnn,
#                     faiss-gpu-cuvs's requirements), every one pinned there.
#                     One CUDA flavour, CUDA 13: PyPI's onnxruntime-gpu 1.31.1 is a CUDA 13.0 build (its CUDA
#                     provider links libcudart.so.13 and libcublas.so.13; its `cuda` extra asks for
#                     nvidia-cuda-runtime~=13.0) and PyPI has no CUDA 12 build of it, so the FAISS that shares
#                     its runtime is faiss-gpu-cuvs (nvidia-cuda-runtime >=13.2,<14), not faiss-gpu (a CUDA 12
#                     build). Needs an NVIDIA driver >= 580 (docs/guide/docker.md has the GPUs it covers).
#   EXTRAS            the extras of pyproject.toml to add to the runtime, each from its own lock
#                     (requirements-<extra>.lock): milvus (FRAGSEARCH_INDEX_BACKEND=milvus), bulk (ray:
#                     python -m fragsearch.index.bulk --engine ray), stanza (the stanza parser: stanza runs on torch, which
#                     its lock pins with torch's CUDA libraries; cpu variant only, since that torch pins the CUDA
#                     13.0 runtime and faiss-gpu-cuvs needs 13.2), bench; "" by default: the runtime lock only (the
#                     FAISS backend, the spaCy parser)
#   INDEX_BACKEND     faiss (default) or milvus: milvus adds the milvus extra (pymilvus) whatever EXTRAS says;
#                     compose passes FRAGSEARCH_INDEX_BACKEND, so the Milvus profile gets an image that can use it
#   STANZA_MODELS     true: fetch stanza's English models (the processors the stanza parser uses; needs
#                     EXTRAS to name stanza); the default parser is spaCy, shipped in a package, so this is
#                     off by default
#   UID / GID         the user the image runs as and owner of /artifacts (10001 by default): the data folder
#                     must be readable by it; match the host user to bind-mount a folder of your own. A GID
#                     or UID the base image has already (GID 20, 50, 100, a system user) is used as it is;
#                     UID 0 is refused (the image does not run as root)
# Every Python package is pinned by the locks compiled from pyproject.toml (`./run lock`), the ones the project's
# venv installs too, or (gpu) by the `gpu` extra; all are installed with --no-deps, as ./run installs the locks
# (the MiniLM file package's declared dependencies would pull torch). tools/image_check.py checks the result
# before the image is kept: see docs/guide/docker.md.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG VARIANT=gpu
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
RUN case "$VARIANT" in \
        gpu|cpu) echo "variant=$VARIANT" ;; \
        *) echo "VARIANT must be gpu or cpu, not $VARIANT" >&2; exit 2 ;; \
    esac > /etc/fragsearch-build \
    && case "$INDEX_BACKEND" in \
        faiss) ;; milvus) echo "backend_extra=milvus" >> /etc/fragsearch-build ;; \
        *) echo "INDEX_BACKEND must be faiss or milvus, not $INDEX_BACKEND" >&2; exit 2 ;; esac \
    && for extra in $EXTRAS; do case "$extra" in \
        milvus|bulk|bench) ;; \
        stanza) if [ "$VARIANT" = gpu ]; then echo "EXTRAS=stanza with VARIANT=gpu: stanza's torch (its lock's, PyPI's)" \
                    "pins the CUDA 13.0 runtime and faiss-gpu-cuvs needs 13.2 or later; build the stanza parser into" \
                    "VARIANT=cpu" >&2; exit 2; fi ;; \
        *) echo "EXTRAS: no lock for '$extra' (milvus, bulk, stanza, bench)" >&2; exit 2 ;; esac; done \
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
# The runtime lock and the lock of each extra in EXTRAS (and milvus for INDEX_BACKEND=milvus; one pin per package:
# the locks agree), as they are, with --no-deps; gpu: the lines of onnxruntime and faiss-cpu replaced by the `gpu`
# extra's pins, and the folders of its CUDA libraries given to the dynamic loader (ONNX Runtime's CUDA provider
# links them by name; the NVIDIA Container Toolkit adds the driver's libcuda.so.1 when a container starts).
# The locks installed are kept in /etc/fragsearch-locks for the check below.
# hadolint ignore=SC1091,SC2086
RUN backend_extra="" && . /etc/fragsearch-build \
    && locks=requirements.lock && for extra in $EXTRAS $backend_extra; do \
        locks="$locks requirements-$extra.lock"; done \
    && if [ "$VARIANT" = gpu ]; then drop='^(onnxruntime|faiss-cpu)=='; \
        python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu'], sep='\n')" \
            > /tmp/requirements-gpu.txt; \
       else drop='^#'; : > /tmp/requirements-gpu.txt; fi \
    && cat $locks | grep -E '^[A-Za-z0-9]' | grep -vE "$drop" | sort -u > /tmp/requirements-image.txt \
    && pip install --no-cache-dir --no-deps -r /tmp/requirements-image.txt -r /tmp/requirements-gpu.txt \
    && rm /tmp/requirements-image.txt /tmp/requirements-gpu.txt \
    && printf '%s\n' $locks > /etc/fragsearch-locks \
    && if [ "$VARIANT" = gpu ]; then \
        site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        && printf '%s\n' "$site/nvidia/cu13/lib" "$site/nvidia/cudnn/lib" "$site/nvidia/nccl/lib" \
            > /etc/ld.so.conf.d/fragsearch-cuda.conf \
        && ldconfig; fi

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
# fragsearch/ is the one importable name: fragsearch.model, .index and .service are its links to the folders below
COPY --chown=${UID}:${GID} fragsearch ./fragsearch
COPY --chown=${UID}:${GID} model ./model
COPY --chown=${UID}:${GID} index ./index
COPY --chown=${UID}:${GID} service ./service
COPY tools/image_check.py ./tools/

# What the build installed, checked before the image is kept (tools/image_check.py): exactly the pins of the
# locks above (gpu: with the `gpu` extra's), nothing of the training stack (torch only as the stanza extra's
# dependency), every installed package's requirements met but the file packages' (what `pip check` cannot skip),
# the service importable, ONNX Runtime's providers (gpu: CUDAExecutionProvider, its CUDA libraries and cuDNN
# found by the loader; faiss a GPU build), and the released model answering one picture and one sentence on the
# CPU (the build has no GPU). Its artifacts go to a folder of its own, not the volume's.
RUN FRAGSEARCH_ARTIFACTS=/tmp/image-check xargs python -m tools.image_check --variant "$VARIANT" --locks \
        < /etc/fragsearch-locks \
    && rm -rf /tmp/image-check

USER ${UID}:${GID}
EXPOSE 8000
VOLUME ["/artifacts"]
# The service's: healthy = ready, the model and indexes are loaded (GET /readyz answers 200); compose gives
# `prepare` a check of its own. Shell form on purpose: podman 4.3 splits an exec-form health check on spaces.
# hadolint ignore=DL3025
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('FRAGSEARCH_PORT', '8000'), timeout=4)"
ENTRYPOINT ["tini", "--"]
CMD ["python", "-m", "fragsearch.service"]
