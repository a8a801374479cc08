#!/usr/bin/env bash
# 2026-12-04 second session, H200 call 3: the device-table path's GEMMs held to fewer registers a thread
# (DeviceGroupedGEMM.maxnreg) or given tiles that use fewer, so the next group's dequantization blocks fit on the SMs
# beside a GEMM program (call 2: at 255 registers the GEMM fills the register file, and a group's dequantization and
# the GEMMs before it took their sum); each variant beside the f16 layer with the same GEMMs. Files:
# quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=120 lane_gpu_tests 120 tests/gpu/test_device_gemm.py
timeout -k 10 300 python3 bench/quant_layer_h200.py --out "$OUT" --variants auto:classes:device \
  auto:classes:device:r192 auto:classes:device:r168 auto:classes:device:sbp:r192 \
  auto:classes:device:t128-64-64-8-4_128-64-64-8-4 auto:classes:device:t128-128-64-8-3_128-64-64-8-4:r192 \
  2>&1 | grep -v "^ " | grep -v "decode\|tiled\|KernelSet" | cut -c1-300 | tail -14 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
