# The SCD consumer service (CPU torch; the compose `gpu` profile builds it with CUDA torch).
# Build from the repository root:  docker build -f docker/consumer.Dockerfile -t scd-consumer .
# Stages: `deps` installs the pinned runtime dependencies (pyproject.toml [project].dependencies, no
# dev extras) into /opt/venv and generates the protobuf code with `make proto`; the final image has
# that venv, the service code, and a non-root user. Wheels in docker/wheelhouse/
# (docker/wheelhouse.sh) are installed with --no-index, so the build reaches no package index;
# without them pip uses the indexes (torch from TORCH_INDEX_URL: CPU wheels by default).
# BASE_IMAGE must provide python3 (3.11) with venv; `make compose-smoke` overrides it with a local
# Debian bookworm image (docker/base-image.sh) where no registry is reachable.
# docker/producer.Dockerfile has the same `deps` stage, so one build's layers serve both.
ARG BASE_IMAGE=python:3.11-slim

# The pins alone, so an edit elsewhere in pyproject.toml (tool settings) keeps the install layer cached.
FROM ${BASE_IMAGE} AS pins
WORKDIR /build
COPY pyproject.toml docker/requirements.py ./
RUN python3 requirements.py pyproject.toml > requirements.txt

FROM ${BASE_IMAGE} AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG USE_WHEELHOUSE=auto
WORKDIR /build
COPY docker/wheelhouse/ /wheels/
COPY --from=pins /build/requirements.txt ./
RUN python3 -m venv /opt/venv \
 && if [ "$USE_WHEELHOUSE" != no ] && ls /wheels/*.whl >/dev/null 2>&1; then \
        /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels -r requirements.txt; \
    else \
        /opt/venv/bin/pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' requirements.txt)" \
        && /opt/venv/bin/pip install --no-cache-dir -r requirements.txt; \
    fi \
 && /opt/venv/bin/pip uninstall -y -q pip \
 && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +
# Generated code comes from the one `make proto` target, run with this venv's Python.
COPY Makefile ./
COPY protos/ protos/
RUN (command -v make >/dev/null || (apt-get update -q && apt-get install -y -q --no-install-recommends make)) \
 && mkdir -p shared/pb && make proto PYTHON=/opt/venv/bin/python STAMP=

FROM ${BASE_IMAGE}
# The engine's paged decode-attention kernel (consumer/engine/paged_attention.py) is C++: g++ (Debian's)
# and Python's headers (python3-dev where the base has none: Debian's python3 ships without them,
# python:3.11-slim with them); ninja is the pinned wheel in the venv. They stay in the image so that a container on a
# CPU of another instruction set builds its own variant at start instead of falling back to SDPA.
RUN apt-get update -q \
 && pkgs=g++ \
 && if [ ! -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then pkgs="$pkgs python3-dev"; fi \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --user-group --home-dir /app --no-create-home --shell /usr/sbin/nologin scd \
 && mkdir -p /app /cache && chown scd:scd /cache
COPY --from=deps /opt/venv /opt/venv
WORKDIR /app
COPY shared/ shared/
COPY --from=deps /build/shared/pb/scd/ shared/pb/scd/
COPY consumer/ consumer/
# Built now, for the build machine's instruction set, into /app/.cache/kernels/<name>/ (owned by the
# service's user: each start re-checks the build there, and a CPU of another set builds its variant);
# the consumer loads it before it reports SERVING and names it in Describe.decode_attention (and, on a
# CPU with AVX-512 BF16, the bfloat16 prefill kernel beside it: Describe.prefill_attention).
RUN OMP_NUM_THREADS=1 /opt/venv/bin/python -m consumer.engine.build_kernels \
 && chown -R scd:scd /app/.cache
# Models: a builtin tiny name (built into /cache on first use), or a local checkpoint directory
# mounted into the container (compose mounts ./checkpoints and ./artifacts read-only under /app).
# The image never downloads weights: HF_HUB_OFFLINE.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/cache/hf \
    SCD_CACHE_DIR=/cache \
    SCD_CONSUMER_HOST=0.0.0.0 \
    SCD_CONSUMER_PORT=50052
USER 10001:10001
# What it serves: gRPC on 50052; with SCD_CONSUMER_HTTP_PORT=8000 (compose sets it) the OpenAI-compatible
# HTTP API on 8000; with SCD_CONSUMER_KV_EVENTS_ENDPOINT=tcp://*:5557 (and _REPLAY_ENDPOINT=tcp://*:5558)
# KV events in vLLM's format and their replay.
EXPOSE 50052 8000 5557 5558
HEALTHCHECK --interval=5s --timeout=4s --start-period=120s --retries=3 \
    CMD ["python", "-m", "shared.healthcheck", "127.0.0.1:50052"]
# exec form: SIGTERM reaches the server (PID 1), which turns NOT_SERVING and drains in-flight
# calls for SCD_CONSUMER_DRAIN_GRACE_S seconds; give the container a longer stop grace.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "consumer"]
