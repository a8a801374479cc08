#!/usr/bin/env bash
# The 2026-12-02 (third) session's fourth H200 call: a streamed Q8_0 layer's cached experts as one pair of
# device-table launches over the host's stack layout (FastMoE._device_hits; call 3's half-skewed Q8_0 prefill was
# 0.46x its link floor, the hits going group by group through scratch and cuBLAS classes). Every tests/gpu file (fast.py
# changed under both prefill paths), two planted faults in _device_hits that test_fast_paths.py must catch (restored
# after), then `strata run` at Qwen3-30B-A3B@Q8_0 with the peers. Files: gpu_tests.log, strata_run_h200_q8_0.json,
# lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=120 lane_gpu_tests 120
echo "tests/gpu took $(( $(date +%s) - t0 )) s"
lane_planted_faults backends/cuda/strata_cuda/fast.py tests/gpu/test_fast_paths.py \
  's/slots = np.where(cnt > 0, slot_of, 0)/slots = np.where(cnt > 0, 0, slot_of)/' \
  's/maps + 4 \* e_n, hit_slots/maps, hit_slots/'
timeout -k 10 240 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 100 2>&1 \
  | cut -c1-300 | grep -v transformers | tail -5 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
