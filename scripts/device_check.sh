#!/usr/bin/env bash
# kvshard's GPU check on a machine with one NVIDIA GPU and PyTorch (>= 2.11) already installed:
# no downloads, a few minutes. Writes device_check.json (or $OUT/device_check.json when $OUT is set).
#   scripts/device_check.sh             # on the GPU
#   scripts/device_check.sh --dry-run   # everything on the CPU (Triton's interpreter): checks the script
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/device_check.py --out "${OUT:-.}/device_check.json" "$@"
