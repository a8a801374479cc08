#!/usr/bin/env bash
# 2026-12-03 fourth session, H200 call 1: the Q8_0 decode pair's compiled variants (fast.Q8_DECODE_VARIANTS: the int8
# cast or the exact byte permute, gate/up's next row pair loaded before this one is summed). The kernel bench
# (bench/decode_q8_kernels_h200.py: the 48-layer stack and each kernel alone per variant, bits against the cast's,
# float64), the tests/gpu files over decode and the layer ops, then `strata run` at Qwen3-30B-A3B@Q8_0 with the
# default (prmt_pipe) and the cast's kernels (+q8=cast) in the same call, and the peers.
# Files: decode_q8_kernels_h200.json, gpu_tests.log, strata_run_h200_q8_0.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
timeout -k 10 200 python3 bench/decode_q8_kernels_h200.py --out "$OUT" || rc=1
echo "kernel bench done at $(( $(date +%s) - t0 )) s"
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_decode_forms.py tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 220 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 90 \
  --settings all,half_skewed,half_skewed+q8=cast,all+q8=cast,smallest 2>&1 | cut -c1-300 | grep -v transformers | tail -8 || rc=1
echo "strata run Q8_0 done at $(( $(date +%s) - t0 )) s"
exit $rc
