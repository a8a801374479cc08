#!/usr/bin/env bash
# 2026-12-04 second session, H200 calls 1 and 2 (call 1 failed at resident_blocks: RawKernel has no .ptr): the staged dequantization kernel (quant_fast.cu strata_qf_dequant_sbp_*,
# DEQUANT_KERNEL "sbp") and the device-table path's first groups dequantized before the routing
# (quant_ffn.WARM_DEVICE_AHEAD): the GPU tests of the quant prefill, then the Q4_K_M layer bench with the host-synced
# and device-table paths, each dequantization kernel, ahead or not. Files: gpu_tests.log, quant_layer_h200.json,
# lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 240 python3 bench/quant_layer_h200.py --out "$OUT" --variants auto:classes auto:classes:sbp \
  auto:classes:device:noahead auto:classes:device auto:classes:device:sbp auto:classes:device:sbp:noahead \
  2>&1 | grep -v "^ " | cut -c1-400 | tail -14 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
