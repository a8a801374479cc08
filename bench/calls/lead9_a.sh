#!/usr/bin/env bash
# The 2026-12-02 (fourth) session's first H200 call: (1) strata_qf_dequant_st, the super-block dequantization with
# each warp's row segment staged in shared memory (issue 14's warm prefill: the sb kernel ran at 2.17 TB/s); (2) the
# third-form decode kernels over Q8_0 pools (strata_fast_decode_gate_up3_q8 / down3_q8; issue 13's Q8_0 decode took
# 48.8 us a layer against 36 in F16). The tests/gpu files these touch, then quant_layer_h200.py (sb, st host-synced,
# st on the device-table path; the HBM write/copy ceilings), then `strata run` at Qwen3-30B-A3B@Q8_0, then two
# planted faults (one a kernel) that the GPU tests must catch. Files: gpu_tests.log, quant_layer_h200.json,
# strata_run_h200_q8_0.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=110 lane_gpu_tests 110 tests/gpu/test_quant_warm.py tests/gpu/test_decode_forms.py tests/gpu/test_fast_paths.py \
  tests/gpu/test_decode_loop.py
echo "tests took $(( $(date +%s) - t0 )) s"
timeout -k 10 130 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes auto:classes:st \
  auto:classes:device:st 2>&1 | grep -v "^tiled\|^KernelSet" | grep "HBM\|QuantMoE\|warm_prefill" | cut -c1-400 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
timeout -k 10 200 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 100 2>&1 \
  | cut -c1-300 | grep -v transformers | tail -6 || rc=1
echo "strata run done at $(( $(date +%s) - t0 )) s"
plant() {  # SRC SED TEST -k EXPR: the fault must fail the selected tests (restored after)
  local src=$1 fault=$2 test=$3 sel=$4 keep; keep=$(mktemp); cp "$src" "$keep"; sed -i "$fault" "$src"
  cmp -s "$src" "$keep" && { echo "planted fault did not apply: $fault"; rc=1; }
  echo "=== planted fault: $fault" >> "$OUT/gpu_tests.log"
  timeout -k 10 60 python3 -m pytest -p no:cacheprovider -q "$test" -k "$sel" >> "$OUT/gpu_tests.log" 2>&1 \
    && { echo "planted fault NOT caught: $fault"; rc=1; } || echo "planted fault: $(tail -1 "$OUT/gpu_tests.log")"
  cp "$keep" "$src"; rm -f "$keep"
}
plant backends/cuda/strata_cuda/moe_fast.cu 's|sd\[j\] = s_d\[q\]\[(long long)h \* nd_row + c / 2\]|sd[j] = s_d[q][(long long)h * nd_row + c / 4]|' \
  tests/gpu/test_decode_forms.py "third_forms_match and q8_0 and 64x4"
plant backends/cuda/strata_cuda/quant_fast.cu 's|qf_sb_load<true>(stage + lead + k \* bsz|qf_sb_load<true>(stage + k * bsz|' \
  tests/gpu/test_quant_warm.py "super_block_dequant"
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
