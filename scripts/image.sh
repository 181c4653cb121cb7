#!/usr/bin/env bash
# `make image`: docker build -f deploy/Dockerfile, on the real base when it can be pulled, else on the
# project's TEST STAND-IN base (scripts/standin-base.sh: Debian bookworm's own packages, never a release
# base), and says which. Then it asks the image `streamwarden --version`: with COMPILED=1 (the default) in
# CI (CI=true), an image that does not run the compiled build fails here.
#   IMAGE=name  VERSION=tag  COMPILED=0|1  PYTHON_IMAGE=base (skips the choice)  STANDIN=1 (the stand-in
#   without trying the pull)
# `docker build --network host`: the build's RUN steps reach PyPI and Debian as the machine does.
set -euo pipefail
cd "$(dirname "$0")/.."
image="${IMAGE:-streamwarden}:${VERSION:?VERSION: the tag}"
compiled="${COMPILED:-1}"
docker=/usr/bin/docker
[ -x "$docker" ] || docker=docker
standin="${STANDIN_BASE:-streamwarden-standin-base:bookworm}"
real="$(sed -n 's/^ARG PYTHON_IMAGE=//p' deploy/Dockerfile)"
ci=false
case "${CI:-}" in 1|true|yes) ci=true ;; esac

base="${PYTHON_IMAGE:-}"
if [ -n "$base" ]; then
  echo "image: base $base (given as PYTHON_IMAGE)"
elif [ "${STANDIN:-0}" != 1 ] && { "$docker" image inspect "$real" >/dev/null 2>&1 || "$docker" pull -q "$real" >/dev/null 2>&1; }; then
  base="$real"
  echo "image: base $base (the real base)"
else
  echo "image: $real cannot be pulled: building on the TEST STAND-IN base $standin (scripts/standin-base.sh;"
  echo "image: Debian's python3, not a release base: push no image built on it)"
  bash scripts/standin-base.sh
  base="$standin"
fi
start=$(date +%s)
"$docker" build --network host -f deploy/Dockerfile \
  --build-arg PYTHON_IMAGE="$base" --build-arg COMPILED="$compiled" \
  --label "org.opencontainers.image.base.name=$base" -t "$image" .
took=$(( $(date +%s) - start ))
size="$("$docker" image inspect "$image" --format '{{.Size}}' | awk '{printf "%d MB", $1/1e6}')"
said="$("$docker" run --rm --network none --entrypoint streamwarden "$image" --version)"
echo "image: $image built in ${took}s, $size, on $base: $said"
if [ "$compiled" = 1 ] && [ "${said%(compiled: yes)}" = "$said" ]; then
  if [ "$ci" = true ]; then
    echo "image: COMPILED=1 but the image runs the pure package (the build's log above says why)" >&2
    exit 1
  fi
  echo "image: warning: COMPILED=1 but the image runs the pure package (the build's log above says why)" >&2
fi
