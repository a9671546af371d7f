# The SCD producer service. Build from the repository root:
#   docker build -f docker/producer.Dockerfile -t scd-producer .
# Configuration is by environment (SCD_PRODUCER_*; see `python -m producer --help`).
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# Dependencies first, so code edits do not reinstall torch.
COPY pyproject.toml Makefile README.md ./
COPY shared/__init__.py shared/__init__.py
RUN make install PY=python3
COPY . .
RUN make proto PY=python3

ENV SCD_PRODUCER_HOST=0.0.0.0 \
    SCD_PRODUCER_PORT=50051 \
    SCD_CACHE_DIR=/cache
EXPOSE 50051
HEALTHCHECK --interval=5s --timeout=4s --start-period=120s --retries=3 \
    CMD .venv/bin/python -m shared.healthcheck 127.0.0.1:50051
# exec form: SIGTERM reaches the server, which drains for SCD_PRODUCER_DRAIN_GRACE_S seconds.
ENTRYPOINT [".venv/bin/python", "-m", "producer"]
