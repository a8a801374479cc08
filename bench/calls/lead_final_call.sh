#!/usr/bin/env bash
# The lead's final device call of the 2026-12-01 afternoon session, after every engineer's CUDA change landed:
# bench/cuda_lane.sh (tests/gpu, `strata run --backend cuda --check` twice on the tiny model, strata_run_h200.py with
# the three cache settings, the peers and --fidelity), then bench/quant_layer_h200.py (32-expert groups; SKIP_QUANT=1 leaves it out) and, with DIAG=1,
# bench/diag_run_h200.py (diag_run_h200.json in place of quant_layer_h200.json). 8 files in
# $OUT: gpu_tests.log, run_cuda_1.json, run_cuda_2.json, runs.err, strata_run_h200.json, fidelity_h200.json,
# quant_layer_h200.json, lane.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/lane.log") 2>&1
SKIP_LAYER=1 RUN_ARGS=--fidelity RUN_S=${RUN_S:-300} TEST_S=${TEST_S:-150} bash bench/cuda_lane.sh
rc=$?
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
if [[ "${SKIP_QUANT:-0}" != 1 ]]; then
  timeout "${QUANT_S:-70}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants 32:classes 2>&1 | tail -15 || rc=1
fi
if [[ "${DIAG:-0}" == 1 ]]; then  # the in-process profile of the all-cached run (engineer A's bench/diag_run_h200.py)
  timeout "${DIAG_S:-90}" python3 bench/diag_run_h200.py --out "$OUT" --decode 32 2>&1 | head -45 || rc=1
fi
exit $rc
