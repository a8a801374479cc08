#!/usr/bin/env bash
# 2026-12-03 third session, H200 call 2: the half-skewed Q8_0 decode layer by layer with every layer's input residual
# kept (bench/decode_trace_h200.py --residuals), for a study of cross-layer routing lookahead at the real shape.
# Measurement only. Files: res/decode_{residuals,router}_Q8_0_{0,1}.npy (layer halves), res/decode_norm_Q8_0.npy, res/decode_trace_Q8_0.{npz,json}, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
timeout -k 10 300 python3 bench/decode_trace_h200.py --out "$OUT/res" --dtype Q8_0 --residuals 2>&1 | tail -3 \
  | cut -c1-400 || rc=1
echo "residual trace done at $(( $(date +%s) - t0 )) s"
exit $rc
