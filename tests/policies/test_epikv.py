import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

import kvevict
from kvevict import signals
from kvevict.generation import prefill
from kvevict.policies.epikv import rolling_mean, rolling_zscore, scale_band, scale_layer, standardize
from kvevict.policies.h2o import ACCUMULATED
from kvevict.signals import NOTHING
from tests.conftest import greedy, in_position_order, kept_indices, prompt, tiny_model

ATTENTION_FREE = ["hs-variance", "epikv", "band-adaptive", "kv-key-var", "kv-val-var", "lag-kv", "lagkv"]
HIDDEN = ["hs-variance", "epikv", "band-adaptive", "attn-x-hs", "segment-hs"]


def test_rolling_mean_and_zscore_follow_a_hand_computed_series() -> None:
    x = torch.tensor([[1.0, 3.0, 2.0, 6.0]])
    # window 3: [1], [1 3], [1 3 2], [3 2 6]
    torch.testing.assert_close(rolling_mean(x, 3), torch.tensor([[1.0, 2.0, 2.0, 11 / 3]]))
    # z: 0/(0+ε); (3-2)/1; (2-2)/σ; (6-11/3)/σ with σ² = ((3-11/3)² + (2-11/3)² + (6-11/3)²)/3 = 26/9
    expected = torch.tensor([[0.0, 1 / (1 + 1e-6), 0.0, (6 - 11 / 3) / ((26 / 9) ** 0.5 + 1e-6)]])
    torch.testing.assert_close(rolling_zscore(x, 3), expected)


def test_rolling_zscore_matches_a_direct_loop_over_64_values() -> None:
    x = torch.rand(1, 200, generator=torch.Generator().manual_seed(0)) * 10
    z = rolling_zscore(x)
    for t in (0, 1, 63, 64, 199):
        window = x[0, max(0, t - 63) : t + 1].double()
        expected = (x[0, t] - window.mean()) / (window.std(correction=0) + 1e-6)
        assert z[0, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_rolling_mean_behind_zeros_is_the_unpadded_series_bit_for_bit() -> None:
    """A fixed-length history of rows of different lengths (zeros before each row's first
    value, ``end`` per row): each row's means are those of its own series alone, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    lengths, width = (3, 9, 20), 22
    rows = [torch.rand(1, 2, length, generator=generator) * 10 for length in lengths]
    padded = torch.cat([torch.nn.functional.pad(row, (width - row.shape[-1], 0)) for row in rows])
    means = rolling_mean(padded, 8, end=torch.tensor(lengths)[:, None, None])
    for i, row in enumerate(rows):
        assert torch.equal(means[i : i + 1, :, width - row.shape[-1] :], rolling_mean(row, 8))
    assert torch.equal(rolling_mean(padded[2:], 8, end=20)[..., 2:], rolling_mean(rows[2], 8))


@pytest.mark.parametrize(
    ("depth", "a", "b", "band_a", "band_b"),
    [(32, 10, 21, range(7, 14), range(18, 26)), (30, 9, 20, range(7, 13), range(17, 24))],
)
def test_bands_scale_with_depth(depth: int, a: int, b: int, band_a: range, band_b: range) -> None:
    assert (scale_layer(10, depth), scale_layer(21, depth)) == (a, b)
    assert scale_band((7, 13), depth) == tuple(band_a) and scale_band((18, 25), depth) == tuple(band_b)
    config = LlamaConfig(num_hidden_layers=depth)
    epikv, bands = kvevict.make_policy("epikv"), kvevict.make_policy("band-adaptive")
    epikv.bind(config)
    bands.bind(config)
    assert epikv.hidden_layers(depth) == (a, b)
    assert bands.hidden_layers(depth) == (*band_a, *band_b)
    configured = kvevict.make_policy("epikv", layers=(3, 4))
    configured.bind(config)
    assert configured.hidden_layers(depth) == (3, 4)


def test_scores_of_the_hidden_state_family() -> None:
    changes = {0: torch.tensor([[1.0, 3.0, 2.0]]), 1: torch.tensor([[2.0, 2.0, 8.0]])}
    config = LlamaConfig(num_hidden_layers=2)
    policies = {
        "hs-variance": kvevict.make_policy("hs-variance", layers=(0, 1), rolling=2),
        "epikv": kvevict.make_policy("epikv", layers=(0, 1), rolling=2),
        "band-adaptive": kvevict.make_policy("band-adaptive", bands=((0,), (0, 1)), rolling=2),
    }
    for policy in policies.values():
        policy.bind(config)
    # rolling-2 means: layer 0 [1, 2, 2.5], layer 1 [2, 2, 5]
    torch.testing.assert_close(policies["hs-variance"].hidden_scores(changes), torch.tensor([[-1.0, 0.0, -2.5]]))
    # rolling-2 z-scores: layer 0 [0, 1, -1], layer 1 [0, 0, 1] (σ + 1e-6 in the denominators)
    z0, z1 = torch.tensor([[0.0, 1.0, -1.0]]), torch.tensor([[0.0, 0.0, 1.0]])
    torch.testing.assert_close(policies["epikv"].hidden_scores(changes), z0 - z1, atol=1e-5, rtol=0)
    torch.testing.assert_close(policies["band-adaptive"].hidden_scores(changes), z0 - (z0 + z1) / 2, atol=1e-5, rtol=0)


def fake_layer(scores: list[float], prompt_length: int, budget: int | None = None):
    """A decode step (one new token) over entries with these frozen scores."""
    n = len(scores)
    recorder = SimpleNamespace(lookup=lambda positions, end=None: torch.tensor(scores)[positions])
    return SimpleNamespace(
        positions=torch.arange(n)[None, None],
        seen=n,
        prompt_length=prompt_length,
        owner=SimpleNamespace(hidden=recorder),
        state={},
        valid=None,
        head_lengths=lambda: torch.tensor([[n]]),
        num_new=1,
        budget=budget,
    )


@pytest.mark.parametrize(
    ("prompt_length", "budget", "kept"),
    [
        (3, 8, [0, 1, 2, 3, 4, 5, 8, 9]),  # prompt + recent min(128, 2) + the top 3 decode scores
        (7, 8, [0, 2, 3, 4, 5, 6, 8, 9]),  # 7 + 2 > 8: the prompt is scored like the rest
    ],
)
def test_prompt_and_recent_are_kept_and_the_rest_goes_by_score(prompt_length: int, budget: int, kept) -> None:
    scores = [0.0, -9.0, 0.5, 3.0, 2.0, 1.0, 0.9, -1.0, -5.0, -5.0]
    policy = kvevict.make_policy("epikv")
    assert kept_indices(policy.select(fake_layer(scores, prompt_length, budget), None, budget)) == [[kept]]


def test_attn_x_hs_adds_standardised_cumulative_attention_to_z_a() -> None:
    layer = fake_layer([1.0, 0.0, -1.0, 0.0], 0)
    method = kvevict.make_policy("attn-x-hs").method
    method.state(layer)[ACCUMULATED] = torch.tensor([[[3.0, 1.0, 1.0, 3.0]]])
    score = method.score(layer, None)
    torch.testing.assert_close(
        score, standardize(torch.tensor([[[3.0, 1.0, 1.0, 3.0]]])) + torch.tensor([1.0, 0, -1, 0])
    )
    assert standardize(torch.tensor([3.0, 1.0, 1.0, 3.0])).tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)


def count_attention_work(monkeypatch, policy: str, attn: str = "sdpa") -> int:
    calls = []
    for name in ("attention_rows", "column_sums"):
        original = getattr(signals, name)

        def spy(*args, original=original, name=name, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(signals, name, spy)
    model = tiny_model(attn=attn)
    cache = kvevict.EvictionCache(model, policy, budget=40)
    greedy(model, prompt(96), cache, new_tokens=6)
    assert max(cache.layer_lengths()) <= 46
    return len(calls)


@pytest.mark.parametrize("policy", ATTENTION_FREE)
def test_attention_free_policies_do_no_attention_work(policy: str, monkeypatch) -> None:
    assert count_attention_work(monkeypatch, policy) == 0
    assert all(kvevict.make_policy(policy).requirements(phase, True) == NOTHING for phase in ("prefill", "decode"))


def test_attention_requiring_policies_are_counted(monkeypatch) -> None:
    assert count_attention_work(monkeypatch, "h2o") > 0
    assert count_attention_work(monkeypatch, "attn-x-hs") > 0


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
@pytest.mark.parametrize("policy", ATTENTION_FREE)
def test_attention_free_policies_run_on_flash_attention(policy: str, monkeypatch) -> None:
    assert count_attention_work(monkeypatch, policy, attn="flash_attention_2") == 0


def test_decode_eviction_keeps_prompt_recent_and_top_frozen_scores() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("epikv", layers=(0, 1), rolling=8), budget=36)
    twin = kvevict.EvictionCache(model, kvevict.make_policy("epikv", layers=(0, 1), rolling=8), budget=10_000)
    with torch.no_grad():
        for c in (cache, twin):
            model(input_ids=prompt(16), past_key_values=c)
            for step in range(30):
                model(input_ids=torch.tensor([[step % 50 + 3]]), past_key_values=c)
    torch.testing.assert_close(cache.hidden.scores[:, :17], twin.hidden.scores[:, :17])  # before any eviction
    layer = cache.layers[0]
    positions = sorted(layer.positions[0, 0].tolist())  # slots are refilled, so storage order is not position order
    recent = 36 // 4
    assert positions[:16] == list(range(16)) and positions[-recent:] == list(range(46 - recent, 46))
    assert len(positions) == 36 and all(
        torch.equal(in_position_order(layer), in_position_order(other)) for other in cache.layers
    )
    # frozen scores: evicting the lowest each step leaves the top ones of every token that left the window
    middle = cache.hidden.scores[0, 16 : 46 - recent]
    expected = (middle.topk(36 - 16 - recent).indices + 16).sort().values.tolist()
    assert positions[16:-recent] == expected


def test_a_chunked_prompt_keeps_the_chunk_in_flight_and_the_top_frozen_scores_of_the_earlier_ones() -> None:
    """Chunked prefill: a chunk's tokens have no score while it runs through layers up to B (+inf,
    kept); each later chunk evicts the earlier ones down to the budget by frozen score. With
    frozen scores, the retained set is the last chunk plus the top of every earlier token."""
    model = tiny_model()
    policy = kvevict.make_policy("epikv", layers=(0, 1), rolling=8)
    cache = kvevict.EvictionCache(model, policy, budget=40)
    prefill(model, prompt(128), cache, chunk=16)
    assert cache.peak_entries() == 40 + 16
    earlier = cache.hidden.scores[0, :112]
    expected = sorted((earlier.topk(40 - 16).indices).tolist()) + list(range(112, 128))
    for layer in cache.layers:  # every layer runs before B's hook has scored the chunk in flight
        assert all(sorted(head.tolist()) == expected for head in layer.positions[0])
    whole = kvevict.EvictionCache(model, policy, budget=40)
    prefill(model, prompt(128), whole)
    assert whole.layers[0].length == 128  # one pass: the prompt is held whole until decoding (the papers' rule)


def test_a_layer_past_the_hooked_ones_ranks_the_chunk_in_flight_too() -> None:
    """Chunked prefill with layers (0, 0): layer 0 runs before the hook (the chunk in flight is
    unscored, +inf, kept), layer 1 after it (the chunk is scored and ranked with the rest). At
    each chunk but the first, each layer keeps the recent window and its top by that rule."""
    model = tiny_model()
    budget, chunk, length, window = 40, 16, 128, 10
    cache = kvevict.EvictionCache(model, kvevict.make_policy("epikv", layers=(0, 0), rolling=8), budget=budget)
    prefill(model, prompt(length), cache, chunk=chunk)
    scores = cache.hidden.scores[0].tolist()
    assert len(scores) == length
    kept = []
    for layer in cache.layers:
        held = list(range(chunk))  # the first chunk is held whole (it could be the whole prompt)
        for start in range(chunk, length, chunk):
            new = range(start, start + chunk)
            held += new
            scored = layer.layer_idx > 0  # the hook ran before this layer's attention
            value = {p: math.inf if p >= new[-1] + 1 - window or (p in new and not scored) else scores[p] for p in held}
            held = sorted(sorted(held, key=lambda p: -value[p])[:budget])
        positions = in_position_order(layer)[0]
        assert positions.tolist() == [held] * positions.shape[0]  # a score per token: every head keeps the same
        kept.append(held)
    last = set(range(length - chunk, length))
    assert last <= set(kept[0]) and not last <= set(kept[1])  # past the hook, the chunk is ranked too
