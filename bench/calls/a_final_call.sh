#!/usr/bin/env bash
# Engineer A's last device call: bench/cuda_lane.sh (tests/gpu, `strata run --backend cuda --check` twice,
# strata_run_h200.py --fidelity with the peers; the layer bench left out), then the in-process profile
# (bench/diag_run_h200.py) of the all-cached run for the next session. 8 files in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SKIP_LAYER=1 RUN_ARGS=--fidelity RUN_S=420 bash bench/cuda_lane.sh
rc=$?
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
timeout 120 python3 bench/diag_run_h200.py --out "$OUT" --decode 32 2>&1 | head -40
exit $rc
