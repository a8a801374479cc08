#!/usr/bin/env bash
# 2026-12-04 second session, H200 call 5: calls 3-4 found no overlap of a group's dequantization with the GEMMs before
# it even with the GEMMs capped at 192 registers and the side stream at high priority. An SM holds one L1/shared split
# at a time, so the dequantization kernels (sbt: no shared memory) are here given the GEMMs' split (carveout 100%,
# flag c100) before their first launch. Files: quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
timeout -k 10 300 python3 bench/quant_layer_h200.py --out "$OUT" --variants auto:classes:device \
  auto:classes:device:r192:highprio:c100 auto:classes:device:sbp:r192:highprio:c100 auto:classes:device:r192:c100 \
  auto:classes:device:sbp:r192:highprio auto:classes:device:c100:highprio \
  2>&1 | grep -v "^ " | grep -v "decode\|tiled\|KernelSet" | cut -c1-300 | tail -14 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
