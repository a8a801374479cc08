#!/usr/bin/env bash
# Engineer Q's H200 call (issue 14 item 5, issue 12 item 1): the quant GPU tests (QUICK=1: tests/gpu/test_quant_cuda.py
# only; else all of tests/gpu) and bench/quant_layer_h200.py with VARIANTS, in one call. Files under $OUT:
# gpu_tests.log, quant_layer_h200.json, quant_layer.log. Carry .whl and strata_core.egg-info (bench/cuda_lane.sh).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
rc=0
tests=tests/gpu
[[ "${QUICK:-0}" == 1 ]] && tests=tests/gpu/test_quant_cuda.py
timeout "${TEST_S:-200}" python3 -m pytest -p no:cacheprovider -q -rfE $tests > "$OUT/gpu_tests.log" 2>&1 || rc=1
grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -20
timeout "${BENCH_S:-150}" python3 bench/quant_layer_h200.py --out "$OUT" --reps "${REPS:-7}" \
  --variants ${VARIANTS:-auto:classes 32:classes 8:classes 4:classes} 2>&1 | tee "$OUT/quant_layer.log" || rc=1
exit $rc
