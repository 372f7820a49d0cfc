#!/usr/bin/env bash
# The whole GPU check (benchmarks/gpu_check.py): every check runs even when one fails, one line
# each (PASS/FAIL, name, seconds, key number), exit 1 if any failed (2: no GPU). Engine checks in
# one process, then the Ray checks and benches as child processes with their own time limits.
# Budget: 8 minutes on one GPU (GPU_CHECK_BUDGET_S, default 470 s, spread over the parts; the
# outer timeout is a last resort). With $OUT set, each part's log is written there.
# On the lent GPU machine: source .gpu/env.sh && bash benchmarks/gpu_check.sh (see
# /work/shared/NOTES.md "The GPU path").
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" -m benchmarks.gpu_check "$@"
rc=$?
[ "$rc" = 124 ] && echo "FAIL gpu_check: the whole run passed its time limit"
exit "$rc"
