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
  # the conformance kit deselects itself unless told the backend (naming cuda would fail machines without one)
  extra=""; case $f in *conformance*) extra="--strata-backend cuda";; esac
  timeout -k 10 "${TEST_S:-150}" python3 -m pytest -p no:cacheprovider -q -rfE "$f" $extra >> "$OUT/gpu_tests.log" 2>&1 || rc=1
  echo "$f: $(tail -1 "$OUT/gpu_tests.log")"
done
echo "tests/gpu took $(( $(date +%s) - t0 )) s"
# --check twice (same outputs_sha256) and strata_run_h200.py --fidelity: cuda_lane.sh's steps, its tests and layer bench off
SKIP_TESTS=1 SKIP_LAYER=1 RUN_S="${RUN_S:-260}" RUN_ARGS="--fidelity --timeout 80" bash bench/cuda_lane.sh || rc=1
# REPEAT_ALL=1: the all-cached setting once more (a one-chunk prefill figure varies between runs); its summary line
# goes to lane.log only (the device tool brings back 8 files, all taken)
if [[ "${REPEAT_ALL:-0}" == 1 ]]; then
  timeout -k 10 90 python3 bench/strata_run_h200.py --settings all --skip-peers --out /tmp/repeat_all 2>&1 | tail -3 || rc=1
fi
timeout -k 10 "${QUANT_S:-80}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes 2>&1 | tail -15 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
