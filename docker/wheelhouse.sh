#!/usr/bin/env bash
# Fill docker/wheelhouse/ with wheels of the services' runtime pins (pyproject.toml
# [project].dependencies, CPU torch), built or downloaded on the host, so an image build installs
# with `pip install --no-index` and never reaches a package index itself.
#   docker/wheelhouse.sh [PIP]     (default PIP: .venv/bin/pip; the host's pip configuration applies)
# Wheels are for the host's Python and platform: build on a CPython 3.11 x86_64 glibc host (the
# images are Debian bookworm / python:3.11-slim). Without any wheel here the Dockerfiles install
# from the package indexes instead (CPU torch from download.pytorch.org).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${1:-.venv/bin/pip}
OUT=docker/wheelhouse
REQ=$(mktemp)
trap 'rm -f "$REQ"' EXIT
python3 docker/requirements.py --torch-local cpu > "$REQ"
mkdir -p "$OUT"
"$PIP" wheel -q --wheel-dir "$OUT" -r "$REQ"
echo "wheelhouse: $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1)" >&2
