# syntax=docker/dockerfile:1
# tiergate image: one image runs every process, chosen by command:
#   docker run IMAGE gateway | worker | migrate | serve
#
#   docker build -t tiergate:0.1.0-cpu .                        # CPU (gateway, migrate, CPU workers)
#   docker build -t tiergate:0.1.0-cuda --build-arg VARIANT=cuda .   # CUDA workers
#
# The Helm chart relies on exactly this: `tiergate` on PATH, port 8000, user 10001, and a
# process that handles SIGTERM itself (it runs as PID 1, so nothing forwards signals).

# cpu or cuda: picks the base image below and the PyTorch wheel index.
ARG VARIANT=cpu

FROM python:3.12-slim-bookworm AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
# Triton compiles a small C launcher at first use, so the runtime needs a C compiler and the
# Python headers next to the interpreter.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

FROM base-${VARIANT} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Build stage: a virtual environment with torch and tiergate, copied whole into the runtime
# stage. Both stages share the base, so the venv's interpreter path stays valid.
FROM base AS build
ARG TORCH_VERSION=2.13.0
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the variant's index: `pip install .` then finds it satisfied instead of
# pulling the default wheel for the other variant.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway/ gateway/
COPY scheduler/ scheduler/
COPY engine/ engine/
COPY kernels/ kernels/
COPY migrations/ migrations/
RUN pip install . && tiergate --help > /dev/null

FROM base AS runtime
COPY --from=build /opt/venv /opt/venv
RUN groupadd --system --gid 10001 tiergate \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/tiergate --create-home tiergate
USER 10001:10001
WORKDIR /home/tiergate
ENV PATH=/opt/venv/bin:$PATH \
    TIERGATE_HOST=0.0.0.0 \
    TIERGATE_PORT=8000 \
    TIERGATE_DATA_DIR=/home/tiergate/data
EXPOSE 8000
STOPSIGNAL SIGTERM
ENTRYPOINT ["tiergate"]
CMD ["serve"]
