#!/usr/bin/env bash
# For the next GPU call (written 2026-12-06, sixth session, never run): why strata run on a generated
# Qwen3-30B-A3B@Q4_K_M measured its device peak 8,674,304 bytes over the plan in every cache setting
# (bench/results/s19_h100/call3_), where F16 and Q8_0 match it. First what the gguf path's pieces take from the
# driver on a bare process (bench/quant_device_bytes.py: the quant modules, each QuantMoE, its decode buffers and
# GEMM warm-up), then the Q4_K_M run again for the same call's figures. Files: quant_device_bytes.json,
# strata_run_h200_q4_k_m.json, run_bench.log, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
timeout -k 10 120 python3 bench/quant_device_bytes.py --out "$OUT" || rc=1
echo "device bytes done at $(( $(date +%s) - t0 )) s"
timeout -k 10 300 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q4_K_M --skip-peers \
  --timeout 150 > "$OUT/run_bench.log" 2>&1 || rc=1
grep -E "^(all|half_skewed|smallest):|PLAN BROKEN|Traceback|Error" "$OUT/run_bench.log" | cut -c1-200
echo "run bench done at $(( $(date +%s) - t0 )) s"
exit $rc
