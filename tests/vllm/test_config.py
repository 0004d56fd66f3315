"""The plug-in's settings (``additional_config["kvevict"]``): parsed, and bad ones refused in one
line naming what is allowed (no vLLM needed; the engine-level refusals: test_plugin.py)."""

from __future__ import annotations

import pytest

from kvevict.budgets import Budget
from kvevict.vllm.config import EvictionSettings, settings_of


def test_settings_are_read_from_additional_config() -> None:
    assert settings_of({}) is None and settings_of({"other": 1}) is None
    settings = settings_of({"kvevict": {"policy": "h2o", "budget": 256, "interval": 16}})
    assert settings == EvictionSettings("h2o", Budget(256), 16)
    assert settings.schedule(1000).budget == 256 and settings.schedule(1000).interval == 16
    keep = EvictionSettings.parse({"policy": "snapkv", "keep": 0.25})
    assert keep.schedule(1000).budget == 250 and keep.schedule(1000).interval == 1


def test_interval_overrides_the_policy_s_own_schedule() -> None:
    assert EvictionSettings.parse({"policy": "streamingllm", "budget": 64}).schedule(100).interval == 1
    assert EvictionSettings.parse({"policy": "streamingllm", "budget": 64, "interval": 5}).schedule(100).interval == 5


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("h2o", "must be a dict of policy, budget, keep, interval"),
        ({"budget": 64}, "needs a policy"),
        ({"policy": "h2o", "budget": 64, "windows": 3}, "unknown settings ['windows']"),
        ({"policy": "h2o"}, "needs a budget"),
        ({"policy": "h2o", "budget": 64, "keep": 0.5}, "not both"),
        ({"policy": "h2o", "budget": 64, "interval": 0}, "interval'] must be an integer >= 1"),
        ({"policy": "h2o", "budget": 2}, "budget 2 is smaller than"),
        ({"policy": "adakv+snapkv", "budget": 64}, "not in vLLM's per-request block layout; use a uniform budget"),
        ({"policy": "global+snapkv", "budget": 64}, "not in vLLM's per-request block layout"),
        ({"policy": "kvzip", "keep": 0.1}, "not in vLLM's per-request block layout"),
        ({"policy": "pyramidkv", "budget": 64}, "not in vLLM's per-request block layout"),
        ({"policy": "knorm", "budget": 64}, "not evicted in vLLM by this version of the plug-in; supported: "),
        ({"policy": "no-such", "budget": 64}, "unknown policy 'no-such'"),
    ],
)
def test_bad_settings_are_refused_in_one_line(raw, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as refused:
        EvictionSettings.parse(raw)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_request_may_set_its_own_budget_or_no_eviction() -> None:
    engine = EvictionSettings.parse({"policy": "h2o", "budget": 64, "interval": 8})
    assert engine.for_request(None) is engine and engine.for_request({"other": 1}) is engine
    own = engine.for_request({"kvevict": {"budget": 32}})
    assert own.budget == Budget(32) and own.policy == "h2o" and own.interval == 8
    assert engine.for_request({"kvevict": '{"budget": 32}'}) == own  # the OpenAI server's vllm_xargs: JSON text
    assert engine.for_request({"kvevict": {"policy": "h2o"}}) is engine
    full = engine.for_request({"kvevict": {"policy": "full"}})
    assert full.schedule(100).budget is None and not full.schedule(100).evicts_within(1000)


@pytest.mark.parametrize(
    ("request_settings", "message"),
    [
        ({"interval": 4}, r"a request may set only budget and policy in extra_args\['kvevict'\], got \['interval'\]"),
        ({"policy": "tova"}, r"this engine evicts with 'h2o': a request may ask for it or for 'full'"),
        ({"policy": "full", "budget": 10}, r"policy 'full' \(no eviction\) takes no budget"),
        ({"budget": 0}, r"budget must be a positive integer"),
        ({"budget": 3}, r"budget 3 is smaller than h2o's sinks"),
        ("{budget: 3", r"extra_args\['kvevict'\] is not JSON"),
        (["budget"], r"extra_args\['kvevict'\] must be a dict of budget and policy"),
    ],
)
def test_what_a_request_may_not_set_is_refused_in_one_line(request_settings, message: str) -> None:
    engine = EvictionSettings.parse({"policy": "h2o", "budget": 64})
    with pytest.raises(ValueError, match=message) as refused:
        engine.for_request({"kvevict": request_settings})
    assert "\n" not in str(refused.value)
