#!/usr/bin/env bash
# The 2026-12-03 second session's first H200 call: the miss hint (fast.DECODE_MISS_HINT: the third-form gate/up
# kernels hint a missed expert's down matrix in host memory into L2, so the link reads it beside the gate/up rows),
# off by default until measured. The tests/gpu files over the decode kernels (test_decode_forms runs every third form
# with the hint too: same bits), then decode_miss_order_h200.py (rank order, misses first, miss hint; the mapped-read
# ceiling of a plain kernel), then `strata run` at Qwen3-30B-A3B@Q8_0 and @F16 with half_skewed_hint beside
# half_skewed, then an A/B of the F16 all-cached run against the tree of 6bd037e (.gl/old_6bd037e.tar, which decoded
# 579 tok/s in lead_h200_s8 call 3; this code 530-536 in lead_h200_s10): old, new, old, new.
# Files: gpu_tests.log, decode_miss_order_h200.json, strata_run_h200_q8_0.json, strata_run_h200.json, ab_f16/, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=130 lane_gpu_tests 130 tests/gpu/test_decode_forms.py tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py \
  tests/gpu/test_fast_paths.py tests/gpu/test_quant_decode.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 100 python3 bench/decode_miss_order_h200.py --out "$OUT" 2>&1 | tail -18 || rc=1
echo "miss order done at $(( $(date +%s) - t0 )) s"
timeout -k 10 110 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 60 --skip-peers \
  --settings half_skewed,half_skewed_hint,half_skewed_copy 2>&1 | cut -c1-240 | grep -v transformers | tail -4 || rc=1
echo "strata run Q8_0 done at $(( $(date +%s) - t0 )) s"
timeout -k 10 100 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@F16 --timeout 60 --skip-peers \
  --settings half_skewed,half_skewed_hint 2>&1 | cut -c1-240 | grep -v transformers | tail -3 || rc=1
echo "strata run F16 done at $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/old "$OUT/ab_f16" && tar -xf .gl/old_6bd037e.tar -C /tmp/old
new=$PWD
for i in 1 2; do
  for tree in old new; do
    [[ $tree == old ]] && d=/tmp/old || d=$new
    ( cd "$d" && PYTHONPATH=$d:$d/backends/cuda:$d/backends/rocm:$d/backends/sycl:/tmp/site timeout -k 10 70 \
        python3 bench/strata_run_h200.py --out /tmp/ab_$tree$i --model Qwen3-30B-A3B@F16 --timeout 60 --skip-peers \
        --settings all 2>&1 | cut -c1-200 | grep "^all" | sed "s/^/$tree$i /" )
    cp /tmp/ab_$tree$i/strata_run_h200.json "$OUT/ab_f16/${tree}$i.json" 2>/dev/null
    [[ $(( $(date +%s) - t0 )) -gt 540 ]] && break 2
  done
done
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
