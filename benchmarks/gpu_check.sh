#!/usr/bin/env bash
# CUDA checks in one go (parity, batch invariance, snapshot round trips, chunked prefill, engine
# speed vs transformers); see benchmarks/gpu_check.py. Needs a GPU; budget: 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec timeout 480 "$PY" -m benchmarks.gpu_check "$@"
