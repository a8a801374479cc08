"""A model by name or path: a GGUF file (read for its spec) or a preset (computed from its published config).

The one place that knows both sources, so `spec` (the ModelSpec record) imports neither and `presets` and `gguf`
import only `spec`: the models package has no import circle.
"""

from __future__ import annotations

from pathlib import Path

from strata_core.errors import BadInput
from strata_core.models import presets
from strata_core.models.gguf import model_from_gguf
from strata_core.models.spec import ModelSpec

__all__ = ["list_presets", "model_from_gguf", "model_from_name", "resolve_model"]


def model_from_name(name: str, quant: str | None = None) -> ModelSpec:
    """A preset by name ('Qwen3-30B-A3B' or 'Qwen3-30B-A3B@Q4_K'); see strata_core.models.presets."""
    return presets.model_from_name(name, quant)


def list_presets() -> tuple[str, ...]:
    """The names of the built-in presets."""
    return presets.list_presets()


def resolve_model(name_or_path: str | Path, quant: str | None = None) -> ModelSpec:
    """A GGUF file when the argument names one (ends in .gguf), else a preset."""
    if str(name_or_path).lower().endswith(".gguf"):
        if quant:
            raise BadInput(f"--quant: a GGUF file carries its own quant; drop --quant {quant}")
        return model_from_gguf(name_or_path)
    return model_from_name(str(name_or_path), quant)
