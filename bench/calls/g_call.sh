#!/usr/bin/env bash
# Engineer G's one device call (H200, <= 330 s): tests/gpu (no -x), bench/strata_run_h200.py for the all-cached
# setting with --fidelity (peers skipped), the fused decode kernels at Qwen3 shape (f16, Q8_0), and two
# `strata run` of Qwen3-30B-A3B@Q8_0 (all cached, 4096-token chunk, 128 decode tokens; then a short one with
# --check), each through strata_run_h200.py's child wrapper so the layer-op path counts are printed. At most 8 files
# land in $OUT; everything printed also goes to $OUT/lane.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/lane.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
rc=0
timeout 100 python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu > "$OUT/gpu_tests.log" 2>&1 || rc=1
grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -25
timeout 90 python3 bench/strata_run_h200.py --out "$OUT" --settings all --skip-peers --fidelity --timeout 60 2>&1 \
  | tail -12 || rc=1
timeout 35 python3 bench/decode_kernels_h200.py --out "$OUT" 2>&1 | tail -4 || rc=1
Q8=(--backend cuda --model Qwen3-30B-A3B@Q8_0 --json)
timeout 35 python3 bench/strata_run_h200.py --child-run -- -m strata_core.cli run "${Q8[@]}" --prompt-tokens 4096 \
  --decode-tokens 128 --set prefill.chunk=4096 > "$OUT/q8_run.json" 2> "$OUT/q8_run.err" || rc=1
timeout 45 python3 bench/strata_run_h200.py --child-run -- -m strata_core.cli run "${Q8[@]}" --prompt-tokens 64 \
  --decode-tokens 8 --check >> "$OUT/q8_run.json" 2>> "$OUT/q8_run.err" || rc=1
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
dec = json.JSONDecoder()
text = open(f"{out}/q8_run.json").read()
i = 0
while i < len(text):
    if text[i].isspace():
        i += 1
        continue
    try:
        d, i = dec.raw_decode(text, i)
    except ValueError:
        print("q8 run: no more JSON"); break
    print("q8 run:", {k: d.get(k) for k in ("check", "prefill_tokens_per_s", "decode_tokens_per_s", "cache_hit_rate",
                                           "device_bytes_planned", "device_bytes_peak_measured", "fallbacks")},
          "worst", (d.get("check_report") or {}).get("worst_rel_err"))
PY
grep "strata-bench layer_ops" "$OUT/q8_run.err"; tail -3 "$OUT/q8_run.err"
exit $rc
