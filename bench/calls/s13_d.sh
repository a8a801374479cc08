#!/usr/bin/env bash
# 2026-12-03 fourth session, H200 call 4, the final code (call 3's kernels: the fourth Q8_0 pair, default prmt_reg).
# Planted faults in the fourth pair (gate/up's x chunk shifted by one, down's last slice left out of a row's sum, a
# landing chunk written to its neighbour) against the variant and landing tests; the tests/gpu files that run the
# fused decode or the fast paths (test_decode_forms ran in call 3 at this code); then `strata run` at
# Qwen3-30B-A3B@Q8_0 (every setting, half_skewed+q8=prmt beside it, the peers: the committed result) and @F16.
# Files: gpu_tests.log, strata_run_h200_q8_0.json, strata_run_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
SRC=backends/cuda/strata_cuda/moe_fast.cu
lane_planted_faults $SRC tests/gpu/test_decode_forms.py::test_every_q8_decode_variant_matches_float64_and_the_int8_casts_bits_in_its_order \
  's/(const float4\*)x + 4 \* min(j \* STRATA_WARP + lane, h16 - 1);/(const float4*)x + 4 * min(j * STRATA_WARP + lane + 1, h16 - 1);/' \
  's/s < STRATA_D4_SLICES; ++s) sum +=/s < STRATA_D4_SLICES - 1; ++s) sum +=/'
lane_planted_faults $SRC tests/gpu/test_decode_forms.py::test_a_third_form_writes_each_landing_miss_into_its_reserved_slot_and_keeps_its_bits \
  's/(long long)h \* F))\[cj\[j\]\] = v\[t\]\[j\];/(long long)h * F))[cj[j] ^ 1] = v[t][j];/'
echo "planted faults done at $(( $(date +%s) - t0 )) s"
TEST_S=100 lane_gpu_tests 100 tests/gpu/test_fast_paths.py tests/gpu/test_quant_decode.py tests/gpu/test_quant_cuda.py \
  tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py tests/gpu/test_prefetch.py tests/gpu/test_fast_split.py \
  tests/gpu/test_embed_rows.py tests/gpu/test_pull.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 200 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 90 \
  --settings all,half_skewed,half_skewed+q8=prmt,smallest 2>&1 | cut -c1-220 | grep -v transformers | tail -7 || rc=1
echo "strata run Q8_0 done at $(( $(date +%s) - t0 )) s"
timeout -k 10 150 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@F16 --timeout 90 \
  --settings all,half_skewed,smallest 2>&1 | cut -c1-220 | grep -v transformers | tail -6 || rc=1
echo "strata run F16 done at $(( $(date +%s) - t0 )) s"
exit $rc
