"""The view protocol (kvevict.views): every view a policy's hooks receive, whatever it holds (a row,
rows in lockstep, a stack of layers' rows), has every attribute :class:`EntryView` declares,
shaped ``[B, Hkv, n, ...]``; the cache offers what :class:`CacheSide` and :class:`ScoringCache` declare."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.policies.h2o import H2O
from kvevict.rows import LayerStack, RowView
from kvevict.views import CacheSide, EntryView, ScoringCache
from tests.conftest import left_padded, padded_positions, prompt, tiny_model


def declared(protocol: type) -> set[str]:
    """The attributes, properties and methods ``protocol`` declares."""
    members = {name for name, value in vars(protocol).items() if isinstance(value, property) or callable(value)}
    return {name for name in {*protocol.__annotations__, *members} if not name.startswith("_")}


def test_the_protocols_declare_what_policies_read() -> None:
    assert {"keys", "values", "positions", "valid", "state", "seen", "budget", "memo", "owner"} <= declared(EntryView)
    assert {"phase", "head_lengths", "decode_step", "num_kv_heads", "length", "layer_idx"} <= declared(EntryView)
    assert declared(CacheSide) == {"policy", "shared", "hidden", "rotary", "eviction_layers"}
    assert "scoring_pass" in declared(ScoringCache) and "deferred" in declared(ScoringCache)


class Recorder(H2O):
    """H2O that keeps every view its hooks are given."""

    name = "h2o-recorder"
    stackable = True
    batched = True

    def __init__(self, **params: object):
        super().__init__(**params)
        self.views: list[EntryView] = []

    def observe(self, layer, signals) -> None:
        self.views.append(layer)
        super().observe(layer, signals)

    def score(self, layer, signals) -> torch.Tensor:
        self.views.append(layer)
        return super().score(layer, signals)


def assert_is_a_view(view: EntryView) -> None:
    # dir(): present without being read (a stack of layers refuses to read a single layer's index)
    missing = declared(EntryView) - set(dir(view))
    assert not missing, (type(view).__name__, missing)
    b, h, n = view.positions.shape
    assert view.positions.dtype == torch.int64
    assert view.keys.shape[:3] == view.values.shape[:3] == (b, h, n)
    assert view.valid is None or (view.valid.shape == (b, h, n) and view.valid.dtype == torch.bool)
    assert all(tensor.shape[:3] == (b, h, n) for tensor in view.state.values()) and view.state
    for counter in (view.seen, view.prompt_length):
        assert isinstance(counter, int) or counter.shape == (b, 1, 1)
    assert view.num_kv_heads == h and view.length == n and view.head_lengths().shape == (b, h)
    assert view.phase() in ("prefill", "decode") and view.policy is view.owner.policy
    missing = declared(CacheSide) - set(dir(view.owner))
    assert not missing, (type(view.owner).__name__, missing)


@pytest.mark.parametrize("batch", [1, 3])
def test_every_view_a_policy_is_given_has_every_attribute_of_the_protocol(batch: int) -> None:
    model = tiny_model()
    ids, mask = left_padded([prompt(length, seed=seed) for seed, length in enumerate((40, 30, 35)[:batch])])
    cache = kvevict.EvictionCache(model, kvevict.Policy(Recorder()), budget=24, interval=1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask), past_key_values=cache)
        for _ in range(4):
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
            token = out.logits[:, -1:].argmax(-1)
            out = model(
                input_ids=token, attention_mask=mask, position_ids=cache.next_positions(), past_key_values=cache
            )
    views = cache.policy.scorer.views
    assert {RowView, LayerStack} <= {type(view) for view in views}  # rows of a layer, and the layers stacked
    for view in views:
        assert_is_a_view(view)


def test_the_cache_offers_what_a_policys_scoring_pass_uses() -> None:
    cache = kvevict.EvictionCache(tiny_model(), "kvzip", budget=24)
    assert not (declared(ScoringCache) | declared(CacheSide)) - set(dir(cache))
