#!/usr/bin/env bash
# 2026-12-04 second session, H200 call 9, the final tree: the host-synced path the default again (calls 7-8 measured
# the device-table path no faster), the groups ahead on the device-table path, the spin test. The quant prefill's GPU
# test files and the layer ops, then the layer bench with the default and the device-table path. Files:
# gpu_tests.log, quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py tests/gpu/test_layer_ops.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 200 python3 bench/quant_layer_h200.py --out "$OUT" --variants auto:classes auto:classes:device \
  2>&1 | grep "QuantMoE\|f16 FastMoE\|decode:" | grep -v "cold with" | cut -c1-200 | tail -10 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
