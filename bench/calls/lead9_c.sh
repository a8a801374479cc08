#!/usr/bin/env bash
# The 2026-12-02 (fourth) session's third H200 call: the fixed-format dequantization kernel (strata_qf_dequant_sbt_*,
# now QuantMoE's default: call 2 measured it at 0.578 ms against sb's 0.719) and its Q4_K_M trial forms (sbt_u4: four
# super-blocks' loads in flight a warp; sbt_o8: 8 blocks an SM, 32 registers; sbt_u4o6: both, 40 registers), after
# Nsight Compute found sbt stalled on its loads 46% of the time at 54% occupancy. test_quant_warm.py first (every
# form bit for bit against the oracle on the GPU, each in the warm layer), and test_quant_cuda.py; then
# quant_layer_h200.py with the default and each trial form (host-synced), and the default on the device-table path.
# Files: gpu_tests.log, quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=110 lane_gpu_tests 110 tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 200 python3 bench/quant_layer_h200.py --out "$OUT" --reps 7 --variants auto:classes auto:classes:sbt_u4 \
  auto:classes:sbt_o8 auto:classes:sbt_u4o6 auto:classes:device 2>&1 | grep -v "^tiled\|^KernelSet" \
  | grep "HBM\|QuantMoE.*warm\|decode:" | cut -c1-330 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
