#!/usr/bin/env bash
# 2026-12-03 fourth session, H200 call 2: call 1 found the Q8_0 kernels' time set by their loads, not their bytes
# (gate/up 14 us for 25 MB, down 12 us for 13 MB; the f16 kernels move twice the bytes in about the same time), the
# byte permute 5% faster (stack 1.403 against 1.473 ms), the pipelined rows slower (dropped). Here: whole Q8_0 blocks
# a lane (two adjacent 16-byte loads and one scale instead of a scale a chunk; cast_blk, prmt_blk, the default now)
# in the kernel bench; ncu over two layers' Q8_0 kernels of prmt and prmt_blk (if the counters can be read); the
# tests/gpu files over decode and the layer ops; `strata run` Q8_0 with the default against +q8=prmt and +q8=cast.
# Files: decode_q8_kernels_h200.json, ncu_prmt.csv, ncu_prmt_blk.csv, gpu_tests.log, strata_run_h200_q8_0.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
timeout -k 10 200 python3 bench/decode_q8_kernels_h200.py --out "$OUT" --variants cast,prmt,cast_blk,prmt_blk || rc=1
echo "kernel bench done at $(( $(date +%s) - t0 )) s"
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_decode_forms.py tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 220 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 90 --skip-peers \
  --settings all,half_skewed,half_skewed+q8=prmt,half_skewed+q8=cast,all+q8=cast 2>&1 | cut -c1-220 | grep -v transformers | tail -8 || rc=1
echo "strata run Q8_0 done at $(( $(date +%s) - t0 )) s"
for v in prmt prmt_blk; do
  timeout -k 10 100 ncu --clock-control none -k regex:"decode_(gate_up3|down3)_q8" --launch-count 4 --set full --csv \
    python3 bench/decode_q8_kernels_h200.py --out /tmp/ncu_$v --variants $v --reps 1 --no-reference \
    > "$OUT/ncu_$v.csv" 2> "$OUT/ncu_$v.err" || echo "ncu $v rc=$?"
  tail -2 "$OUT/ncu_$v.err"; wc -l "$OUT/ncu_$v.csv"
done
echo "ncu done at $(( $(date +%s) - t0 )) s"
exit $rc
