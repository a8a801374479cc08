#!/usr/bin/env bash
# The 2026-12-03 session's second H200 call: decode admits its misses by landing (the third-form kernels write a
# missed expert into a slot reserved for it as they read it from host memory; CudaLayerOps.decode_landing), so an
# admission adds no link bytes. The tests/gpu files over the decode kernels and the layer ops first, then planted
# faults in the landing stores, then `strata run` at Qwen3-30B-A3B@Q8_0 and @F16 with half_skewed_copy (admission by
# copies, as before) beside half_skewed.
# Files: gpu_tests.log, strata_run_h200_q8_0.json, strata_run_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=120 lane_gpu_tests 120 tests/gpu/test_decode_forms.py tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py \
  tests/gpu/test_fast_paths.py tests/gpu/test_quant_decode.py
echo "tests done at $(( $(date +%s) - t0 )) s"
LAND=tests/gpu/test_decode_forms.py::test_a_third_form_writes_each_landing_miss_into_its_reserved_slot_and_keeps_its_bits
lane_planted_faults backends/cuda/strata_cuda/moe_fast.cu "$LAND" \
  's/                        landing\[(long long)(F + row) \* h8 + cj\] = vu\[j\];//' \
  's/if ((c \& 1) == 0) const_cast<unsigned short\*>(d2)\[ls \* nd + (long long)h \* nd_row + c \/ 2\] = sd\[j\];//'
lane_planted_faults backends/cuda/strata_cuda/moe_fast.cu \
  tests/gpu/test_layer_ops.py::test_decode_steps_replay_one_graph_with_mapped_misses \
  's/if (dst != 0) dst\[(long long)h \* per_row + c\] = v\[j\];//'
echo "planted faults done at $(( $(date +%s) - t0 )) s"
for m in Q8_0 F16; do
  timeout -k 10 170 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@$m --timeout 90 \
    --settings all,half_skewed,half_skewed_copy,smallest 2>&1 | cut -c1-300 | grep -v transformers | tail -6 || rc=1
  echo "strata run $m done at $(( $(date +%s) - t0 )) s"
done
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
