"""The generated popularity skew holds at every depth: the last layer of a deep model routes like the first.

The residual grows layer by layer; a carrier that did not grow with it lost its share of the normalized input, and
the 48th layer of a Qwen3-30B-A3B-shaped model routed 0.62 of its rows to its most popular half against 0.99 in the
first (the sweep's skew is the same bias in every layer; bench/results/skew_depth.json). The forward pass is the
runtime's math through the reference kernels (synthetic.popular_half_shares).
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.models.synthetic import generate_weights, model_spec, popular_half_shares

L, E, K, H, F = 16, 64, 4, 128, 64


def top_half_share_by_layer(dtype: str, skew: float) -> list[float]:
    """Share of each layer's routed rows that its most popular half of experts takes, over 128 prompt tokens."""
    spec = model_spec("skew-probe", L, E, K, H, F, 1024, dtype=dtype)
    w = generate_weights(spec, 0, dtype=dtype, popularity_skew=skew)
    return popular_half_shares(w, np.random.default_rng(1).integers(0, 1024, 128))


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_the_skew_is_as_strong_in_the_last_layer_as_in_the_first(dtype):
    shares = top_half_share_by_layer(dtype, 1.0)
    assert shares[0] > 0.9, shares
    assert min(shares) > 0.9 and abs(shares[-1] - shares[0]) < 0.05, [round(s, 3) for s in shares]


def test_without_skew_no_half_takes_most_rows():
    shares = top_half_share_by_layer("f16", 0.0)
    assert max(shares) < 0.8, [round(s, 3) for s in shares]
