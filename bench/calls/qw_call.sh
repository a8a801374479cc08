#!/usr/bin/env bash
# Engineer QW's H200 call (issue 14 item 5: the Q4_K_M layer's warm prefill, target <= 1.5x f16, cold <= 1.10x the
# link floor): the GPU tests of the quant paths, bench/q2_diag_h200.py --qw (every warm variant in one process,
# interleaved rounds), then bench/quant_layer_h200.py --reps 5 --variants auto:classes on the tree's default.
# Before the call, on the workstation: bench/results/qw_h200/call_tree.txt = `git rev-parse HEAD` and
# `git status --short` (the device copy has no .git). Carry .whl and strata_core.egg-info. Files under $OUT:
# tree.txt, gpu_tests.log, qw_diag.json, qw_diag.log, qw_profile.txt, quant_layer_h200.json, quant_layer.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp bench/results/qw_h200/call_tree.txt "$OUT/tree.txt" 2>/dev/null
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_env
rc=0; t0=$(date +%s)
timeout -k 5 "${TEST_S:-70}" python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu/test_quant_cuda.py \
  tests/gpu/test_quant_warm.py > "$OUT/gpu_tests.log" 2>&1 || rc=1
tail -3 "$OUT/gpu_tests.log"; echo "tests took $(( $(date +%s) - t0 )) s"
if [[ "${SKIP_DIAG:-0}" != 1 ]]; then
  timeout -k 5 "${DIAG_S:-90}" python3 bench/q2_diag_h200.py --qw --out "$OUT" ${DIAG_ARGS:-} 2>&1 \
    | tee "$OUT/qw_diag.log" || rc=1
  mv "$OUT/q2_diag.json" "$OUT/qw_diag.json" 2>/dev/null; mv "$OUT/q2_profile.txt" "$OUT/qw_profile.txt" 2>/dev/null
  echo "diag done at $(( $(date +%s) - t0 )) s"
fi
timeout -k 5 "${BENCH_S:-75}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes \
  2>&1 | tee "$OUT/quant_layer.log" || rc=1
echo "call took $(( $(date +%s) - t0 )) s"
exit $rc
