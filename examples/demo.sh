#!/usr/bin/env bash
# The main job: set up .venv (first time only) and serve the demo workload on an embedded local
# Ray cluster with the built-in `tiny` model: 2 workers, pools small enough that requests are
# retracted into the object store and resumed, often on the other worker.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup
exec .venv/bin/raysched run --config examples/demo.yaml --workload examples/workload.yaml \
  --report demo-report.json "$@"
