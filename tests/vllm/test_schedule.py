"""The schedule the plug-in's scheduler and workers share is kvevict's own cache's: after every
step, each head of an :class:`~kvevict.cache.EvictionCache` holds what
:meth:`~kvevict.vllm.schedule.EvictionSchedule.held` says (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.vllm.config import EvictionSettings
from kvevict.vllm.schedule import EvictionSchedule
from tests.conftest import prompt, tiny_model


def test_held_by_hand() -> None:
    schedule = EvictionSchedule(prompt_length=100, budget=64, interval=16, at_prefill=True, at_decode=True)
    assert [schedule.held(t) for t in (50, 100, 101, 115, 116, 117)] == [50, 64, 65, 79, 64, 65]
    assert schedule.first_decode_eviction == 16
    short = EvictionSchedule(prompt_length=40, budget=64, interval=16, at_prefill=True, at_decode=True)
    assert short.after_prompt == 40 and short.first_decode_eviction == 32  # 40 + 32 = 72 > 64 at a multiple of 16
    assert [short.held(t) for t in (40, 71, 72, 73, 88)] == [40, 71, 64, 65, 64]
    prefill_only = EvictionSchedule(prompt_length=100, budget=64, interval=1, at_prefill=True, at_decode=False)
    assert prefill_only.held(150) == 64 + 50
    ample = EvictionSchedule(prompt_length=100, budget=None, interval=1, at_prefill=True, at_decode=True)
    assert [ample.held(t) for t in (100, 180)] == [100, 180]


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        EvictionSchedule(0, 8, 1, True, True)
    with pytest.raises(ValueError, match="interval must be"):
        EvictionSchedule(10, 8, 0, True, True)


@pytest.mark.parametrize(
    ("policy", "settings", "prompt_length"),
    [
        ("streamingllm", {"budget": 40, "interval": 8}, 80),
        ("streamingllm", {"budget": 40, "interval": 8}, 20),  # evicts only while decoding
        ("h2o", {"budget": 40}, 60),  # every step
        ("tova", {"keep": 0.5, "interval": 3}, 70),
        ("snapkv", {"budget": 40}, 80),  # at prefill only
    ],
)
def test_the_schedule_is_what_the_cache_holds(policy: str, settings: dict, prompt_length: int) -> None:
    model = tiny_model()
    schedule = EvictionSettings.parse({"policy": policy, **settings}).schedule(prompt_length)
    cache = kvevict.EvictionCache(model, policy, **settings)
    tokens = prompt(prompt_length + 50, seed=3)
    with torch.no_grad():
        model(input_ids=tokens[:, :prompt_length], past_key_values=cache)
        assert cache.layer_lengths() == [schedule.held(prompt_length)] * 2
        for seen in range(prompt_length + 1, prompt_length + 50):
            model(input_ids=tokens[:, seen - 1 : seen], past_key_values=cache)
            assert cache.layer_lengths() == [schedule.held(seen)] * 2, seen


@pytest.mark.parametrize(
    "schedule",
    [
        EvictionSchedule(prompt_length=100, budget=64, interval=16, at_prefill=True, at_decode=True),
        EvictionSchedule(prompt_length=40, budget=64, interval=16, at_prefill=True, at_decode=True),
        EvictionSchedule(prompt_length=100, budget=64, interval=5, at_prefill=False, at_decode=True),
        EvictionSchedule(prompt_length=100, budget=64, interval=1, at_prefill=True, at_decode=False),
        EvictionSchedule(prompt_length=30, budget=None, interval=1, at_prefill=True, at_decode=True),
    ],
)
def test_the_peak_is_the_most_held_during_any_pass(schedule: EvictionSchedule) -> None:
    prompt = schedule.prompt_length
    for most in range(1, prompt + 90):
        during = [min(most, prompt)] + [schedule.held(t - 1) + 1 for t in range(prompt + 1, most + 1)]
        assert schedule.peak(most) == max(during), most
        assert schedule.evicts_within(most) == (schedule.held(most) < most)
