#!/usr/bin/env bash
# Engineer K2's last H200 call (issue 13 item 4, prefill under skew): all of tests/gpu, then bench/layer_h200.py (the
# default split_rows against whole groups, generator section skipped) and bench/strata_run_h200.py's half_skewed
# setting alone (no peers). Files in $OUT: gpu_tests.log, layer.log, layer_h200.json, run.log, strata_run_h200.json.
# Carry .whl and strata_core.egg-info (bench/cuda_lane.sh says why).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
rc=0
timeout "${TEST_S:-200}" python3 -m pytest -p no:cacheprovider -q -rfE ${TESTS:-tests/gpu} > "$OUT/gpu_tests.log" 2>&1 || rc=1
grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -15
timeout "${LAYER_S:-80}" python3 bench/layer_h200.py --out "$OUT" --skip generation --reps 15 \
  --variants "${VARIANTS:-classes:4,classes:4:0}" > "$OUT/layer.log" 2>&1 || rc=1
grep -E "warm|cold|FAILED" "$OUT/layer.log" | tail -12
timeout "${RUN_S:-100}" python3 bench/strata_run_h200.py --out "$OUT" --settings half_skewed --skip-peers \
  --decode "${DECODE:-128}" > "$OUT/run.log" 2>&1 || rc=1
tail -4 "$OUT/run.log"
exit $rc
