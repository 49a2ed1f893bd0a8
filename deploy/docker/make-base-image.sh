#!/usr/bin/env bash
# A base image for deploy/docker/Dockerfile where no registry is reachable (docker pull fails): Debian bookworm
# (Python 3.11, as python:3.11-slim) from Debian's own mirror with debootstrap, imported with docker import.
#   deploy/docker/make-base-image.sh [IMAGE]        (default steploop/base:bookworm; needs root and debootstrap)
# Then build with BASE_IMAGE=steploop/base:bookworm (make images BASE_IMAGE=..., deploy/smoke.sh does this).
set -euo pipefail
image="${1:-steploop/base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
command -v debootstrap >/dev/null || { echo "needs debootstrap: apt-get install -y debootstrap" >&2; exit 1; }
root="$(mktemp -d /tmp/steploop-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$root" "$mirror"
# What a slim base leaves out too: docs, man pages, apt lists (the worker stage runs apt-get update itself).
rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/var/lib/apt/lists/* \
       "$root"/var/cache/apt/*.bin
tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$image"
echo "imported $image"
