#!/usr/bin/env bash
# 2026-12-04 third session, H200 call 5 (the final tree): q4_k quant bytes staged in shared memory by cp.async three
# steps ahead (call 4: the decode, not the MMAs, set the fused kernels' pace). quant_mma's GPU tests and two planted
# faults, the kernels alone with the ablations, then the quant prefill's GPU test files and the layer ops, then the
# layer bench with the default and the fused path. Files: gpu_tests.log, mma_bench.log, quant_mma_h200.json,
# quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=120 lane_gpu_tests 120 tests/gpu/test_quant_mma.py
timeout -k 10 150 python3 bench/quant_mma_h200.py --out "$OUT" --ablations > "$OUT/mma_bench.log" 2>&1 || rc=1
cut -c1-900 "$OUT/mma_bench.log" | head -1
echo "mma bench done at $(( $(date +%s) - t0 )) s"
lane_planted_faults backends/cuda/strata_cuda/quant_mma.cu tests/gpu/test_quant_mma.py \
  's/w0 \& 0xf0f0f0f0u, s.s1/w0 \& 0x0f0f0f0fu, s.s1/' \
  's/qm_cp16(dst + 16, b + 16 + 32 \* g, 16u);/qm_cp16(dst + 16, b + 16, 16u);/'
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py tests/gpu/test_layer_ops.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 240 python3 bench/quant_layer_h200.py --out "$OUT" --reps 7 --variants auto:classes auto:classes:fused \
  2>&1 | grep "QuantMoE\|f16 FastMoE\|Traceback\|Error" | grep -v "cold with" | cut -c1-200 | tail -12 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
