#!/usr/bin/env bash
# 2026-12-04 second session, H200 call 4: call 3's register cap (r192: the f16 layer kept its speed, 0.957 ms, but the
# quant layer's groups still took the sum of dequantization and GEMMs) with the dequantization's side stream at the
# device's greatest priority, so its blocks are dispatched into the room the capped GEMM programs leave. Files:
# quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
timeout -k 10 300 python3 bench/quant_layer_h200.py --out "$OUT" --variants auto:classes:device:highprio \
  auto:classes:device:r192:highprio auto:classes:device:r200:highprio auto:classes:device:sbp:r192:highprio \
  auto:classes:device:r224:highprio \
  2>&1 | grep -v "^ " | grep -v "decode\|tiled\|KernelSet" | cut -c1-300 | tail -14 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
