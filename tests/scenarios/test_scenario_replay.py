"""Seed replays: `strata plan --scenario FILE --json` for every shared scenario holds every invariant and what the
scenario expects of the plan (the runtime's part of each expectation is replayed by `strata simulate`)."""

import json

import pytest

from strata_core.cli import build_parser, main
from strata_core.commands.plan import build_plan, gather_inputs
from strata_core.api.facts import GIB
from strata_core.planner import check_all

from .conftest import SCENARIO_FILES, scenario_params


def _plan_json(path, capsys, *extra):
    rc = main(["plan", "--scenario", str(path), "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def _plan_object(path, *extra):
    args = build_parser().parse_args(["plan", "--scenario", str(path), *extra])
    return build_plan(gather_inputs(args))


@pytest.mark.parametrize("path", scenario_params())
def test_plan_holds_every_invariant(path, capsys):
    d = _plan_json(path, capsys)
    assert d["schema"] == "strata.plan/1"
    plan = _plan_object(path)
    check_all(plan)
    assert d["prompt"]["chunk"] == plan.prompt.chunk and d["expert_cache"] == {
        "slots": plan.expert_cache.slots, "slot_bytes": plan.expert_cache.slot_bytes}

    v = d["vram"]
    assert v["reserve_bytes"] + v["dense_bytes"] + v["kv_bytes"] + v["workspace_bytes"] + v["expert_cache_bytes"] \
        <= v["free_bytes"]
    assert v["expert_cache_bytes"] == d["expert_cache"]["slots"] * d["expert_cache"]["slot_bytes"]
    p = d["prompt"]
    if not p["owned_buffers"]:
        grid = p["grid_tokens"]
        assert [r["chunk"] for r in p["loans"] if r["chunk"] % grid == 0] == list(range(grid, p["chunk"] + 1, grid))
        for r in p["loans"]:
            assert r["loan_slots"] == r["ring_slots"] + r["buffer_slots"]
            assert r["loan_slots"] <= d["expert_cache"]["slots"] - p["min_keep_slots"]
    h = d["host_memory"]
    pin = d["pinned"]
    # the in-RAM store is at least the resident set and at least its page-locked part (issue 12.3)
    assert max(h["resident_bytes"], pin["arena_bytes"]) + h["borrow_bytes"] + h["kv_pinned_bytes"] \
        + h["headroom_bytes"] <= h["available_bytes"]
    assert pin["arena_bytes"] + pin["floor_bytes"] <= pin["limit_bytes"]
    assert pin["cap_bytes"] is None or pin["limit_bytes"] <= pin["cap_bytes"]
    assert pin["cpu_share_bytes"] <= pin["floor_bytes"] or not d["cpu_share"]["enabled"]


@pytest.mark.parametrize("path", scenario_params())
def test_every_request_chunk_can_be_lent(path):
    plan = _plan_object(path)
    raw = json.loads(path.read_text())
    lendable = plan.prompt.lendable_slots
    assert max(plan.loan_for(c).loan_slots for c in range(plan.prompt.grid_tokens, plan.prompt.chunk + 1,
                                                           plan.prompt.grid_tokens)) <= lendable
    for r in raw["requests"]:
        chunk = plan.request_chunk(r["prompt_tokens"])
        assert chunk <= plan.prompt.chunk
        assert plan.loan_for(chunk).loan_slots <= lendable, (r, chunk)


def _by_device(name_part):
    return [p for p in SCENARIO_FILES if name_part in json.loads(p.read_text())["profile"]["device"]["name"]]


@pytest.mark.parametrize("path", scenario_params(_by_device("4070 Ti")))
def test_4070ti_region_lent_for_the_auto_chunk_holds_every_smaller_chunk(path):
    plan = _plan_object(path)
    auto = plan.loan_for(plan.prompt.chunk).loan_slots
    biggest = max(r.loan_slots for r in plan.prompt.loans)
    assert auto <= biggest <= plan.prompt.lendable_slots
    raw = json.loads(path.read_text())
    if raw["expect"].get("a request whose loan is larger than the auto chunk's is logged"):
        # the seed's case must be in the replay: a smaller chunk whose loan is larger than the auto chunk's
        larger = [n for n in (r["prompt_tokens"] for r in raw["requests"])
                  if plan.loan_for(plan.request_chunk(n)).loan_slots > auto]
        assert larger, "no request in this scenario needs a larger loan than the auto chunk"


def _gfx12(low_ram: bool):
    out = []
    for p in SCENARIO_FILES:
        prof = json.loads(p.read_text())["profile"]
        if prof["device"].get("arch", "").startswith("gfx12") and (prof["host"]["ram_total_bytes"] < 40 * GIB) == low_ram:
            out.append(p)
    return out


@pytest.mark.parametrize("path", scenario_params(_gfx12(low_ram=True)))
def test_gfx12_with_30_gb_keeps_the_8192_chunk(path):
    plan = _plan_object(path)
    assert plan.prompt.chunk == 8192
    h, pin = plan.host_memory, plan.pinned
    # the arena pins only what host RAM leaves beside the borrow and the headroom (it planned 24 GiB + 3.8 GiB)
    assert max(h.resident_bytes, pin.arena_bytes) + h.borrow_bytes + h.kv_pinned_bytes + h.headroom_bytes \
        <= h.available_bytes
    assert pin.arena_bytes + h.borrow_bytes + h.headroom_bytes <= h.available_bytes


@pytest.mark.parametrize("path", scenario_params(_gfx12(low_ram=False)))
def test_gfx12_with_64_gb_takes_the_16384_ceiling(path):
    assert _plan_object(path).prompt.chunk == 16384


@pytest.mark.parametrize("path", scenario_params(_by_device("3090")))
def test_3090_cpu_share_comes_from_the_kept_floor_or_is_off_with_a_reason(path):
    plan = _plan_object(path)
    if plan.cpu_share.enabled:
        assert 0 < plan.pinned.cpu_share_bytes <= plan.pinned.floor_bytes
        assert plan.pinned.arena_bytes + plan.pinned.floor_bytes <= plan.pinned.limit_bytes
    else:
        assert plan.cpu_share.reason.strip()
