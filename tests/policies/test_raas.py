from types import SimpleNamespace

import pytest
import torch

import kvevict
from kvevict.policies.raas import TIMESTAMP, raas_update, reference_median
from kvevict.signals import Signals, attention_rows, group_reduce
from tests.conftest import capture_passes, in_position_order, prompt, tiny_model


def test_median_rule_follows_a_scripted_attention_stream() -> None:
    timestamp = torch.zeros(1, 1, 4, dtype=torch.int32)
    everything = torch.ones(1, 1, 4, dtype=torch.bool)
    decode_only = torch.tensor([[[False, True, True, True]]])  # entry 0 is a prompt entry
    stream = [
        ([0.1, 0.4, 0.2, 0.3], everything, [0, 1, 0, 1]),  # median (.2 + .3) / 2 = .25
        ([0.5, 0.1, 0.3, 0.1], everything, [2, 1, 2, 1]),  # median (.1 + .3) / 2 = .2
        ([0.9, 0.2, 0.5, 0.3], decode_only, [3, 1, 3, 3]),  # median of .2 .5 .3 = .3; entry 0 still refreshed
    ]
    for step, (attention, reference, expected) in enumerate(stream, start=1):
        timestamp = raas_update(timestamp, torch.tensor([[attention]]), step, reference)
        assert timestamp.tolist() == [[expected]] and timestamp.dtype == torch.int32


@pytest.mark.parametrize("values", ["uniform", "ties", "wide", "nan"])
def test_reference_median_is_nanquantile_bit_for_bit(values: str) -> None:
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        n, heads = (
            int(torch.randint(1, 40, (1,), generator=generator)),
            int(torch.randint(1, 5, (1,), generator=generator)),
        )
        x = torch.rand(2, heads, n, generator=generator)
        if values == "ties":  # few distinct values, even and odd counts
            x = torch.randint(0, 4, (2, heads, n), generator=generator).float() / 7
        elif values == "wide":
            x = torch.randn(2, heads, n, generator=generator) * 10.0 ** int(
                torch.randint(-30, 30, (1,), generator=generator)
            )
        elif values == "nan":
            x[x < 0.1] = float("nan")
        share = float(torch.rand(1, generator=generator))  # from heads with no reference entry to all of them
        reference = None if trial % 3 == 0 else torch.rand(2, heads, n, generator=generator) < share
        masked = x if reference is None else x.masked_fill(~reference, float("nan"))
        expected = torch.nanquantile(masked, 0.5, dim=-1, keepdim=True)
        median = reference_median(x, reference)
        assert torch.equal(median.isnan(), expected.isnan())
        assert torch.equal(median.nan_to_num().view(torch.int32), expected.nan_to_num().view(torch.int32))


def test_alpha_rule_follows_a_scripted_attention_stream() -> None:
    timestamp = torch.zeros(1, 1, 4, dtype=torch.int32)
    stream = [([0.1, 0.4, 0.2, 0.3], [0, 1, 0, 1]), ([0.5, 0.1, 0.29, 0.1], [2, 1, 0, 1])]
    for step, (attention, expected) in enumerate(stream, start=1):
        timestamp = raas_update(timestamp, torch.tensor([[attention]]), step, alpha=0.3)
        assert timestamp.tolist() == [[expected]] and timestamp.dtype == torch.int32


def fake_layer(policy, timestamps: list[int], prompt_length: int, num_kv_heads: int = 1, passes: int = 2):
    n = len(timestamps)
    layer = SimpleNamespace(
        state={},
        positions=torch.arange(n)[None, None],
        prompt_length=prompt_length,
        seen=n,
        decode_step=n - prompt_length,
        passes=passes,
        phase=lambda: "prefill" if passes == 1 else "decode",
        num_kv_heads=num_kv_heads,
        valid=None,
        head_lengths=lambda: torch.tensor([[n]]),
    )
    policy.scorer.state(layer)[TIMESTAMP] = torch.tensor([[timestamps]], dtype=torch.int32)
    return layer


def test_observe_reduces_the_group_by_max_and_takes_the_median_of_decode_tokens() -> None:
    policy = kvevict.make_policy("raas")
    layer = fake_layer(policy, [-1, -1, 1, 2], prompt_length=2)
    rows = torch.tensor([[[0.1, 0.6, 0.1, 0.2], [0.5, 0.1, 0.2, 0.2]]])  # Hq = 2 → Hkv = 1
    signals = Signals(phase="decode", num_new=1, query=torch.zeros(1, 2, 1, 4), scaling=1.0)
    signals.last_query_attention = rows
    # max [.5 .6 .2 .2], median of the decode entries .2 → all refreshed (the mean would
    # give [.3 .35 .15 .2], median .175, and leave entry 2 at 1)
    policy.observe(layer, signals)
    assert policy.scorer.state(layer)[TIMESTAMP].tolist() == [[[2, 2, 2, 2]]]


@pytest.mark.parametrize(
    ("timestamps", "prompt_length", "kept"),
    [
        ([-1, -1, 3, 1, 2, 5], 2, [0, 1, 2, 5]),  # prompt kept + the two newest timestamps
        ([-1, -1, 2, 2, 2, 1], 2, [0, 1, 3, 4]),  # ties: the more recent positions stay
        ([-1, 3, -1, -1, 2, 4], 4, [1, 3, 4, 5]),  # prompt too long for the budget: scored too
    ],
)
def test_evicts_the_oldest_timestamp(timestamps: list[int], prompt_length: int, kept: list[int]) -> None:
    policy = kvevict.make_policy("raas")  # reserve at budget 4: min(128, 1) = 1
    layer = fake_layer(policy, timestamps, prompt_length)
    assert policy.select(layer, None, 4)[0, 0].nonzero().flatten().tolist() == kept


@pytest.mark.parametrize(
    ("prompt_length", "budget", "reserve", "kept"),
    [(48, 64, None, True), (49, 64, None, False), (896, 1024, None, True), (897, 1024, None, False), (60, 64, 4, True)],
)
def test_prompt_is_protected_only_when_it_leaves_room_to_decode(
    prompt_length: int, budget: int, reserve: int | None, kept: bool
) -> None:
    assert kvevict.make_policy("raas", reserve=reserve).protector.keeps_prompt(prompt_length, budget) is kept


def test_timestamps_in_a_model_follow_the_rule_and_eviction_keeps_prompt_and_newest() -> None:
    """A non-evicting twin tracks the same timestamps; at the first eviction the cache keeps
    the prompt plus the decode tokens with the newest (timestamp, position)."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "raas", budget=30)  # reserve 7: the 20-token prompt is kept
    twin = kvevict.EvictionCache(model, "raas", budget=10_000)
    passes = capture_passes(twin.layers[0])
    with torch.no_grad():
        for c in (cache, twin):
            model(input_ids=prompt(20), past_key_values=c)
            for step in range(1, 12):  # step 11 holds 31 entries: the first eviction
                model(input_ids=torch.tensor([[step + 2]]), past_key_values=c)
    # replay the rule on layer 0 from the captured queries and keys
    timestamp = torch.full((1, 2, 20), -1, dtype=torch.int32)
    for step, captured in enumerate(passes[1:], start=1):
        timestamp = torch.cat([timestamp, torch.full((1, 2, 1), step, dtype=torch.int32)], dim=-1)
        rows = attention_rows(captured["query"][:, :, -1:], captured["keys"], captured["scaling"])[:, :, 0]
        reference = captured["positions"] >= 20
        timestamp = raas_update(timestamp, group_reduce(rows, 2, "max"), step, reference)
    assert torch.equal(twin.layers[0].policy.scorer.state(twin.layers[0])[TIMESTAMP], timestamp)
    assert timestamp.unique().numel() > 3  # the rule did refresh timestamps
    for layer, full in zip(cache.layers, twin.layers):
        key = full.policy.scorer.state(full)[TIMESTAMP].double() * 32 + full.positions.double()
        key[..., :20] = float("inf")
        expected = key.topk(30, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(in_position_order(layer), full.positions.gather(2, expected).sort(dim=-1).values)
        assert torch.equal(
            in_position_order(layer, layer.policy.scorer.state(layer)[TIMESTAMP]),
            full.policy.scorer.state(full)[TIMESTAMP].gather(2, expected),
        )
        assert in_position_order(layer)[0, 0, :20].tolist() == list(range(20))
    assert cache.layer_lengths() == [30, 30]


def test_evicts_every_step_and_both_regime_compresses_the_prompt() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("raas", regime="both"), budget=40)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
        assert cache.layer_lengths() == [40, 40]
        assert set(cache.layers[0].policy.scorer.state(cache.layers[0])[TIMESTAMP].unique().tolist()) <= {-1, 0}
        for step in range(1, 4):
            model(input_ids=torch.tensor([[step + 2]]), past_key_values=cache)
            assert cache.layer_lengths() == [40, 40]
    assert cache.decode_peak() == 41


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match=r"raas: parameter 'alpha' expects a number in \(0, 1\), or None"):
        kvevict.make_policy("raas", alpha=1.5)
    with pytest.raises(ValueError, match="raas: parameter 'reserve' expects an integer >= 1, or None"):
        kvevict.make_policy("raas", reserve=0)
    with pytest.raises(ValueError, match="raas: parameter 'regime' expects one of 'decode', 'both', got 'prefill'"):
        kvevict.make_policy("raas", regime="prefill")
