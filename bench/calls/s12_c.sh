#!/usr/bin/env bash
# 2026-12-03 third session, H200 call 3, at the top-up code (CudaLayerOps.decode_top_up: the first decode step after
# a prompt fills the slots its loan gave back empty). The tests/gpu files over the layer ops and the decode loop
# (new: test_the_first_decode_step_after_a_prompt_tops_up_..., the qwen3-shaped half case asserts the top-up), then
# `strata run` at Qwen3-30B-A3B@Q8_0 and @F16 with every setting, the peers, and half_skewed_no_top_up beside
# half_skewed (the same-call A/B); then ncu over one all-cached Q8_0 decode step's kernels (where the 27 us of a
# cached layer go). Files: gpu_tests.log, strata_run_h200_q8_0.json, strata_run_h200.json, ncu_decode_q8.csv, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py tests/gpu/test_decode_forms.py
echo "tests done at $(( $(date +%s) - t0 )) s"
for m in Q8_0 F16; do
  timeout -k 10 170 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@$m --timeout 90 \
    --settings all,half_skewed,half_skewed_no_top_up,smallest 2>&1 | cut -c1-300 | grep -v transformers | tail -6 || rc=1
  echo "strata run $m done at $(( $(date +%s) - t0 )) s"
done
timeout -k 10 150 ncu --clock-control none -k regex:strata_fast_decode --launch-skip 480 --launch-count 144 \
  --section SpeedOfLight --csv python3 -m strata_core.cli run --backend cuda --model Qwen3-30B-A3B@Q8_0 \
  --prompt-tokens 512 --decode-tokens 16 --set memory.expert_cache=6600 > "$OUT/ncu_decode_q8.csv" 2> "$OUT/ncu.err" || rc=1
tail -3 "$OUT/ncu.err"; wc -l "$OUT/ncu_decode_q8.csv"
echo "ncu done at $(( $(date +%s) - t0 )) s"
exit $rc
