import torch

import kvevict
from kvevict.policies.tova import tova_scores
from kvevict.signals import attention_rows
from tests.conftest import capture_passes, prompt, tiny_model


def test_tova_score_is_the_mean_over_all_query_heads() -> None:
    rows = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.4, 0.4, 0.2]])[None]  # [1, 4, 3]
    scores = tova_scores(rows, num_kv_heads=2)
    torch.testing.assert_close(scores, torch.tensor([[[0.3, 0.375, 0.325]] * 2]))


def test_tova_evicts_the_least_attended_entry_every_step() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "tova", budget=40)
    layer = cache.layers[0]
    passes = capture_passes(layer)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
        model(input_ids=torch.tensor([[5]]), past_key_values=cache)
    step = passes[-1]
    rows = attention_rows(step["query"], step["keys"], step["scaling"])[:, :, 0]
    dropped = tova_scores(rows, 2).argmin(dim=-1)  # [1, Hkv]
    assert layer.length == 40
    for head in range(2):
        kept = step["positions"][0, head].tolist()
        del kept[dropped[0, head].item()]
        assert sorted(layer.positions[0, head].tolist()) == sorted(kept)  # the new entry refills the dropped slot
