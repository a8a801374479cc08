#!/usr/bin/env bash
# 2026-12-03 third session, H200 call 4, the final code: call 3's two top-up tests corrected (the test model's cache
# had 20 empty slots, not the 4 the test emptied; the qwen3-shaped half case's chunk takes no loan, so nothing is
# topped up there), the tests/gpu files over the layer ops and the decode loop, then `strata run` at
# Qwen3-30B-A3B@Q8_0 and @F16 with every setting, the peers and half_skewed_no_top_up beside half_skewed (the
# committed result files). Files: gpu_tests.log, strata_run_h200_q8_0.json, strata_run_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=100 lane_gpu_tests 100 tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py
echo "tests done at $(( $(date +%s) - t0 )) s"
for m in Q8_0 F16; do
  timeout -k 10 170 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@$m --timeout 90 \
    --settings all,half_skewed,half_skewed_no_top_up,smallest 2>&1 | cut -c1-300 | grep -v transformers | tail -6 || rc=1
  echo "strata run $m done at $(( $(date +%s) - t0 )) s"
done
exit $rc
