import math

import pytest
import torch

import kvevict
from kvevict.policies.lazyeviction import MRI, TIMESTAMP, mri_scores, track_recurrence
from tests.conftest import in_position_order, prompt, tiny_model


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_timestamps_and_mri_follow_a_scripted_attention_stream() -> None:
    timestamp = torch.zeros(1, 1, 3, dtype=torch.int32)
    mri = torch.zeros(1, 1, 3, dtype=torch.int32)
    stream = [[0.6, 0.1, 0.3], [0.1, 0.7, 0.2], [0.9, 0.0, 0.1]]  # α = 0.5
    expected = [([1, 0, 0], [1, 0, 0]), ([1, 2, 0], [1, 2, 0]), ([3, 2, 0], [2, 2, 0])]
    for step, (attention, (ts, interval)) in enumerate(zip(stream, expected), start=1):
        timestamp, mri = track_recurrence(timestamp, mri, torch.tensor([[attention]]), step, alpha=0.5)
        assert timestamp.tolist() == [[ts]] and mri.tolist() == [[interval]]
        assert timestamp.dtype == mri.dtype == torch.int32
    # t = 3: Δ = [0, 1, 3], MRI = [2, 2, 0]
    scores = mri_scores(timestamp, mri, step=3)[0, 0].tolist()
    assert scores[0] == pytest.approx(2 * sigmoid(-1) + 2 * sigmoid(-1))
    assert scores[1] == pytest.approx(2 * sigmoid(-1.5) + 2 * sigmoid(-1))
    assert scores[2] == pytest.approx(0.0, abs=1e-6)  # Δ/1e-5 saturates H1; MRI = 0 gives no H2


def test_eviction_only_at_multiples_of_w_and_the_cache_lives_between_c_and_c_plus_w() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("lazyeviction", window=8), budget=40)
    lengths = []
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)  # decode-time: the prompt is kept whole
        for step in range(1, 25):
            model(input_ids=torch.tensor([[step + 2]]), past_key_values=cache)
            lengths.append(cache.layer_lengths()[0])
            layer = cache.layers[0]
            # the new token starts at t - 1 (produced then) and moves to t if it attends to itself
            assert layer.policy.scorer.state(layer)[TIMESTAMP][0, 0, -1].item() in (step - 1, step)
    assert lengths[:8] == [97, 98, 99, 100, 101, 102, 103, 40]
    assert lengths[8:] == [41, 42, 43, 44, 45, 46, 47, 40] * 2
    assert cache.decode_peak() == 104


def test_keeps_the_last_w_tokens_and_the_top_scores() -> None:
    """Up to the first eviction a non-evicting twin holds exactly the same entries and state."""
    model = tiny_model()
    policy = {"window": 8, "alpha": 0.01}  # about the mean attention over ~100 entries
    cache = kvevict.EvictionCache(model, kvevict.make_policy("lazyeviction", **policy), budget=40)
    twin = kvevict.EvictionCache(model, kvevict.make_policy("lazyeviction", **policy), budget=10_000, interval=8)
    with torch.no_grad():
        for c in (cache, twin):
            model(input_ids=prompt(96), past_key_values=c)
            for step in range(1, 9):  # t = 8 evicts in `cache`
                model(input_ids=torch.tensor([[step + 2]]), past_key_values=c)
    for layer, full in zip(cache.layers, twin.layers):
        scores = mri_scores(full.policy.scorer.state(full)[TIMESTAMP], full.policy.scorer.state(full)[MRI], 8)
        scores[..., -8:] = float("inf")  # the last W tokens stay
        # ties go to the earlier entry
        expected = scores.argsort(dim=-1, descending=True, stable=True)[..., :40].sort(dim=-1).values
        assert torch.equal(in_position_order(layer), full.positions.gather(2, expected).sort(dim=-1).values)
        assert torch.equal(
            in_position_order(layer, layer.policy.scorer.state(layer)[MRI]),
            full.policy.scorer.state(full)[MRI].gather(2, expected),
        )
        assert in_position_order(layer)[0, 0, -8:].tolist() == list(range(96, 104))
    assert any(full.policy.scorer.state(full)[MRI].max() > 1 for full in twin.layers)  # recurrences were seen


@pytest.mark.parametrize(("model_type", "alpha"), [("llama", 5e-4), ("qwen3", 1e-4), ("mistral", 5e-4)])
def test_alpha_follows_the_model_family(model_type: str, alpha: float) -> None:
    from transformers import AutoConfig

    policy = kvevict.make_policy("lazyeviction")
    policy.bind(AutoConfig.for_model(model_type))
    assert policy.method.alpha == alpha


@pytest.mark.parametrize(("budget", "window"), [(64, 16), (128, 32), (4096, 32)])
def test_window_and_interval_scale_with_small_budgets(budget: int, window: int) -> None:
    policy = kvevict.make_policy("lazyeviction")
    assert policy.recent_window(budget) == window and policy.default_interval(budget) == window
    policy.check_budget(budget)
