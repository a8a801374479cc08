#!/usr/bin/env bash
# The lead's third call of the 2026-12-01 late session: the GPU tests of the pull change (each file in its own
# process), then bench/link_trace_h200.py: copy rates, a small table's landing behind 600 MB of copies (memcpy vs
# pull), and the half-skewed run traced per variant (default: pull on, 2 groups ahead, hotter-only admissions;
# nopull; all groups at once; noguard). Carry .whl and strata_core.egg-info.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
lane_gpu_tests 120 ${TESTS:-tests/gpu/test_pull.py tests/gpu/test_prefetch.py tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py tests/gpu/test_fast_paths.py}
echo "tests took $(( $(date +%s) - t0 )) s"
timeout -k 10 "${TRACE_S:-300}" python3 bench/link_trace_h200.py --out "$OUT" --decode 128 --ahead "${AHEAD:-default,default:nopull,all,default:noguard}" 2>&1 | tail -8 || rc=1
echo "call took $(( $(date +%s) - t0 )) s"
exit $rc
