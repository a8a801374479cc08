#!/usr/bin/env bash
# The lead's second call of the 2026-12-01 late session: the GPU tests of the files this change touched (each in its
# own process), then bench/link_trace_h200.py: copy rates (cudaHostAlloc, registered default and huge pages) and the
# half-skewed run traced per variant (COPY_GROUPS_AHEAD default 2, all, 1, 3; decode admission without the
# hotter-only rule). Carry .whl and strata_core.egg-info.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
lane_gpu_tests 120 ${TESTS:-tests/gpu/test_prefetch.py tests/gpu/test_layer_ops.py tests/gpu/test_fast_split.py tests/gpu/test_decode_loop.py}
echo "tests took $(( $(date +%s) - t0 )) s"
timeout -k 10 "${TRACE_S:-300}" python3 bench/link_trace_h200.py --out "$OUT" --decode 128 --ahead "${AHEAD:-default,all,1,3,2:noguard}" 2>&1 | tail -8 || rc=1
echo "call took $(( $(date +%s) - t0 )) s"
exit $rc
