#!/usr/bin/env bash
# The 2026-12-02 (third) session's first H200 call: the fused quant launches (triton_moe.DeviceQuantGEMM, behind
# QuantMoE.warm_fused, off) run for the first time. tests/gpu files that run QuantMoE and the device-table path (the
# fused configs and the fused-decode test among them), two planted faults in triton_moe.py that the fused-decode test
# must catch (restored after), then quant_layer_h200.py: the default warm path against the fused one at several
# tiles (bench/results/triton_compile_report.json picked them: no or few spills). Files: gpu_tests.log,
# quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
lane_gpu_tests 150 tests/gpu/test_quant_warm.py tests/gpu/test_device_gemm.py
FUSED=tests/gpu/test_quant_warm.py::test_the_fused_decode_inside_the_gemms_matches_the_reference
lane_planted_faults backends/cuda/strata_cuda/triton_moe.py "$FUSED" \
  's/urow = wrow + N.to(tl.int64) \* row_bytes/urow = wrow + (N - BN).to(tl.int64) * row_bytes/' \
  's/f, slot_bytes, self._down_offset,/f, slot_bytes, 0,/'
timeout -k 10 240 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes auto:classes:fused \
  auto:classes:fused:q128x32x8x2+128x64x8x2 auto:classes:fused:q128x64x8x3+128x64x8x3 \
  auto:classes:fused:q128x32x8x3+128x32x8x3 auto:classes:fused:q64x64x4x2+64x64x4x2 2>&1 \
  | grep -v "^tiled\|^KernelSet" | tail -16 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
