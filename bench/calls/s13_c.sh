#!/usr/bin/env bash
# 2026-12-03 fourth session, H200 call 3: call 2 found whole blocks a lane slower (stack 2.000 ms against prmt's
# 1.403; dropped) and Nsight Compute over prmt's kernels: 25% occupancy (128 registers), DRAM 36% / 20% busy, L1 60%
# busy with the activations re-read for every row. Here the fourth Q8_0 pair (activations kept in registers:
# cast_reg, prmt_reg, the default now) in the kernel bench beside cast and prmt; ncu over two layers of prmt_reg;
# the tests/gpu files over decode and the layer ops; `strata run` Q8_0 with the default against +q8=prmt and the
# peers. Files: decode_q8_kernels_h200.json, ncu_prmt_reg.csv, gpu_tests.log, strata_run_h200_q8_0.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
timeout -k 10 200 python3 bench/decode_q8_kernels_h200.py --out "$OUT" --variants cast,prmt,cast_reg,prmt_reg || rc=1
echo "kernel bench done at $(( $(date +%s) - t0 )) s"
timeout -k 10 100 ncu --clock-control none -k regex:"decode_(gate_up4|down4)_q8" --launch-count 4 --set full --csv \
  python3 bench/decode_q8_kernels_h200.py --out /tmp/ncu_reg --variants prmt_reg --reps 1 --no-reference \
  > "$OUT/ncu_prmt_reg.csv" 2> "$OUT/ncu_prmt_reg.err" || echo "ncu rc=$?"
echo "ncu done at $(( $(date +%s) - t0 )) s"
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_decode_forms.py tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 240 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 90 \
  --settings all,half_skewed,half_skewed+q8=prmt,all+q8=prmt,smallest 2>&1 | cut -c1-220 | grep -v transformers | tail -8 || rc=1
echo "strata run Q8_0 done at $(( $(date +%s) - t0 )) s"
exit $rc
