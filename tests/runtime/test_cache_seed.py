"""The warm-up seeds the cache's frequencies from its popularity estimate, so the prompt's loan and the first
misses evict unpopular experts, not the popular ones of layers the prompt has not reached yet."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.models.synthetic import generate_weights, tiny_cache_slots, tiny_model_spec
from strata_core.runtime.cache import EMPTY, ExpertCache
from strata_core.runtime.engine import POPULARITY_SAMPLE_TOKENS, warm_frequency

from .test_warm_popularity import _engine


def test_seed_frequency_adds_to_the_rows_and_rejects_bad_weights():
    c = ExpertCache(slots=4, layers=2, experts_per_layer=3)
    c.seed_frequency(np.array([0, 4, 4]), np.array([1.5, 2.0, 0.5]))
    assert c.freq.tolist() == [1.5, 0.0, 0.0, 0.0, 2.5, 0.0]
    for rows, weights in (([0], [-1.0]), ([0], [np.nan]), ([0, 1], [1.0])):
        with pytest.raises(ValueError):
            c.seed_frequency(np.array(rows), np.array(weights))


def test_seeded_admit_evicts_the_unpopular_expert_of_a_layer_not_reached_yet():
    # layer 1 holds its popular expert 0 in slot 0 and its unpopular expert 2 in slot 1; a miss of layer 0 comes first
    c = ExpertCache(slots=2, layers=2, experts_per_layer=3)
    c.place(np.array([c.row(1, 0), c.row(1, 2)]))
    c.seed_frequency(np.arange(6), np.array([0.2, 0.2, 0.2, 0.8, 0.15, 0.05]))
    c.lookup(0, np.array([1]))
    assert c.admit(0, np.array([1])).tolist() == [1]
    assert c.slot_of[c.row(1, 0)] == 0 and c.slot_of[c.row(1, 2)] == EMPTY


def test_seeded_lend_takes_the_unpopular_slots():
    c = ExpertCache(slots=4, layers=1, experts_per_layer=4)
    c.place(np.arange(4))
    c.seed_frequency(np.arange(4), np.array([0.4, 0.3, 0.2, 0.1]))
    assert sorted(c.lend_run(2).tolist()) == [2, 3]


def test_warm_frequency_stands_for_the_estimates_routed_rows():
    pop = np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    rows, weights = warm_frequency(pop, top_k=2)
    assert rows.tolist() == list(range(6))
    assert np.allclose(weights.reshape(2, 3).sum(axis=1), 2 * POPULARITY_SAMPLE_TOKENS)
    assert np.allclose(weights, pop.reshape(-1) * 2 * POPULARITY_SAMPLE_TOKENS)


def test_after_a_prompt_the_last_layers_popular_experts_are_still_resident():
    # the sweep's skew, half the experts cached, a prompt whose chunk borrows a loan from the cache: without seeds
    # every frequency is 0 at the loan, ties go by slot number, and the loan takes the first slots, which hold the
    # most popular experts of every layer (none of the last layer's top eighth stayed resident)
    spec = tiny_model_spec()
    w = generate_weights(spec, seed=0, popularity_skew=1.0)
    eng = _engine(w, tiny_cache_slots(spec))
    try:
        pop = eng.expert_popularity()
        L, E = pop.shape
        prompt = np.random.default_rng(0).integers(0, spec.vocab, 3000)
        res = eng.serve(prompt, decode_tokens=0)
        assert res.completed and res.loan_slots > 0
        eng.cache.check()
        top = np.argsort(-pop[L - 1], kind="stable")[: E // 8]
        assert (eng.cache.slot_of[(L - 1) * E + top] != EMPTY).all()
    finally:
        eng.close()


def test_the_warm_up_seeds_every_frequency_from_the_popularity_estimate():
    spec = tiny_model_spec()
    w = generate_weights(spec, seed=0, popularity_skew=1.0)
    eng = _engine(w, tiny_cache_slots(spec) // 2)
    try:
        pop = eng.expert_popularity()
        assert np.allclose(eng.cache.freq.reshape(pop.shape), pop * spec.top_k * POPULARITY_SAMPLE_TOKENS)
        assert eng.cache.lookups == 0
    finally:
        eng.close()
