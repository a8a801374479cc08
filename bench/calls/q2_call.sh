#!/usr/bin/env bash
# Engineer Q's diagnostic H200 call (q2, issue 14 item 5: the Q4_K_M layer's cold prefill at 1.655x the link floor):
# tests/gpu/test_quant_cuda.py, then bench/q2_diag_h200.py with 07691a1's strata_cuda beside the tree's. Before the
# call, on the workstation: .q2_old/strata_cuda_old/ = `git show 07691a1:backends/cuda/strata_cuda/<f>` for
# __init__.py fast.py quant_ffn.py grouping.py moe_fast.cu quant_fast.cu quants.cuh moe_quant.cu, with
# files("strata_cuda") renamed files("strata_cuda_old"); .q2_old/TREE.txt = `git rev-parse --short HEAD` and
# `git status --short` (the device copy has no .git). Files under $OUT: tree.txt, gpu_quant_tests.log, q2_diag.log,
# q2_diag.json, q2_profile.txt; with BENCH=1 also quant_layer_h200.json and quant_layer.log (the product's bench). Carry .whl and strata_core.egg-info.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp .q2_old/TREE.txt "$OUT/tree.txt" 2>/dev/null
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_env
rc=0; t0=$(date +%s)
timeout -k 5 "${TEST_S:-70}" python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu/test_quant_cuda.py \
  > "$OUT/gpu_quant_tests.log" 2>&1 || rc=1
tail -3 "$OUT/gpu_quant_tests.log"; echo "tests took $(( $(date +%s) - t0 )) s"
if [[ "${SKIP_DIAG:-0}" != 1 ]]; then
  timeout -k 5 "${DIAG_S:-110}" python3 bench/q2_diag_h200.py --out "$OUT" --old .q2_old ${DIAG_ARGS:-} 2>&1 | tee "$OUT/q2_diag.log" || rc=1
fi
if [[ "${BENCH:-0}" == 1 ]]; then
  timeout -k 5 "${BENCH_S:-60}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants 32:classes \
    2>&1 | tee "$OUT/quant_layer.log" || rc=1
fi
echo "call took $(( $(date +%s) - t0 )) s"
exit $rc
