#!/usr/bin/env bash
# The CUDA fast-path lane on the H200 device machine, in one call: the GPU tests (tests/gpu), `strata run --backend
# cuda --check` twice on the tiny model (the same outputs_sha256 both times), the layer bench (bench/layer_h200.py)
# and bench/strata_run_h200.py (three cache settings at Qwen3-30B-A3B shape, peers; with RUN_ARGS=--fidelity also
# fidelity_h200.json). At most 8 files land in $OUT (the device tool brings back no more): gpu_tests.log,
# run_cuda_1.json, run_cuda_2.json, runs.err, layer_h200.json, strata_run_h200.json, fidelity_h200.json; everything
# printed goes to stdout. Carry .whl (pydantic, pydantic-core, pydantic-settings, annotated-types,
# typing-inspection, python-dotenv, gguf) and strata_core.egg-info (the entry points). SKIP_LAYER=1 / SKIP_RUN=1 /
# SKIP_TESTS=1 leave sections out.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
rc=0
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  timeout "${TEST_S:-240}" python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu ${EXTRA_TESTS:-} > "$OUT/gpu_tests.log" 2>&1 || rc=1
  grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -20
fi
for i in 1 2; do
  echo "== run $i" >> "$OUT/runs.err"
  timeout -k 10 150 python3 -m strata_core.cli run --backend cuda --check --json > "$OUT/run_cuda_$i.json" \
    2>> "$OUT/runs.err" || rc=1
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = []
for i in (1, 2):
    try:
        runs.append(json.load(open(f"{out}/run_cuda_{i}.json")))
    except Exception as e:
        print(f"run {i}: no JSON ({e})")
for d in runs:
    cr = d.get("check_report") or {}
    print("strata run --backend cuda --check:", d.get("check"), "prefill tok/s", round(d.get("prefill_tokens_per_s") or 0),
          "decode tok/s", round(d.get("decode_tokens_per_s") or 0, 1), "hit", round(d.get("cache_hit_rate") or 0, 3),
          "sha", (d.get("outputs_sha256") or "")[:16], "tol", cr.get("tolerance"), "worst", cr.get("worst_rel_err"))
if len(runs) == 2:
    print("same outputs_sha256 twice:", runs[0].get("outputs_sha256") == runs[1].get("outputs_sha256"))
PY
tail -5 "$OUT/runs.err"
if [[ "${SKIP_LAYER:-0}" != 1 ]]; then
  timeout "${LAYER_S:-200}" python3 bench/layer_h200.py --out "$OUT" ${LAYER_ARGS:-} 2>&1 | tail -30 || rc=1
fi
if [[ "${SKIP_RUN:-0}" != 1 ]]; then
  timeout "${RUN_S:-400}" python3 bench/strata_run_h200.py --out "$OUT" ${RUN_ARGS:-} 2>&1 | tail -60 || rc=1
fi
exit $rc
