#!/usr/bin/env bash
# The 2026-12-02 (second) session's last H200 call: the quant device-table path with the side stream at high
# priority (quant_ffn.DEQUANT_PRIORITY) and the back-to-back test's pool of one format. tests/gpu files that run
# QuantMoE and the device-table path, then quant_layer_h200.py: the default (device-table, high priority), the side
# stream at default priority, the host-synced path, and groups of 16. Files: gpu_tests.log, quant_layer_h200.json,
# lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
lane_gpu_tests 150 tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py tests/gpu/test_quant_decode.py \
  tests/gpu/test_device_gemm.py tests/gpu/test_layer_ops.py
timeout -k 10 150 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 \
  --variants auto:classes auto:classes:lowprio auto:classes:host 16:classes 2>&1 | grep -v "^tiled\|^KernelSet" | tail -14 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
