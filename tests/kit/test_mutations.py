"""The kit's mutation self-test: every kernel check fails against perturbed kernels, every time.

Each mutation of `strata_core.testing.mutations` (output scaled ten times the path's bound off, one row wrong, two
experts swapped, a group boundary off by one, a stale slot read, a lost update) is applied to the numpy reference
on the cpu device, and every check of that kernel must raise for every seed tried; the unmutated reference passes
the same checks on the same seeds (the control). The protocol is introspected, so a kernel added to KernelSet
without checks and mutations fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.api.kernels import KernelSet
from strata_core.builtin.cpu import HostMemory
from strata_core.reference.kernels import ReferenceKernels
from strata_core.testing.checks import CHECKS, protocol_kernels
from strata_core.testing.mutations import MUTATIONS, mutated

#: Seeds each mutation must fail for (fresh random inputs per seed); fewer for the 'gguf' pools, whose numpy
#: quantizers and tiled reference take ~0.8 s a check on 2 cores (their mutations are the same as f16's).
SEEDS = range(8)
GGUF_SEEDS = range(2)


def _seeds(check):
    return GGUF_SEEDS if check.variant.startswith("gguf") else SEEDS
#: Every kernel must have at least these mutations.
REQUIRED = {"scale", "one_row_wrong"}
CASES = [(k, m, c) for k in sorted(MUTATIONS) for m in sorted(MUTATIONS[k]) for c in CHECKS.get(k, [])]


def test_every_protocol_kernel_has_checks_and_mutations():
    """Every kernel KernelSet names has a check, and a scale and a one-row mutation (introspected, not listed)."""
    kernels = protocol_kernels(KernelSet)
    assert len(kernels) >= 7, kernels
    no_check = [k for k in kernels if not CHECKS.get(k)]
    no_mutation = {k: sorted(REQUIRED - set(MUTATIONS.get(k, {}))) for k in kernels if REQUIRED - set(MUTATIONS.get(k, {}))}
    assert not no_check, f"kernels of the protocol the kit does not check: {no_check}"
    assert not no_mutation, f"kernels without the required mutations: {no_mutation}"
    assert set(MUTATIONS) <= set(kernels), f"mutations of kernels the protocol lacks: {set(MUTATIONS) - set(kernels)}"


def test_the_issue_mutations_are_all_present():
    """The mutations the issue lists exist (the grouped FFN carries the routing ones)."""
    ffn = set(MUTATIONS["moe_grouped_ffn"])
    assert {"scale", "one_row_wrong", "two_experts_swapped", "group_boundary_off_by_one", "stale_slot_read"} <= ffn
    assert "two_experts_swapped" in MUTATIONS["route_topk"]


@pytest.mark.parametrize("kernel,check", [(k, c) for k in sorted(CHECKS) for c in CHECKS[k]],
                         ids=lambda v: v if isinstance(v, str) else v.id)
def test_the_unmutated_reference_passes(kernel, check):
    """The control: the numpy reference passes each check on every seed the mutations are tried with."""
    for seed in _seeds(check):
        check.run(HostMemory(), ReferenceKernels(), np.random.default_rng(seed), seed)


@pytest.mark.parametrize("kernel,mutation,check", CASES,
                         ids=[f"{k}-{m}-{c.id}" for k, m, c in CASES])
def test_the_kit_fails_a_mutated_kernel_every_time(kernel, mutation, check):
    """A kernel carrying the mutation fails the check for every seed, with a message that names the seed."""
    passed = []
    for seed in _seeds(check):
        bad = mutated(ReferenceKernels(), kernel, mutation)
        try:
            check.run(HostMemory(), bad, np.random.default_rng(seed), seed)
        except AssertionError as e:
            assert f"seed {seed}" in str(e), f"the failure does not name its seed: {e}"
        else:
            passed.append(seed)
    assert not passed, f"{kernel} with mutation {mutation} passed check {check.id} for seeds {passed}"
