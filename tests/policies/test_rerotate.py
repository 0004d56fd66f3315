import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.policies.rerotate import shifts
from tests.conftest import prompt, tiny_model


def test_a_kept_entry_moves_by_the_entries_evicted_after_it() -> None:
    positions = torch.tensor([[[5, 0, 3, 1, 4, 2]]])  # storage order is not position order
    evicted = torch.tensor([[[False, False, True, True, True, False]]])  # positions 3, 1, 4
    # kept: 5 (nothing after it), 0 (1, 3, 4 after it), 2 (3, 4 after it)
    assert shifts(positions, evicted, None)[evicted.logical_not()].tolist() == [0, 3, 2]
    held = torch.tensor([[[True, True, True, True, True, False]]])  # position 2 is padding: never counted
    assert shifts(positions, evicted, held)[0, 0, :2].tolist() == [0, 3]


def test_the_kept_keys_are_the_keys_of_their_tokens_at_contiguous_positions() -> None:
    """Layer 0's keys depend only on a token and its position: after StreamingLLM keeps the 4
    sinks and the 8 most recent of 40 tokens, re-rotated, the sinks' keys are their tokens' keys at
    positions 28..31, and the recent ones are where they were (32..39)."""
    model, ids = tiny_model(), prompt(40)
    cache = kvevict.EvictionCache(model, kvevict.make_policy("rerotate+streamingllm", sinks=4), budget=12)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        moved = DynamicCache()
        model(input_ids=ids[:, :4], position_ids=torch.arange(28, 32)[None], past_key_values=moved)
        plain = DynamicCache()
        model(input_ids=ids, past_key_values=plain)
    layer = cache.eviction_layers[0]
    order = layer.positions[0, 0].argsort()
    kept = layer.keys[0][:, order]  # [Hkv, 12, d] in position order
    torch.testing.assert_close(kept[:, :4], moved.layers[0].keys[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(kept[:, 4:], plain.layers[0].keys[0, :, 32:], rtol=0, atol=0)


def test_what_it_cannot_rotate_is_refused_in_one_line() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="rerotate rewrites the kept keys, which a quantized cache holds as codes"):
        kvevict.EvictionCache(model, "rerotate+streamingllm", budget=16, quant="int4")
    with pytest.raises(ValueError, match="rerotate rotates keys as each layer evicts, and kvzip scores"):
        kvevict.make_policy("rerotate+kvzip")
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="a RoPE whose angle grows linearly .* this model's is dynamic") as refused:
        kvevict.EvictionCache(model, "rerotate+streamingllm", budget=16)
    assert "\n" not in str(refused.value)
