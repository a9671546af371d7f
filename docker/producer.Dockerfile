# The SCD producer service (CPU torch). Build from the repository root:
#   docker build -f docker/producer.Dockerfile -t scd-producer .
# Stages: `deps` installs the pinned runtime dependencies (pyproject.toml [project].dependencies, no
# dev extras) into /opt/venv and generates the protobuf code with `make proto`; the final image has
# that venv, the service code, and a non-root user. Wheels in docker/wheelhouse/
# (docker/wheelhouse.sh) are installed with --no-index, so the build reaches no package index;
# without them pip uses the indexes (torch from TORCH_INDEX_URL: CPU wheels by default).
# BASE_IMAGE must provide python3 (3.11) with venv; `make compose-smoke` overrides it with a local
# Debian bookworm image (docker/base-image.sh) where no registry is reachable.
# docker/consumer.Dockerfile has the same `deps` stage, so one build's layers serve both.
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
RUN useradd --system --uid 10001 --user-group --home-dir /app --no-create-home --shell /usr/sbin/nologin scd \
 && mkdir -p /app /cache && chown scd:scd /cache
COPY --from=deps /opt/venv /opt/venv
WORKDIR /app
COPY shared/ shared/
COPY --from=deps /build/shared/pb/scd/ shared/pb/scd/
COPY producer/ producer/
# Models: a builtin tiny name (built into /cache on first use), or a local checkpoint directory
# mounted into the container (compose mounts ./checkpoints and ./artifacts read-only under /app).
# The image never downloads weights: HF_HUB_OFFLINE.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/cache/hf \
    SCD_CACHE_DIR=/cache \
    SCD_PRODUCER_HOST=0.0.0.0 \
    SCD_PRODUCER_PORT=50051
USER 10001:10001
# What it serves: gRPC on 50051; with SCD_PRODUCER_KV_EVENTS_ENDPOINT=tcp://*:5557 (and
# _REPLAY_ENDPOINT=tcp://*:5558) its chunk store's KV events in vLLM's format and their replay.
EXPOSE 50051 5557 5558
HEALTHCHECK --interval=5s --timeout=4s --start-period=120s --retries=3 \
    CMD ["python", "-m", "shared.healthcheck", "127.0.0.1:50051"]
# exec form: SIGTERM reaches the server (PID 1), which turns NOT_SERVING and drains in-flight
# calls for SCD_PRODUCER_DRAIN_GRACE_S seconds; give the container a longer stop grace.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "producer"]
