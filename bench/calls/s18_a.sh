#!/usr/bin/env bash
# For an H200 call (written 2026-12-04, fifth session, when no device was lent: never run yet). Independent of
# s17_a.sh / s17_b.sh (it leaves quant_ffn's defaults as committed).
# `strata run --backend cuda` on a generated Qwen3-30B-A3B@Q4_K_M (before 536b05c every K-quant preset generated
# Q8_0 experts): gate/up Q4_K, down Q6_K in the 24 layers llama.cpp's use_more_bits picks and Q4_K in the others, a
# 'gguf' pool of 3,059,712-byte slots (17.5 GiB of experts). First the GPU tests of that path (test_quant_cuda.py has
# the new one: strata run --check with the fused GEMMs standing down, said once among the fallbacks), then
# bench/strata_run_h200.py over the three cache settings without peers -> strata_run_h200_q4_k_m.json. Files:
# gpu_tests.log, strata_run_h200_q4_k_m.json, run_bench.log, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=200 lane_gpu_tests 200 tests/gpu/test_quant_cuda.py tests/gpu/test_quant_decode.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 420 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q4_K_M --skip-peers \
  --timeout 200 > "$OUT/run_bench.log" 2>&1 || rc=1
grep -E "^(all|half_skewed|smallest):|PLAN BROKEN|Traceback|Error" "$OUT/run_bench.log" | cut -c1-300
python3 - "$OUT/strata_run_h200_q4_k_m.json" <<'PY' || rc=1
import json, sys
d = json.load(open(sys.argv[1]))
print("targets", d.get("targets"), "plan_obeyed", d.get("plan_obeyed"))
for k, r in d["runs"].items():
    print(k, {n: r.get(n) for n in ("prefill_tokens_per_s", "decode_tokens_per_s", "cache_hit_rate", "fallbacks",
                                    "device_bytes_peak_measured", "device_bytes_planned", "_exit")})
PY
echo "run bench done at $(( $(date +%s) - t0 )) s"
exit $rc
