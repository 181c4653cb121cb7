#!/bin/sh
# The project's virtualenv, on Python 3.11 or newer: made when missing, made again when its interpreter
# is older or broken (a first run with an old python3 leaves such a one behind). Usage: ensure-venv.sh PYTHON VENV
set -eu
python=$1
venv=$2
new_enough='import sys; sys.exit(sys.version_info < (3, 11))'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$new_enough" 2>/dev/null; then
  exit 0
fi
if ! "$python" -c "$new_enough" 2>/dev/null; then
  found=$("$python" -V 2>&1 || echo "not found")
  echo "streamwarden needs Python 3.11 or newer; $python is $found: run make with PYTHON=python3.12 (or another)" >&2
  exit 2
fi
if [ -e "$venv" ]; then
  echo "$venv: its Python is older than 3.11 or broken; making it again with $python" >&2
  rm -rf "$venv"
fi
"$python" -m venv "$venv"
