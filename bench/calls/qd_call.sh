#!/usr/bin/env bash
# Engineer QD's H200 call (issue 14 item 5, decode): the Q4_K_M layer's decode through quant_decode.cu (QuantMoE decode
# form 2) against the form before (1). tests/gpu/test_quant_decode.py (the new kernels, every type they take, both
# forms) and tests/gpu/test_quant_cuda.py (every 'gguf' path, decode included), then bench/quant_layer_h200.py (its
# decode section times form 2, the default, and form 1 in one process). Before the call, on the workstation:
# .qd_tree.txt = `git rev-parse --short HEAD` and `git status --short` (the device copy has no .git). Files under
# $OUT: tree.txt, gpu_decode_tests.log, gpu_quant_tests.log, quant_layer_h200.json, quant_layer.log. Carry .whl and
# strata_core.egg-info.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp .qd_tree.txt "$OUT/tree.txt" 2>/dev/null
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_env
rc=0; t0=$(date +%s)
timeout -k 5 "${DEC_S:-45}" python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu/test_quant_decode.py \
  > "$OUT/gpu_decode_tests.log" 2>&1 || rc=1
tail -3 "$OUT/gpu_decode_tests.log"; echo "decode tests took $(( $(date +%s) - t0 )) s"
timeout -k 5 "${TEST_S:-60}" python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu/test_quant_cuda.py \
  > "$OUT/gpu_quant_tests.log" 2>&1 || rc=1
tail -3 "$OUT/gpu_quant_tests.log"; echo "tests took $(( $(date +%s) - t0 )) s"
timeout -k 5 "${BENCH_S:-60}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes \
  2>&1 | tee "$OUT/quant_layer.log" || rc=1
echo "call took $(( $(date +%s) - t0 )) s"
exit $rc
