"""Every composition does what its name says, or is refused when built (issue 13, DESIGN §1.9).

The enumeration spells every prefix and every ordered pair of prefixes over every registered
method: each spelling is either refused by ``make_policy`` (a ``ValueError`` naming the
clash) or passes the contract: an ample budget is bit-identical to no eviction, and with
eviction the logits equal attention recomputed over exactly the retained entries. Spellings
that differ only in the order of their prefixes build the same policy, so the contract runs
once per policy.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.policies import POLICIES, PREFIXES
from kvevict.policies.critical import ATTENTION_SCORERS
from tests.conftest import (
    assert_next_logits_match_reference,
    build_policy,
    greedy,
    prompt,
    reference_logits,
    tiny_model,
)

PROMPT, BUDGET, STEPS = 64, 40, 3
PREFIX_SPELLINGS = [(prefix,) for prefix in PREFIXES] + list(itertools.product(PREFIXES, repeat=2))
SPELLINGS = ["+".join([*prefixes, base]) for prefixes in PREFIX_SPELLINGS for base in POLICIES]


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model()


@pytest.fixture(scope="module")
def contract(model):
    """``contract(policy)`` checks the contract once per policy (by name and parameters)."""
    ids = prompt(PROMPT)
    expected = greedy(model, ids, DynamicCache(), new_tokens=STEPS)
    checked: dict[str, bool] = {}

    def check(policy: kvevict.Policy) -> None:
        key = f"{policy.name} {policy.params()}"
        if key in checked:
            return
        ample = kvevict.EvictionCache(model, policy, budget=PROMPT + STEPS, interval=1)
        sequences, logits = greedy(model, ids, ample, new_tokens=STEPS)
        assert ample.layer_lengths() == [PROMPT + STEPS - 1] * 2  # nothing was evicted
        if any(stage.acts_alone for stage in policy.named):  # ThinK prunes key channels whatever the budget:
            assert_next_logits_match_reference(model, ample, sequences[:, -1:])  # exact over them (ratio 0: test_think)
        else:
            assert torch.equal(sequences, expected[0]) and torch.equal(logits, expected[1])
        if not policy.method.evicts:
            return
        cache = kvevict.EvictionCache(model, policy, budget=BUDGET, interval=1)
        sequences, _ = greedy(model, ids, cache, new_tokens=STEPS)
        held = sum(int(layer.head_lengths().sum()) for layer in cache.eviction_layers)
        assert held < 2 * 2 * (PROMPT + STEPS - 1)  # evicted for real
        token = sequences[:, -1:]
        reference = reference_logits(model, cache, token)
        with torch.no_grad():
            logits = model(input_ids=token, past_key_values=cache).logits[:, -1]
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
        cache.close()
        ample.close()
        checked[key] = True

    return check


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_is_refused_when_built_or_keeps_the_contract(spelling: str, contract) -> None:
    try:
        policy = build_policy(spelling)
    except ValueError as refusal:
        assert str(refusal).startswith(f"{spelling}: "), refusal  # says which spelling, then why
        return
    *prefixes, base = spelling.split("+")
    assert policy.method.name == base and sorted(stage.name for stage in policy.named) == sorted(prefixes)
    reordered = build_policy("+".join([*reversed(prefixes), base]))  # order of prefixes is irrelevant
    assert (reordered.name, reordered.params()) == (policy.name, policy.params())
    contract(policy)


@pytest.mark.parametrize(
    ("spelling", "clash"),
    [
        ("adakv+pyramidkv+snapkv", "adakv and pyramidkv are both allocators"),
        ("headkv+headkv+h2o", "headkv and headkv are both allocators"),
        ("critical+critical+h2o", "critical and critical are both selectors"),
        ("moment-nc+moment-nc+h2o", "moment-nc and moment-nc are both correctors"),
        (
            "critical+momentkv",
            "critical and momentkv's own momentkv-mi are both selectors .* critical\\+momentkv\\[mi=false\\]",
        ),
        (
            "moment-nc+momentkv",
            "moment-nc and momentkv's own moment-nc are both correctors .*\\+momentkv\\[nc=false\\]",
        ),
        ("critical+thinkv", "critical and thinkv's own thinkv-quotas are both selectors"),
        ("critical+lagkv", "critical and lagkv's own lagkv-quotas are both selectors"),
        ("critical+knorm", "critical weights attention scores .* knorm's scores are not attention received"),
        ("critical+adakv+rkv", "critical weights attention scores .* rkv's scores are not attention"),
        ("adakv+lagkv", "adakv shares each layer's budget across heads .* use pyramidkv or headkv"),
        ("adakv+full", "full never evicts, so adakv would have nothing to do"),
        ("adakv+momentkv[allocation=uniform]", "adakv and momentkv's own uniform are both allocators"),
        ("pyramidkv+momentkv[safeguard=0.3]", "pyramidkv and momentkv's own adakv are both allocators"),
    ],
)
def test_a_refused_composition_names_the_clash_and_what_is_allowed(spelling: str, clash: str) -> None:
    with pytest.raises(ValueError, match=clash):
        build_policy(spelling)


def test_critical_works_over_the_attention_scorers_it_names() -> None:
    accepted = []
    for base in POLICIES:
        try:
            build_policy(f"critical+{base}")
        except ValueError:
            continue
        accepted.append(base)
    assert accepted == ["tova", "h2o", "snapkv", "observed-attention"]  # and momentkv without its MI loop:
    build_policy("critical+momentkv[mi=false]")
    assert ATTENTION_SCORERS.startswith(", ".join(accepted) + ", momentkv[mi=false]")


@pytest.mark.parametrize("allocator", ["adakv", "pyramidkv", "headkv"])
@pytest.mark.parametrize("base", ["snapkv", "h2o"])
def test_allocator_and_critical_in_either_order_keep_the_same_entries(allocator: str, base: str, model) -> None:
    kept = {}
    for spelling in (f"{allocator}+critical+{base}", f"critical+{allocator}+{base}", f"{allocator}+{base}"):
        cache = kvevict.EvictionCache(model, build_policy(spelling), budget=BUDGET)
        greedy(model, prompt(PROMPT), cache, new_tokens=STEPS)
        kept[spelling] = [(layer.positions, layer.valid) for layer in cache.eviction_layers]
    first, second, without = kept.values()
    for (positions, valid), (positions2, valid2) in zip(first, second):
        assert torch.equal(positions, positions2)
        assert (valid is None and valid2 is None) or torch.equal(valid, valid2)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, without))  # critical takes effect


def test_an_allocator_named_over_momentkv_takes_the_place_of_its_default() -> None:
    assert type(build_policy("momentkv").allocator).__name__ == "AdaKV"
    policy = build_policy("pyramidkv+momentkv")
    assert type(policy.allocator).__name__ == "PyramidKV" and type(policy.selector).__name__ == "MomentMI"
    assert build_policy("adakv+momentkv[adakv.safeguard=0.5]").allocator.safeguard == 0.5
