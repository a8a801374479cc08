"""`strata bench`: one strata.bench/1 object whose kernels agree with the numpy reference; bad shapes exit 2."""

from __future__ import annotations

import json

from strata_core.cli import main


def test_bench_json_on_cpu_reports_every_kernel_checked_against_the_reference(capsys):
    rc = main(["bench", "--backend", "cpu", "--tokens", "64", "--experts", "8", "--top-k", "2", "--hidden", "64",
               "--ffn", "64", "--repeat", "1", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out)
    assert doc["schema"] == "strata.bench/1" and doc["backend"] == "cpu"
    names = {r["kernel"] for r in doc["results"]}
    assert {"linear+route_topk", "rmsnorm", "gather", "moe_grouped_ffn f16", "moe_grouped_ffn q8_0",
            "scatter_add"} <= names
    for r in doc["results"]:
        assert r["median_ms"] > 0
        if r["rel_err"] is not None:
            assert r["rel_err"] < 2e-3, r
    assert doc["plan_median_ms"] > 0


def test_bench_refuses_a_top_k_above_the_expert_count_in_one_line(capsys):
    rc = main(["bench", "--backend", "cpu", "--experts", "4", "--top-k", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--top-k" in err[0]
