"""The cpu backend's decode path (`ComposedLayerOps._decode_host`) does what the general composed path does: the same
bits in every layer output and token, the same cache traffic, the same counters."""

from __future__ import annotations

import json

import pytest

from strata_core.builtin import cpu
from strata_core.cli import main
from strata_core.runtime import layer_ops

FIELDS = ("outputs_sha256", "tokens", "cache_hits", "cache_lookups", "cache_hit_rate_decode", "experts_streamed",
          "bytes_streamed", "check")


def _run(capsys, monkeypatch, host_path: bool, args: list[str]) -> tuple[dict, int]:
    calls = []
    real = layer_ops.ComposedLayerOps._decode_host

    def counted(self, works):
        calls.append(len(works))
        return real(self, works)

    monkeypatch.setattr(layer_ops.ComposedLayerOps, "_decode_host", counted)
    monkeypatch.setattr(cpu.HostMemory, "host_arrays", host_path)
    capsys.readouterr()
    assert main(["run", "--backend", "cpu", "--json", "--check", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    return out, len(calls)


@pytest.mark.parametrize("args", [
    ["--prompt-tokens", "64", "--decode-tokens", "24"],
    # 8 slots for 4 experts a token: misses evict every step; some layers take the general path's passes
    ["--prompt-tokens", "40", "--decode-tokens", "24", "--seed", "3", "--set", "memory.expert_cache=8"],
    ["--prompt-tokens", "600", "--decode-tokens", "12", "--seed", "1", "--set", "prefill.chunk=256"],
])
def test_host_decode_is_the_composed_path_bit_for_bit(capsys, monkeypatch, clean_strata_env, args):
    fast, fast_calls = _run(capsys, monkeypatch, True, args)
    slow, slow_calls = _run(capsys, monkeypatch, False, args)
    assert fast_calls == int(args[3]) and slow_calls == 0  # every decode step took the host path, or none did
    assert fast["check"] == "passed"
    for k in FIELDS:
        assert fast[k] == slow[k], k
    assert fast["cache_lookups"] > 0 and fast["outputs_sha256"]
