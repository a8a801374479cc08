"""Issue 6 on a backend that computes: the tiny model on the sim backend in real mode (numpy arrays, the reference
kernels) with each fault site injected, against the same requests without faults and on the cpu backend.

Outputs are compared exactly: the greedy tokens and a digest of every layer's output (prefill and decode), which
determines the logits. A fault that turns an optional path off is compared with the run that has that path off by
setting (seed #1756: a refused share buffer must leave the state `prefill.cpu_share=off` gives).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pytest

from strata_core.commands.run import resolve_run_model
from strata_core.errors import StrataError
from strata_core.reference.kernels import relative_error
from strata_core.planner import plan_for_machine
from strata_core.registry import load_from_settings
from strata_core.runtime.engine import Engine
from strata_core.runtime.runlog import RunLog
from strata_core.config.settings import load_settings
from strata_core.builtin.sim import backend as sim_backend

MIB = 1 << 20
#: One prompt that streams through a lent ring, then one short enough for the CPU share to arm on.
REQUESTS = (1500, 600)
DECODE_TOKENS = 2


@dataclass
class Outcome:
    """What a run produced: per-request results, a digest of every layer output, the log, the engine's figures."""

    results: list = field(default_factory=list)
    layer_digests: list[str] = field(default_factory=list)
    #: (request, phase, layer) -> that layer's output rows over the whole request, whatever chunks read it
    layer_rows: dict = field(default_factory=dict)
    log: RunLog | None = None
    started: bool = True
    start_error: str = ""
    request_errors: list[str] = field(default_factory=list)
    cache_slots: int = 0
    share_enabled: bool = False
    share_experts: int = 0
    faults_injected: list[dict] = field(default_factory=list)
    dense_bytes: int = 0

    def token_digests(self) -> dict:
        """A digest of every layer's output rows per request and phase, independent of how the prompt was chunked."""
        return {k: hashlib.sha256(np.ascontiguousarray(np.concatenate(v)).tobytes()).hexdigest()
                for k, v in self.layer_rows.items()}

    @property
    def tokens(self) -> list[list[int]]:
        """The greedy tokens of every request."""
        return [r.tokens for r in self.results]


@lru_cache(maxsize=None)
def run_tiny(backend: str, inject: tuple[str, ...] = (), settings: tuple[tuple[str, str], ...] = ()) -> Outcome:
    """Plan and serve REQUESTS on `backend` with faults (sim only) and extra settings, capturing every layer."""
    flags = {"backend.name": backend, **dict(settings)}
    if inject:
        flags["sim.inject"] = list(inject)
    loaded = load_settings(flags=flags, env={})
    plugins = load_from_settings(loaded.settings)
    try:
        target = plugins.resolve_target(loaded.settings)
        spec, load_weights, s = resolve_run_model(None, loaded, 0)
        plan = plan_for_machine(plugins, target, spec, s)
        weights = load_weights()
        out = Outcome(log=RunLog(), dense_bytes=plan.vram.dense_bytes)

        def observe(phase, layer, x_in, x_out):
            """Keep a digest of each layer's output, in order, and its rows per request for chunk-free comparison."""
            out.layer_digests.append(hashlib.sha256(np.ascontiguousarray(x_out).tobytes()).hexdigest())
            out.layer_rows.setdefault((len(out.results), phase, layer), []).append(np.array(x_out, copy=True))

        try:
            engine = Engine.open(target, plan, weights, out.log, seed=0, observer=observe)
        except StrataError as e:
            out.started, out.start_error = False, str(e)
            return out
        rng = np.random.default_rng(0)
        try:
            for n in REQUESTS:
                try:
                    out.results.append(engine.serve(rng.integers(0, weights.vocab, n), DECODE_TOKENS))
                except Exception as e:  # an engine exit: recorded, and the next request still tried
                    out.request_errors.append(f"{n} tokens: {type(e).__name__}: {e}")
                    if engine.loans.outstanding is not None:
                        engine.loans.give_back(engine.loans.outstanding)
        finally:
            out.cache_slots = engine.cache.slots
            out.share_enabled = engine.share.enabled
            out.share_experts = engine.executor.stats.cpu_share_experts
            out.faults_injected = engine.dm.inner.faults_injected() if backend == "sim" else []
            engine.close()
        return out
    finally:
        sim_backend.configure(None)


def assert_served(out: Outcome) -> None:
    """Started, and every request completed (or was refused before it started), each fallback said once."""
    assert out.started, f"the engine refused to start: {out.start_error}"
    assert not out.request_errors, f"requests died mid-way: {out.request_errors}"
    assert all(r.completed or r.refused_reason for r in out.results)
    whats = [f.what for f in out.log.fallbacks]
    assert len(whats) == len(set(whats)), f"a fallback was recorded twice: {whats}"
    for f in out.log.fallbacks:
        assert out.log.lines.count(f"{f.what}: {f.why}") == 1, f"fallback {f.what!r} not said exactly once"


def share_off() -> Outcome:
    """The sim run with the CPU share off by setting."""
    return run_tiny("sim", settings=(("prefill.cpu_share", "off"),))


def test_the_baseline_exercises_loans_and_the_cpu_share():
    base = run_tiny("sim")
    assert_served(base)
    assert base.results[0].loan_slots > 0, "the first request should stream through a lent ring"
    assert base.share_enabled and base.share_experts > 0, "the second request should arm the CPU share"


def test_the_cpu_backend_gives_bit_identical_outputs_to_the_sim_with_the_same_paths():
    cpu, sim = run_tiny("cpu"), share_off()  # the cpu backend's platform has the share off
    assert_served(cpu)
    assert_served(sim)
    assert cpu.tokens == sim.tokens
    assert cpu.layer_digests == sim.layer_digests


@pytest.mark.parametrize("spec", ["pinned-alloc:every", "pinned-alloc:nth=1"])
def test_a_refused_share_buffer_turns_the_share_off_and_changes_no_bit(spec):
    out = run_tiny("sim", (spec,))
    assert_served(out)
    assert not out.share_enabled and [f.what for f in out.log.fallbacks].count("CPU share") == 1
    assert out.faults_injected and out.faults_injected[0]["site"] == "pinned-alloc"
    off = share_off()
    assert out.tokens == off.tokens and out.layer_digests == off.layer_digests
    assert out.tokens == run_tiny("sim").tokens  # and the same tokens as with the share on


@pytest.mark.parametrize("spec", ["pinned-alloc:nth=2", "arena-register:above=1MiB", "slow-copy:factor=3"])
def test_faults_that_leave_every_path_on_change_no_bit(spec):
    out, base = run_tiny("sim", (spec,)), run_tiny("sim")
    assert_served(out)
    assert out.share_enabled == base.share_enabled
    assert out.tokens == base.tokens and out.layer_digests == base.layer_digests
    if spec.startswith("arena-register"):
        assert out.faults_injected and "expert arena" in [f.what for f in out.log.fallbacks]
    if spec.startswith("slow-copy"):
        assert out.faults_injected, "real-mode runs copy, so the slow copy must have fired"


def _free_after_start_bytes() -> int:
    """Free device bytes the sim's default device reports at start (its capacity)."""
    return sim_backend.DEFAULT_PROFILE.device.vram_free_bytes


def test_a_cache_pool_shrunk_at_start_still_serves_every_request_with_the_same_tokens():
    base = run_tiny("sim")
    pool_bytes = base.cache_slots * 49152  # f16 tiny experts: 3 x 128 x 128 x 2 bytes a slot
    spec = f"vram-drop:bytes={_free_after_start_bytes() - pool_bytes // 2 - 16 * MIB}"
    out = run_tiny("sim", (spec,))
    assert_served(out)
    assert out.cache_slots < base.cache_slots and "expert cache" in [f.what for f in out.log.fallbacks]
    assert out.tokens == base.tokens


def test_a_cache_pool_shrunk_at_start_keeps_decode_bits_and_prefill_within_rounding():
    """A smaller cache reads the prompt in other chunks (its loan is smaller). Decode steps keep their bits. Prefill
    rows cannot: the BLAS under numpy picks other kernels for other row counts, so x[:m] @ w.T differs in the last
    place from the same rows inside a larger product (measured: 4,731 of 60,928 values at m=476 of 1536), and a
    chunk larger than the plan's workspace also adds rows as its calls finish. So prefill outputs are held to the fp32
    bound (1e-5) and the tokens to equality. Known limit, said in the closing note."""
    base = run_tiny("sim")
    spec = f"vram-drop:bytes={_free_after_start_bytes() - base.cache_slots * 49152 // 2 - 16 * MIB}"
    out = run_tiny("sim", (spec,))
    assert_served(out)
    assert out.cache_slots < base.cache_slots
    assert out.tokens == base.tokens
    got, want = out.token_digests(), base.token_digests()
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if k[1] == "decode"} == {k: v for k, v in want.items() if k[1] == "decode"}
    for key, rows in base.layer_rows.items():
        a, b = np.concatenate(out.layer_rows[key]), np.concatenate(rows)
        assert a.shape == b.shape
        assert relative_error(a, b) < 1e-5, key  # the kit's fp32 bound; 8 layers of residual adds reach ~1e-6


def test_a_tiny_cache_left_by_another_process_still_serves_every_request():
    """With 16 slots left (a device that refuses anything above 1 MiB) every request is still served: the admit path
    no longer protects every slot it already ran in the layer (it raised 'no cache slot can take a missed expert')."""
    out = run_tiny("sim", ("device-alloc:above=1MiB",))
    assert_served(out)
    assert out.tokens == run_tiny("sim").tokens


def _sim_engine():
    """(engine, its SimDeviceMemory) of the tiny model on the sim backend in real mode, memory strict."""
    from strata_core.api.backend import PinnedBudget
    from strata_core.builtin.sim import SimPinnedAllocator
    from strata_core.builtin.sim.memory import SimDeviceMemory
    from strata_core.reference.kernels import ReferenceKernels
    loaded = load_settings(flags={"backend.name": "sim"}, env={})
    plugins = load_from_settings(loaded.settings)
    target = plugins.resolve_target(loaded.settings)
    spec, load_weights, s = resolve_run_model(None, loaded, 0)
    plan = plan_for_machine(plugins, target, spec, s)
    budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
    dm = SimDeviceMemory(plan.device.vram_free_bytes)
    eng = Engine(plan, dm=dm, allocator=SimPinnedAllocator(budget, None), kernels=ReferenceKernels(), budget=budget,
                 weights=_tiny_weights(load_weights), log=RunLog(), strict_memory=True)
    return eng, dm


_WEIGHTS: dict = {}


def _tiny_weights(load):
    """The tiny model's weights, generated once for this module."""
    if "w" not in _WEIGHTS:
        _WEIGHTS["w"] = load()
    return _WEIGHTS["w"]


def test_vram_taken_by_another_process_after_start_changes_no_request():
    """The runtime holds every device byte of its plan from the start (regions), so VRAM another process takes
    later costs no request anything: the same tokens, no halving, no device allocation while serving. (Before the
    plan's regions, this fault at the 60th allocation hit a request's per-chunk buffers and halved its chunk.)"""
    eng, dm = _sim_engine()
    base_eng, _ = _sim_engine()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, eng.weights.vocab, n) for n in (1100, 3000)]
    want = [base_eng.serve(p, 2).tokens for p in prompts]
    base_eng.close()
    allocations = dm.allocations
    dm.drop_capacity(dm.capacity_bytes)  # every free byte taken
    got = [eng.serve(p, 2) for p in prompts]
    assert all(r.completed and r.halvings == 0 for r in got)
    assert [r.tokens for r in got] == want
    assert dm.allocations == allocations and dm.refusals == 0
    eng.close()


def test_a_device_that_cannot_hold_top_k_slots_refuses_to_start_in_one_line():
    out = run_tiny("sim", ("device-alloc:above=8KiB",))
    assert not out.started and out.start_error and "\n" not in out.start_error
    assert not out.results
