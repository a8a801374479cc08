"""Issue 12.5: rules in bytes, so 100 MB experts plan and replay as 2 MB ones do (Mixtral 8x7B Q4_K on an 8 GB card)."""

import json
from pathlib import Path

from strata_core.cli import main

MIXTRAL = Path(__file__).parent / "data" / "mixtral8x7b-q4k-rtx4060-8gb.json"


def test_mixtral_q4k_on_an_8_gb_card_plans_and_replays_with_no_exit(capsys):
    rc = main(["plan", "--scenario", str(MIXTRAL), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["model"]["slot_bytes"] > 90_000_000 and not plan["prompt"]["owned_buffers"]
    assert all(r["fits"] for r in plan["requests"])
    ring_bytes = max(r["ring_slots"] for r in plan["prompt"]["loans"]) * plan["model"]["slot_bytes"]
    assert ring_bytes <= 2 * 392 * (1 << 20), f"a ring of {ring_bytes >> 20} MiB"
    rc = main(["simulate", "--scenario", str(MIXTRAL), "--json", "--decode-tokens", "2"])
    out, err = capsys.readouterr()
    sim = json.loads(out)
    assert rc == 0 and sim["engine_exits"] == 0, sim["engine_exit_reasons"]
    assert sim["completed"] == len(sim["requests"]) == 7 and sim["refused"] == 0
