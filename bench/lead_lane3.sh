#!/usr/bin/env bash
# The lead's final H200 call of the 2026-12-01 evening session: every tests/gpu file in its own pytest process (a sticky
# CUDA error in one file cannot fail the files after it; test_fidelity.py first, as it reads the driver's free memory), `strata run --backend cuda --check` twice on the tiny model (same
# outputs_sha256), bench/strata_run_h200.py with the three cache settings, the peers and --fidelity, then
# bench/quant_layer_h200.py. Files in $OUT: gpu_tests.log, run_cuda_1.json, run_cuda_2.json, runs.err,
# strata_run_h200.json, fidelity_h200.json, quant_layer_h200.json, lane.log. Carry .whl and strata_core.egg-info.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/lane.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
rc=0; t0=$(date +%s)
# One file at a time, each in its own process (a sticky CUDA error cannot fail the files after it), its log appended
# to $OUT/gpu_tests.log as it ends, `timeout -k` so a process stuck in the driver is killed: the 18:06 call of this
# script ran four files at once into a temporary folder copied only at the end, and brought nothing back.
for f in tests/gpu/test_fidelity.py $(ls tests/gpu/test_*.py | grep -v test_fidelity.py); do
  echo "=== $f" >> "$OUT/gpu_tests.log"
  timeout -k 10 "${TEST_S:-150}" python3 -m pytest -p no:cacheprovider -q -rfE "$f" >> "$OUT/gpu_tests.log" 2>&1 || rc=1
  echo "$f: $(tail -1 "$OUT/gpu_tests.log")"
done
echo "tests/gpu took $(( $(date +%s) - t0 )) s"
for i in 1 2; do
  echo "== run $i" >> "$OUT/runs.err"
  timeout -k 10 100 python3 -m strata_core.cli run --backend cuda --check --json > "$OUT/run_cuda_$i.json" 2>> "$OUT/runs.err" || rc=1
done
python3 - "$OUT" <<'PY'
import json, sys
runs = []
for i in (1, 2):
    try:
        runs.append(json.load(open(f"{sys.argv[1]}/run_cuda_{i}.json")))
    except Exception as e:
        print(f"run {i}: no JSON ({e})")
for d in runs:
    cr = d.get("check_report") or {}
    print("strata run --backend cuda --check:", d.get("check"), "decode tok/s", round(d.get("decode_tokens_per_s") or 0, 1),
          "sha", (d.get("outputs_sha256") or "")[:16], "tol", cr.get("tolerance"), "worst", cr.get("worst_rel_err"),
          "measured/planned", d.get("device_bytes_peak_measured"), d.get("device_bytes_planned"))
if len(runs) == 2:
    print("same outputs_sha256 twice:", runs[0].get("outputs_sha256") == runs[1].get("outputs_sha256"))
PY
tail -3 "$OUT/runs.err"
timeout "${RUN_S:-260}" python3 bench/strata_run_h200.py --out "$OUT" --fidelity --settings all,half_skewed,smallest \
  --timeout 80 2>&1 | tail -30 || rc=1
timeout "${QUANT_S:-80}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants 32:classes 2>&1 | tail -15 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
