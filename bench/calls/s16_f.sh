#!/usr/bin/env bash
# 2026-12-04 third session, H200 call 6 (the final tree: call 4's kernels; call 5's shared-memory staging of the q4_k
# bytes is reverted, it slowed down by half and gate|up not at all). The quant prefill's GPU test files with the
# egg-info carried (call 5 lacked it: strata run found no cuda backend), the layer ops, the kernels alone, the layer
# bench with the default and the fused path. Files: gpu_tests.log, mma_bench.log, quant_mma_h200.json,
# quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_mma.py tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py \
  tests/gpu/test_layer_ops.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 120 python3 bench/quant_mma_h200.py --out "$OUT" > "$OUT/mma_bench.log" 2>&1 || rc=1
cut -c1-700 "$OUT/mma_bench.log" | head -1
timeout -k 10 240 python3 bench/quant_layer_h200.py --out "$OUT" --reps 7 --variants auto:classes auto:classes:fused \
  2>&1 | grep "QuantMoE\|f16 FastMoE\|Traceback\|Error" | grep -v "cold with" | cut -c1-200 | tail -12 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
