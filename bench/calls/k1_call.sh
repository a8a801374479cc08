#!/usr/bin/env bash
# Engineer K1's H200 calls (decode speed, issue 13 item 4). STAGE=diag: bench/decode_kernels_h200.py (each decode
# kernel alone, the 48-layer graph per kernel form and launch kind, the LM head) and bench/diag_run_h200.py (the run
# in-process with phase timers). STAGE=final: decode_kernels_h200.py, tests/gpu, then bench/strata_run_h200.py all-cached, with the
# decode kernels of this change and of before (all_decode_baseline) in the same call.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
rc=0
if [[ "${STAGE:-diag}" == diag ]]; then
  timeout 200 python3 bench/decode_kernels_h200.py --out "$OUT" 2>&1 | tee "$OUT/decode_kernels.log" || rc=1
  timeout 90 python3 bench/diag_run_h200.py --out "$OUT" --decode 32 > "$OUT/diag_run.log" 2>&1 || rc=1
  grep -E "decode_step|decode_stack|_head|_embed|_decode_layers|decode_tokens" "$OUT/diag_run.log" | head -12
else
  timeout 90 python3 bench/decode_kernels_h200.py --out "$OUT" --reps 10 > "$OUT/decode_kernels.log" 2>&1 || rc=1
  tail -8 "$OUT/decode_kernels.log"
  timeout "${TEST_S:-240}" python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu > "$OUT/gpu_tests.log" 2>&1 || rc=1
  grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -20
  timeout "${RUN_S:-200}" python3 bench/strata_run_h200.py --out "$OUT" --settings all,all_decode_baseline --skip-peers \
    ${RUN_ARGS:-} > "$OUT/strata_run.log" 2>&1 || rc=1
  grep -E "^all|exit" "$OUT/strata_run.log" | cut -c1-400
fi
exit $rc
