# The SCD consumer service. Build from the repository root:
#   docker build -f docker/consumer.Dockerfile -t scd-consumer .
# Configuration is by environment (SCD_CONSUMER_*; see `python -m consumer --help`).
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# Dependencies first, so code edits do not reinstall torch.
COPY pyproject.toml Makefile README.md ./
COPY shared/__init__.py shared/__init__.py
RUN make install PY=python3
COPY . .
RUN make proto PY=python3

ENV SCD_CONSUMER_HOST=0.0.0.0 \
    SCD_CONSUMER_PORT=50052 \
    SCD_CACHE_DIR=/cache
EXPOSE 50052
HEALTHCHECK --interval=5s --timeout=4s --start-period=120s --retries=3 \
    CMD .venv/bin/python -m shared.healthcheck 127.0.0.1:50052
# exec form: SIGTERM reaches the server, which drains for SCD_CONSUMER_DRAIN_GRACE_S seconds.
ENTRYPOINT [".venv/bin/python", "-m", "consumer"]
