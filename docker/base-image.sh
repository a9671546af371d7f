#!/usr/bin/env bash
# A local stand-in for python:3.11-slim where no registry can be reached: Debian bookworm
# (Python 3.11) bootstrapped from the Debian mirror apt uses, imported as a Docker image.
#   docker/base-image.sh [TAG]      (default TAG: scd-base:bookworm; needs root and debootstrap)
# Skips the work when TAG exists. The image has python3, python3-venv and Debian's own CA bundle
# package; no host files (certificates, pip configuration) go into it.
set -euo pipefail
TAG=${1:-scd-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG exists" >&2
    exit 0
fi
ROOTFS=$(mktemp -d /tmp/scd-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$ROOTFS" "$MIRROR" >&2
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" --numeric-owner -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' \
    -c 'CMD ["/bin/bash"]' \
    - "$TAG" >&2
echo "base image $TAG built" >&2
