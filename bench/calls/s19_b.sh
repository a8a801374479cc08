#!/usr/bin/env bash
# Sixth session (2026-12-06), call 2. Call 1 (s19_a.sh's tests, then s18_a.sh's bench) measured strata run on a
# generated Qwen3-30B-A3B@Q4_K_M on an H100: the measured device peak 2.37 GB over the plan in every cache setting
# (the Q4_K_M preset sized f16 layers: plan_pool_dtype) and half-cached decode at 24 tok/s (a gguf step with a miss
# ran composed; quant_decode.cu now reads misses from the store's mapped rows). This call: the GPU tests of both
# (test_quant_cuda's decode test at "half"), the f16/Q8_0 decode tests of test_layer_ops (device time: the decode
# loop and forms files left out), bench/strata_run_h200.py on Q4_K_M again, then a planted fault (no host reads:
# the half test must fail). Files: gpu_tests.log,
# strata_run_h200_q4_k_m.json, run_bench.log, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_cuda.py tests/gpu/test_quant_decode.py tests/gpu/test_layer_ops.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 300 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q4_K_M --skip-peers \
  --timeout 150 > "$OUT/run_bench.log" 2>&1 || rc=1
grep -E "^(all|half_skewed|smallest):|PLAN BROKEN|Traceback|Error" "$OUT/run_bench.log" | cut -c1-200
python3 - "$OUT/strata_run_h200_q4_k_m.json" <<'PY' || rc=1
import json, sys
d = json.load(open(sys.argv[1]))
print("targets", d.get("targets"), "plan_obeyed", d.get("plan_obeyed"))
for k, r in d["runs"].items():
    print(k, {n: r.get(n) for n in ("prefill_tokens_per_s", "decode_tokens_per_s", "cache_hit_rate",
                                    "device_bytes_peak_measured", "device_bytes_planned", "_exit")})
    print(k, r.get("layer_ops"))
PY
echo "run bench done at $(( $(date +%s) - t0 )) s"
# last (device time): the planted fault
lane_planted_faults backends/cuda/strata_cuda/layer_ops.py tests/gpu/test_quant_cuda.py \
  's/if dtype == "gguf" and not self._gguf_reads_host(works, store):/if dtype == "gguf":/'
echo "fault done at $(( $(date +%s) - t0 )) s"
exit $rc
