#!/usr/bin/env bash
# The 2026-12-03 session's first H200 call: moe_fast.cu's third-form gate/up kernels compute a layer's uncached
# experts first (route_block, STRATA_MISSES_FIRST). The tests/gpu files over the decode kernels first, then a planted
# fault (act written at the block's expert index, not its rank: the reordering must be caught), then
# decode_miss_order_h200.py (rank order against misses first, f16 and Q8_0), then `strata run` at
# Qwen3-30B-A3B@Q8_0 and @F16 with the peers.
# Files: gpu_tests.log, decode_miss_order_h200.json, strata_run_h200_q8_0.json, strata_run_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=110 lane_gpu_tests 110 tests/gpu/test_decode_forms.py tests/gpu/test_fast_paths.py tests/gpu/test_decode_loop.py \
  tests/gpu/test_quant_decode.py tests/gpu/test_layer_ops.py
echo "tests done at $(( $(date +%s) - t0 )) s"
lane_planted_faults backends/cuda/strata_cuda/moe_fast.cu tests/gpu/test_decode_forms.py::test_the_third_forms_match_float64_with_mapped_misses_and_repeat_their_bits \
  's/const int k = rb.rank, e = rb.e;/const int k = blockIdx.y, e = rb.e;/'
echo "planted fault done at $(( $(date +%s) - t0 )) s"
timeout -k 10 150 python3 bench/decode_miss_order_h200.py --out "$OUT" 2>&1 | tail -14 || rc=1
echo "miss order done at $(( $(date +%s) - t0 )) s"
timeout -k 10 150 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 100 2>&1 \
  | cut -c1-260 | grep -v transformers | tail -5 || rc=1
echo "strata run Q8_0 done at $(( $(date +%s) - t0 )) s"
timeout -k 10 150 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@F16 --timeout 100 2>&1 \
  | cut -c1-260 | grep -v transformers | tail -5 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
