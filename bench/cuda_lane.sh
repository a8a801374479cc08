#!/usr/bin/env bash
# The CUDA fast-path lane on the H200 device machine, in one call: the GPU tests of the fused paths and kernels,
# `strata run --backend cuda --check` twice on the tiny model (same outputs_sha256 both times), the layer bench
# (bench/layer_h200.py) and, unless SKIP_RUN=1, bench/strata_run_h200.py. Logs and JSON go to $OUT.
# Carry .whl (pydantic, pydantic-core, pydantic-settings, annotated-types, typing-inspection, python-dotenv, gguf)
# and strata_core.egg-info (the entry points).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
timeout "${TEST_S:-240}" python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu ${EXTRA_TESTS:-} 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -25 || rc=1
for i in 1 2; do
  timeout 120 python3 -m strata_core.cli run --backend cuda --check --json > "$OUT/run_cuda_$i.json" \
    2> "$OUT/run_cuda_$i.err" || rc=1
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = []
for i in (1, 2):
    try:
        runs.append(json.load(open(f"{out}/run_cuda_{i}.json")))
    except Exception as e:
        print(f"run {i}: no JSON ({e}); stderr tail:", open(f"{out}/run_cuda_{i}.err").read()[-1500:])
for d in runs:
    print("strata run --backend cuda --check:", d.get("check"), "prefill tok/s", round(d["prefill_tokens_per_s"]),
          "decode tok/s", round(d["decode_tokens_per_s"], 1), "hit", round(d["cache_hit_rate"], 3),
          "sha", (d.get("outputs_sha256") or "")[:16], "tol", (d.get("check_report") or {}).get("tolerance"),
          "worst", (d.get("check_report") or {}).get("worst_rel_err"), "layer_ops", d.get("layer_ops"))
if len(runs) == 2:
    print("same outputs_sha256 twice:", runs[0].get("outputs_sha256") == runs[1].get("outputs_sha256"))
PY
if [[ "${SKIP_LAYER:-0}" != 1 ]]; then
  timeout "${LAYER_S:-200}" python3 bench/layer_h200.py --out "$OUT" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/layer.log" | tail -30 || rc=1
fi
if [[ "${SKIP_RUN:-0}" != 1 ]]; then
  timeout "${RUN_S:-400}" python3 bench/strata_run_h200.py --out "$OUT" ${RUN_ARGS:-} 2>&1 | tee "$OUT/strata_run.log" | tail -40 || rc=1
fi
exit $rc
