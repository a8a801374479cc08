#!/usr/bin/env bash
# 2026-12-04 second session, H200 call 6: the warm Q4_K_M layer's candidates once more, each also timed as 8 layer calls
# back to back (the *_stack figures: the host queues a layer while the device runs the one before, as a model's layers
# run), beside the f16 layer timed both ways. Files: quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
timeout -k 10 300 python3 bench/quant_layer_h200.py --out "$OUT" --variants auto:classes auto:classes:device:noahead \
  auto:classes:device auto:classes:device:sbp auto:classes:device:sbp:r192:highprio auto:classes:device:r192:highprio \
  2>&1 | grep -v "^ " | grep -v "decode\|tiled\|KernelSet\|cold with" | cut -c1-200 | tail -16 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
