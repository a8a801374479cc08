#!/usr/bin/env bash
# The lead's mid call of the 2026-12-01 late session: bench/link_trace_h200.py (copy rates of the prefill's copy
# patterns, then the half-skewed run traced: where the link idles). Carry .whl and strata_core.egg-info.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/lane.log") 2>&1
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_env
t0=$(date +%s)
timeout -k 10 "${TRACE_S:-200}" python3 bench/link_trace_h200.py --out "$OUT" 2>&1 | tail -5
echo "call took $(( $(date +%s) - t0 )) s"
