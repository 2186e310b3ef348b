# syntax=docker/dockerfile:1
# One image for all three specmesh services; the container command picks the service:
#
#   docker build -t specmesh:latest .
#   docker run --rm -p 50061:50061 specmesh:latest verify_service
#   docker run --rm specmesh:latest draft_service --verify-address verify:50061
#   docker run --rm -p 8000:8000 specmesh:latest gateway --verify verify:50061 --draft draft:50062
#
# (ENTRYPOINT is `python -m`, so the command is a module name plus its flags; every flag can also be
# set by a SPECMESH_VERIFY_* / SPECMESH_DRAFT_* / SPECMESH_GATEWAY_* environment variable.)
#
# CPU by default (torch's CPU wheel, about 1 GB smaller). CUDA variant, for the verify service on a GPU
# node (needs the NVIDIA driver and container toolkit on the host; the CUDA runtime comes with the
# torch wheel, so the slim base image is fine):
#
#   docker build -t specmesh:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Pick the cuXXX index that torch 2.13.0 is published for and your driver supports (the CUDA torch wheel
# brings its own triton; the CPU image has neither triton nor grpcio-tools: they are extras).
#
# The base is pinned by digest (the python:3.11-slim multi-platform index as docker-library/repo-info
# recorded it), so a rebuild cannot silently change the OS or Python underneath. BASE_IMAGE may be swapped
# for any Debian-based image with Python 3.11+ at /usr/local/bin/python and python's venv module (a mirror,
# or the debootstrap image scripts/container-test.sh builds where no registry is reachable).

ARG BASE_IMAGE=python:3.11-slim@sha256:90744cff8f32887f075c47d747a173ff333e9e98801667af93c357fa9f5e28ff

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, pinned, from the chosen index: resolving it from PyPI would pull the multi-GB CUDA build.
RUN pip install --upgrade pip && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# The dependencies first, in a layer of their own (the project's metadata without its code installs them;
# an empty README stands in for the real one, so that only a pyproject.toml change rebuilds this layer), then
# the code in a small layer. The installed torch (2.13.0+cpu / +cuXXX) satisfies the project's pin.
COPY pyproject.toml ./
RUN touch README.md && pip install . && pip uninstall -y specmesh
COPY README.md ./
COPY specmesh/ specmesh/
COPY draft_service/ draft_service/
COPY verify_service/ verify_service/
COPY gateway/ gateway/
RUN pip install --no-deps . \
 && python -c "import torch, specmesh, verify_service, draft_service, gateway; print(torch.__version__)"

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="specmesh" \
      org.opencontainers.image.description="LLM serving with distributed lossless speculative decoding (gateway, draft_service, verify_service)"
RUN groupadd --system --gid 10001 specmesh \
 && useradd --system --uid 10001 --gid specmesh --create-home --home-dir /home/specmesh specmesh
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# The demo checkpoints (with their tokenizers), baked in; mount another directory over them (or point
# *_MODEL_PATH / SPECMESH_GATEWAY_TOKENIZER_PATH elsewhere) to serve other models.
COPY --chown=specmesh:specmesh models/demo/ /app/models/demo/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/specmesh \
    SPECMESH_VERIFY_HOST=0.0.0.0 \
    SPECMESH_VERIFY_MODEL_PATH=/app/models/demo/target \
    SPECMESH_DRAFT_HOST=0.0.0.0 \
    SPECMESH_DRAFT_MODEL_PATH=/app/models/demo/draft \
    SPECMESH_GATEWAY_HOST=0.0.0.0 \
    SPECMESH_GATEWAY_TOKENIZER_PATH=/app/models/demo/target
USER 10001:10001
# verify gRPC, draft gRPC, gateway REST (and its /metrics), gateway gRPC, verify metrics, draft metrics
EXPOSE 50061 50062 8000 50070 9464 9465
# Whichever service the container runs: the healthcheck reads the command of PID 1 and probes that
# service's own port (gRPC health for verify / draft, GET /health for the gateway).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "specmesh.healthcheck", "--auto"]
ENTRYPOINT ["python", "-m"]
CMD ["gateway", "--help"]
