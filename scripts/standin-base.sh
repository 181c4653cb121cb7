#!/usr/bin/env bash
# A TEST STAND-IN for the image's base, never a release base: a Debian bookworm root made by debootstrap
# from Debian's own packages, imported into Docker as STANDIN_BASE (streamwarden-standin-base:bookworm).
# For machines that cannot pull python:3.12-slim from Docker Hub (CI here); `make image` uses it only
# when that pull fails, and says so. It differs from the real base: Debian's Python (3.11, not 3.12),
# python3-dev in it (the compiled build needs Python.h, which python:3.12-slim carries), and the
# machine's CA bundle, so that pip inside `docker build` trusts what the machine trusts.
# Idempotent: an existing STANDIN_BASE image is kept (STANDIN_REBUILD=1 makes it anew). Needs root and
# debootstrap (installed from apt when missing); about 2-4 minutes cold.
set -euo pipefail
name="${STANDIN_BASE:-streamwarden-standin-base:bookworm}"
docker=/usr/bin/docker
[ -x "$docker" ] || docker=docker
if [ "${STANDIN_REBUILD:-0}" != 1 ] && "$docker" image inspect "$name" >/dev/null 2>&1; then
  echo "standin-base: $name already there"
  exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
rootfs="$(mktemp -d /var/tmp/standin-base.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
echo "standin-base: debootstrap bookworm into $rootfs (a test stand-in, not a release base)"
debootstrap --variant=minbase \
  --include=python3,python3-venv,python3-dev,python-is-python3,ca-certificates \
  bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
# The machine's CA bundle: pip inside the build fails TLS verification here without it.
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
# What only installing needed: apt's downloaded packages and lists.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | "$docker" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "streamwarden test stand-in base (debootstrap bookworm), not a release base" - "$name" >/dev/null
echo "standin-base: imported $name ($("$docker" image inspect "$name" --format '{{.Size}}' | awk '{printf "%d MB", $1/1e6}'))"
