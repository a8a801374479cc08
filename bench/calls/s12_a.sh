#!/usr/bin/env bash
# 2026-12-03 third session, H200 call 1: record the half-skewed decode's routing (bench/decode_trace_h200.py) for
# Q8_0 and F16 at Qwen3-30B-A3B shape, so cache policies can be replayed on the host. Measurement only: no code of
# the runtime changed. Files: decode_trace_<dtype>.npz/.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
for m in Q8_0 F16; do
  timeout -k 10 150 python3 bench/decode_trace_h200.py --out "$OUT" --dtype $m 2>&1 | tail -3 | cut -c1-600 || rc=1
  echo "trace $m done at $(( $(date +%s) - t0 )) s"
done
exit $rc
