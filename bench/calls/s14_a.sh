#!/usr/bin/env bash
# 2026-12-04 session, H200 call 1, at the head that holds Engine.close's wait (0f09c2d) and the Q8_0 fourth pair:
# every tests/gpu file in its own process (test_fidelity first), then test_decode_loop.py twice more (call 4 of
# s13 saw its F16 half case's second engine open onto an illegal access left by the first); then the F16 decode
# kernels at Qwen3-30B-A3B shape (form 6, the default: each kernel's bandwidth against the HBM copy ceiling).
# Files: gpu_tests.log, decode_kernels_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150
echo "tests done at $(( $(date +%s) - t0 )) s"
for i in 2 3; do
  TEST_S=100 lane_gpu_tests 100 tests/gpu/test_decode_loop.py
done
echo "decode_loop repeats done at $(( $(date +%s) - t0 )) s"
timeout -k 10 120 python3 bench/decode_kernels_h200.py --out "$OUT" --forms 6 --reps 20 2>&1 | tail -15 || rc=1
echo "kernel bench done at $(( $(date +%s) - t0 )) s"
exit $rc
