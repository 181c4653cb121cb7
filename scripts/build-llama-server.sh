#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from the sources vendored in the llama-cpp-python sdist on PyPI (the
# only registry CI can reach) and caches the binary outside the checkout. Prints the binary's path on the
# last line of stdout. Idempotent: a cached binary is reused; two concurrent runs build once (flock).
#
#   scripts/build-llama-server.sh            # build if missing, print the path
#   scripts/build-llama-server.sh --path     # print where the binary would be (built or not)
#
# Environment: STREAMWARDEN_CACHE (default ~/.cache/streamwarden), LLAMA_CPP_PYTHON_VERSION, PYTHON, JOBS.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${STREAMWARDEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/streamwarden}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

# -DGGML_NATIVE=ON compiles for this CPU: key the cache by the CPU's feature flags so a cache carried to
# another machine is rebuilt instead of dying with SIGILL.
cpu_key() {
  { uname -m; grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true; } | sha256sum | cut -c1-12
}
DEST="$CACHE/llama-server-$VERSION-$(cpu_key)"
BIN="$DEST/llama-server"

if [ "${1:-}" = "--path" ]; then
  echo "$BIN"
  exit 0
fi
if [ -x "$BIN" ]; then
  echo "$BIN"
  exit 0
fi

log() { echo "build-llama-server: $*" >&2; }

need_tools() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v c++ >/dev/null 2>&1 || missing+=(g++)
  command -v make >/dev/null 2>&1 || missing+=(make)
  "$PYTHON" -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
  [ ${#missing[@]} -eq 0 ] && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    log "installing ${missing[*]} from apt"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    log "missing build tools: ${missing[*]} (install them, e.g. apt-get install ${missing[*]})"
    exit 1
  fi
}

mkdir -p "$CACHE"
exec 9>"$CACHE/.llama-server-build.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi
if [ -x "$BIN" ]; then  # another run built it while we waited for the lock
  echo "$BIN"
  exit 0
fi

need_tools
WORK="$(mktemp -d "$CACHE/.build-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
log "downloading the llama-cpp-python $VERSION sdist"
"$PYTHON" -m pip download --quiet --no-binary :all: --no-deps -d "$WORK" "llama-cpp-python==$VERSION" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
log "configuring llama.cpp in $SRC"
# Static ggml, this CPU, no network at build time (no prebuilt web UI download, no CURL/OpenSSL).
nice -n 10 cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_STATIC=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  >"$WORK/configure.log" 2>&1 || { tail -40 "$WORK/configure.log" >&2; exit 1; }
log "building llama-server with $JOBS jobs (7 to 10 minutes on 2 cores)"
nice -n 10 cmake --build "$WORK/build" --target llama-server -j "$JOBS" \
  >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; exit 1; }
mkdir -p "$DEST"
install -m 0755 "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
log "built $BIN in $(( $(date +%s) - start )) s"
echo "$BIN"
