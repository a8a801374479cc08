"""QuantMoE overrides FastMoE's methods: each override takes every parameter of the method it overrides (by name, or
through **kwargs), so a keyword the base class's callers pass never raises TypeError on a 'gguf' model. No GPU."""

from __future__ import annotations

import inspect


def _overrides():
    """(name, base signature, override signature) of every FastMoE method QuantMoE overrides."""
    from strata_cuda.fast import FastMoE
    from strata_cuda.quant_ffn import QuantMoE
    out = []
    for name, fn in vars(QuantMoE).items():
        base = getattr(FastMoE, name, None)
        if callable(fn) and callable(base) and not name.startswith("__"):
            out.append((name, inspect.signature(base), inspect.signature(fn)))
    return out


def _missing(base: inspect.Signature, over: inspect.Signature) -> list[str]:
    """The base's parameters the override cannot take by name."""
    if any(p.kind is p.VAR_KEYWORD for p in over.parameters.values()):
        return []
    return [n for n, p in base.parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in over.parameters]


def test_quantmoe_overrides_take_every_parameter_of_fastmoe():
    rows = _overrides()
    assert any(name == "_gate_up" for name, _, _ in rows), "QuantMoE no longer overrides _gate_up: the test moved?"
    bad = {name: _missing(b, o) for name, b, o in rows if _missing(b, o)}
    assert not bad, f"QuantMoE overrides that drop FastMoE parameters: {bad}"


def test_the_signature_check_can_fail():
    def base(self, x, land=None):
        """A base method."""

    def over(self, x):
        """An override that drops `land`."""

    assert _missing(inspect.signature(base), inspect.signature(over)) == ["land"]
