"""ModelSpec sources: the inline block of a scenario, and dispatch between presets and GGUF files."""

import pytest

from strata_core.errors import BadInput
from strata_core.models.gguf import write_tiny_moe_gguf
from strata_core.models.resolve import model_from_name, resolve_model
from strata_core.models.spec import ModelSpec

INLINE = {"moe_layers": 48, "experts_per_layer": 512, "top_k": 10, "hidden": 4096, "slot_bytes": 2065000,
          "largest_blob_bytes": 2667570, "prompt_bytes_per_token": 450560}


def test_inline_block_round_trips_through_json():
    s = ModelSpec.from_json(dict(INLINE, quant="IQ3_S"))
    assert s.experts_total == 48 * 512 and s.experts_total_bytes == 48 * 512 * 2065000
    assert ModelSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize("field", sorted(INLINE))
def test_inline_block_names_the_missing_field(field):
    d = {k: v for k, v in INLINE.items() if k != field}
    with pytest.raises(BadInput, match=f"'{field}'"):
        ModelSpec.from_json(d, where="s.json: model")


def test_inline_block_refuses_absurd_values():
    with pytest.raises(BadInput, match="top_k"):
        ModelSpec.from_json(dict(INLINE, top_k=600))
    with pytest.raises(BadInput, match="largest_blob_bytes"):
        ModelSpec.from_json(dict(INLINE, largest_blob_bytes=1))


def test_resolve_model_picks_presets_and_gguf_files(tmp_path):
    assert resolve_model("Mixtral-8x7B", "Q8_0") == model_from_name("Mixtral-8x7B@Q8_0")
    p = write_tiny_moe_gguf(tmp_path / "m.gguf", layers=1, experts=4, top_k=1, hidden=32, ffn=32, vocab=8)
    assert resolve_model(str(p)).source.startswith("gguf:")
    with pytest.raises(BadInput, match="--quant"):
        resolve_model(str(p), "Q4_K")
