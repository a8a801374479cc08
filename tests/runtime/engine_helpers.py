"""Engines of the built-in tiny model on the sim backend in real mode (numpy arrays, capacities counted)."""

from __future__ import annotations

from functools import lru_cache

from strata_core.api.backend import PinnedBudget
from strata_core.reference.kernels import ReferenceKernels
from strata_core.runtime.engine import Engine
from strata_core.runtime.runlog import RunLog
from strata_core.models.synthetic import generate_weights, tiny_cache_slots, tiny_model_spec
from strata_core.builtin.sim import FaultPlan, SimPinnedAllocator
from strata_core.builtin.sim.memory import SimDeviceMemory

from .plans import sim_plan


@lru_cache(maxsize=4)
def tiny_weights(dtype: str = "f16"):
    """The tiny model's weights (generated once per test session)."""
    spec = tiny_model_spec()
    if dtype != "f16":
        from strata_core.models.synthetic import TINY_EXPERTS, TINY_FFN, TINY_HIDDEN, TINY_LAYERS, TINY_TOP_K, TINY_VOCAB
        from strata_core.models.synthetic import model_spec
        spec = model_spec("strata-tiny-q8", TINY_LAYERS, TINY_EXPERTS, TINY_TOP_K, TINY_HIDDEN, TINY_FFN, TINY_VOCAB,
                          dtype="q8_0")
    return generate_weights(spec, seed=0, dtype=dtype)


def tiny_engine(settings: dict | None = None, faults=(), dtype: str = "f16", observer=None, wrap=None):
    """(engine, plan, log, device memory) of the tiny model with half its experts cached, on a simulated device.

    `wrap`, when given, wraps the simulated DeviceMemory (a test double in front of it).
    """
    w = tiny_weights(dtype)
    s = {"memory": {"expert_cache": tiny_cache_slots(w.spec)}}
    for group, values in (settings or {}).items():
        s.setdefault(group, {}).update(values)
    _, plan = sim_plan(w.spec, s)
    fp = FaultPlan.parse(list(faults))
    budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
    dm = SimDeviceMemory(plan.device.vram_free_bytes, faults=fp)
    log = RunLog()
    eng = Engine(plan, dm=wrap(dm) if wrap else dm, allocator=SimPinnedAllocator(budget, None, faults=fp), kernels=ReferenceKernels(),
                 budget=budget, weights=w, log=log, observer=observer, strict_memory=True)
    return eng, plan, log, dm
