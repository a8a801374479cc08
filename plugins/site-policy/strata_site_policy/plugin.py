"""The site policy: cap the prompt chunk and keep a larger VRAM reserve on every machine of the fleet.

It provides no backend; it only tightens the draft plan (`draft.tighten`), which records a Decision naming this
plugin as its source. It runs before other site plugins (`tryfirst=True`) so theirs can tighten further still.
It imports only strata-core's contract (`strata_core.api`, API 2.0).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata_core.api import PlanDraft, Target, hookimpl

MIB = 1 << 20


@dataclass(frozen=True)
class FleetPolicy:
    """The fleet's limits. Each only ever tightens a plan."""

    #: Largest prompt chunk, tokens: the fleet's shared GPUs also drive displays, and smaller loans leave decode room.
    chunk_cap_tokens: int = 4096
    #: Smallest VRAM reserve, bytes: the fleet's monitoring agents and display compositors take VRAM after start-up.
    min_vram_reserve_bytes: int = 1024 * MIB


POLICY = FleetPolicy()


@hookimpl(tryfirst=True)
def strata_adjust_plan(draft: PlanDraft, target: Target) -> None:
    """Cap the chunk at the policy's and raise the VRAM reserve to the policy's minimum, where the draft is looser.

    The fleet's limits hold on every machine, so `target` (what is planned for) does not change them.
    """
    cap = draft.get("prompt.chunk_cap_tokens")
    if cap is None or cap > POLICY.chunk_cap_tokens:
        draft.tighten("prompt.chunk_cap_tokens", POLICY.chunk_cap_tokens,
                      f"fleet policy: prompt chunks of at most {POLICY.chunk_cap_tokens} tokens")
    reserve = draft.get("vram.reserve_bytes")
    if reserve is None or reserve < POLICY.min_vram_reserve_bytes:
        draft.tighten("vram.reserve_bytes", POLICY.min_vram_reserve_bytes,
                      f"fleet policy: keep at least {POLICY.min_vram_reserve_bytes // MIB} MiB of VRAM free")
