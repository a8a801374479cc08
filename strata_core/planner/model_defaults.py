"""Settings a model brings with it: one path, so `strata plan` shows what `strata run` uses for the same model.

A model default sits above the core's and the backend's defaults and below every explicit source (flag, environment,
TOML, scenario): the tiny model runs with half its experts cached, so misses, loans and the ring always run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from strata_core.config import LoadedSettings, Provenance
from strata_core.models.spec import ModelSpec

#: The provenance source of a value a model default set.
MODEL_DEFAULT = "model-default"


def model_setting_defaults(spec: ModelSpec) -> dict[str, tuple[Any, str]]:
    """dotted key -> (value, why) of the settings this model defaults."""
    if spec.source == "tiny":
        from strata_core.models.synthetic import tiny_cache_slots
        return {"memory.expert_cache": (tiny_cache_slots(spec), "the tiny model caches half its experts, so misses, "
                                                                "loans and the ring run on every machine")}
    return {}


def with_model_defaults(loaded: LoadedSettings, spec: ModelSpec) -> LoadedSettings:
    """`loaded` with the model's defaults applied where no explicit source set the key."""
    defaults = model_setting_defaults(spec)
    if not defaults:
        return loaded
    values = loaded.settings.model_dump()
    origins = dict(loaded.origins)
    for key, (value, why) in defaults.items():
        prov = origins.get(key)
        if prov is not None and prov.source not in ("default", "backend-default"):
            continue
        group, leaf = key.split(".", 1)
        values[group][leaf] = value
        origins[key] = Provenance(MODEL_DEFAULT, f"{spec.name}: {why}")
    return replace(loaded, settings=type(loaded.settings)(**values), origins=origins)
