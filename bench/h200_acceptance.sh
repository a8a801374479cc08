#!/usr/bin/env bash
# The GPU lane on the H200 device machine, in one call: the cuda GPU tests, the conformance kit on cuda,
# `strata run --backend cuda --check`, and the MoE layer benchmark. Logs and JSON go to $OUT.
# The tree is not pip-installed there: the carried wheels go to /tmp/site, the carried strata_core.egg-info
# registers the entry points, and the tree's folders come first on PYTHONPATH so no stale copy shadows them.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
python3 -m pytest -p no:cacheprovider -q tests/gpu tests/backends/test_cuda_probe.py tests/backends/test_cuda_pinned.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -5 || rc=1
python3 -m pytest -p no:cacheprovider -q --strata-backend cuda tests/plugins/test_conformance_all.py \
  2>&1 | tee "$OUT/conformance_cuda.log" | tail -5 || rc=1
python3 -m strata_core.cli run --backend cuda --check --json > "$OUT/run_cuda.json" 2> "$OUT/run_cuda.err" || rc=1
python3 - "$OUT/run_cuda.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("strata run --backend cuda --check:", d["check"], "prefill tok/s", round(d["prefill_tokens_per_s"]),
      "decode tok/s", round(d["decode_tokens_per_s"], 1), "hit rate", round(d["cache_hit_rate"], 3),
      "fallbacks", len(d["fallbacks"]))
PY
if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  python3 bench/h200_moe.py --out "$OUT" --commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    2>&1 | tee "$OUT/h200_moe.log" | tail -40 || rc=1
fi
exit $rc
