#!/usr/bin/env bash
# For the H200 call after s17_a.sh (written 2026-12-04, fourth session, when no device was lent: never run yet): run
# it once quant_ffn's defaults take the fused path s17_a measured fastest (WARM_FUSED = True, FUSED_BLOCK_ROWS,
# FUSED_INPUT_ROWS), committed first, so the tests and the bench run the tree that states them. Every tests/gpu file
# in its own process (the product's warm Q4_K_M layers change), then the layer bench: the new default, the
# host-synced path it replaces ("host" keeps warm_device off and so warm_fused off), then the kernels alone. Files:
# gpu_tests.log, quant_layer_h200.json, quant_mma_h200.json, mma_bench.log, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
python3 -c "from strata_cuda import quant_ffn as q; print('defaults:', q.WARM_FUSED, q.FUSED_KERNEL, q.FUSED_BLOCK_ROWS, q.FUSED_INPUT_ROWS)"
TEST_S=150 lane_gpu_tests 150
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 200 python3 bench/quant_layer_h200.py --out "$OUT" --reps 7 --variants auto:classes auto:classes:host \
  2>&1 | grep "QuantMoE\|f16 FastMoE\|decode:\|Traceback\|Error" | grep -v "cold with" | cut -c1-200 | tail -12 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
timeout -k 10 120 python3 bench/quant_mma_h200.py --out "$OUT" --reps 10 > "$OUT/mma_bench.log" 2>&1 || rc=1
echo "mma bench done at $(( $(date +%s) - t0 )) s"
exit $rc
