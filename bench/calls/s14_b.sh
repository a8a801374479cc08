#!/usr/bin/env bash
# 2026-12-04 session, H200 call 2, the final tree: the tests/gpu files `strata run`'s layer ops and decode loop go
# through, then `strata run` at Qwen3-30B-A3B@Q8_0 and @F16 (every setting, the peers): the committed
# strata_run_h200_q8_0.json and strata_run_h200.json. Files: gpu_tests.log, both result files, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=100 lane_gpu_tests 100 tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py tests/gpu/test_fast_paths.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 200 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 90 \
  --settings all,half_skewed,smallest 2>&1 | cut -c1-220 | grep -v transformers | tail -7 || rc=1
echo "strata run Q8_0 done at $(( $(date +%s) - t0 )) s"
timeout -k 10 180 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@F16 --timeout 90 \
  --settings all,half_skewed,smallest 2>&1 | cut -c1-220 | grep -v transformers | tail -6 || rc=1
echo "strata run F16 done at $(( $(date +%s) - t0 )) s"
exit $rc
