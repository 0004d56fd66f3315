"""The plug-in's per-engine settings, read from vLLM's ``additional_config``, and the checks that
refuse, when the engine is built, every setting the plug-in cannot honour.

``additional_config={"kvevict": {"policy": "streamingllm", "budget": 256, "interval": 16}}``
(``keep=`` instead of ``budget=``: a share of each prompt). ``interval`` overrides the policy's
own schedule, as :class:`~kvevict.cache.EvictionCache`'s does.

Imports vLLM only inside :func:`configure`, so the settings and schedules are testable without it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from kvevict.budgets import Budget
from kvevict.policies import Policy, make_policy
from kvevict.policies.base import Uniform
from kvevict.vllm.schedule import EvictionSchedule

logger = logging.getLogger(__name__)

KEY = "kvevict"
"""The key of ``additional_config`` the plug-in reads."""
SETTINGS = ("policy", "budget", "keep", "interval")
REQUEST_SETTINGS = ("budget", "policy")
"""What a request may set for itself in ``SamplingParams.extra_args["kvevict"]`` (:meth:`EvictionSettings.for_request`)."""
REQUEST_CHECK = "kvevict.vllm.requests:RequestSettings"
"""The logits processor whose ``validate_params`` refuses a request's bad settings at admission."""
ENGINE: EvictionSettings | None = None
"""The settings of the engine this process configured last (:func:`configure`): what its front end
checks each request against (:mod:`kvevict.vllm.requests`)."""
VLLM_SERIES = "0.32."
"""The vLLM release series the plug-in is written against (its scheduler, worker and block layout)."""
SUPPORTED = ("streamingllm", "h2o", "tova", "snapkv", "lazyeviction", "rkv", "epikv")
"""Policies the plug-in evicts in vLLM's paged cache, under the cross-host contract."""
SCHEDULER = "kvevict.vllm.scheduler.EvictionScheduler"
WORKER = "kvevict.vllm.worker.EvictionWorker"


class EngineRefused(RuntimeError):
    """An engine the plug-in cannot run, refused in one line when its configuration is built. Not a
    ``ValueError``: vLLM's configuration is a pydantic dataclass, which would wrap one into a
    multi-line validation report."""


@dataclass(frozen=True)
class EvictionSettings:
    """What an engine evicts: a kvevict policy by name, and a budget (``tokens`` or ``keep``) and interval."""

    policy: str
    budget: Budget
    interval: int | None = None

    @classmethod
    def parse(cls, raw: Any) -> EvictionSettings:
        """The settings of ``additional_config["kvevict"]``; a one-line ``ValueError`` for bad input."""
        if not isinstance(raw, dict):
            raise TypeError(f"additional_config['kvevict'] must be a dict of {', '.join(SETTINGS)}, got {raw!r}")
        unknown = sorted(set(raw) - set(SETTINGS))
        if unknown:
            raise ValueError(
                f"additional_config['kvevict'] has unknown settings {unknown}; known: {', '.join(SETTINGS)}"
            )
        if "policy" not in raw:
            raise ValueError(f"additional_config['kvevict'] needs a policy, e.g. {{'policy': '{SUPPORTED[0]}'}}")
        interval = raw.get("interval")
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f"additional_config['kvevict']['interval'] must be an integer >= 1, got {interval!r}")
        settings = cls(str(raw["policy"]), Budget(raw.get("budget"), raw.get("keep")), interval)
        settings.check_policy()
        return settings

    def for_request(self, extra_args: Any) -> EvictionSettings:
        """The settings of a request whose ``SamplingParams.extra_args`` are ``extra_args``: the
        engine's, or with the request's own budget (``{"kvevict": {"budget": N}}``), or no eviction
        (``{"kvevict": {"policy": "full"}}``); the dict may come as its JSON text (the OpenAI
        server's ``vllm_xargs`` hold no nested dict). Anything else raises a one-line ``ValueError``."""
        raw = extra_args.get(KEY) if isinstance(extra_args, dict) else None
        if raw is None:
            return self
        if isinstance(raw, str):  # the OpenAI server's vllm_xargs take no nested dict: the same as JSON
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError:
                raise ValueError(f"a request's extra_args['kvevict'] is not JSON: {raw!r}") from None
        if not isinstance(raw, dict):
            # a ValueError, not a TypeError: vLLM's front end answers only a ValueError with HTTP 400
            raise ValueError(f"a request's extra_args['kvevict'] must be a dict of {' and '.join(REQUEST_SETTINGS)}")  # noqa: TRY004
        unknown = sorted(set(raw) - set(REQUEST_SETTINGS))
        if unknown:
            raise ValueError(
                f"a request may set only {' and '.join(REQUEST_SETTINGS)} in extra_args['kvevict'], got {unknown} "
                "(the engine's additional_config sets the rest)"
            )
        policy = raw.get("policy", self.policy)
        if policy not in (self.policy, "full"):
            raise ValueError(
                f"this engine evicts with {self.policy!r}: a request may ask for it or for 'full' (no eviction), "
                f"not {policy!r}"
            )
        if policy == "full":
            if "budget" in raw:
                raise ValueError("a request that asks for policy 'full' (no eviction) takes no budget")
            return replace(self, policy="full", budget=Budget())
        if "budget" not in raw:
            return self
        settings = replace(self, budget=Budget(raw["budget"]))
        settings.check_policy()
        return settings

    def make_policy(self) -> Policy:
        return make_policy(self.policy)

    def check_policy(self) -> None:
        """Refuse a policy the paged cache cannot follow, or one the plug-in does not evict yet."""
        policy = self.make_policy()
        if policy.name == "full":
            return
        if not self.budget.given:
            raise ValueError(f"kvevict policy {policy.name!r} needs a budget: give 'budget' (tokens) or 'keep' (share)")
        if self.budget.tokens is not None:
            policy.check_budget(self.budget.tokens)
        if not uniform(policy):
            raise ValueError(
                f"kvevict policy {policy.name!r} keeps different numbers of entries per head or layer, which is not in "
                "vLLM's per-request block layout; use a uniform budget (a policy without adakv, pyramidkv, headkv, "
                "global, kvzip, fastkvzip or momentkv)"
            )
        if policy.name not in SUPPORTED:
            raise ValueError(
                f"kvevict policy {policy.name!r} is not evicted in vLLM by this version of the plug-in; "
                f"supported: {', '.join(SUPPORTED)}"
            )

    def schedule(self, prompt_length: int) -> EvictionSchedule:
        """The schedule of a request with a prompt of ``prompt_length`` tokens (the same as
        :class:`~kvevict.cache.EvictionCache`'s for that prompt)."""
        policy = self.make_policy()
        budget = None if policy.name == "full" else self.budget.resolve(prompt_length)
        interval = self.interval or (budget and policy.default_interval(budget)) or 1
        return EvictionSchedule(
            prompt_length=prompt_length,
            budget=budget,
            interval=interval,
            at_prefill=policy.evicts_in("prefill"),
            at_decode=policy.evicts_in("decode"),
        )


def uniform(policy: Policy) -> bool:
    """Whether every KV head of every layer of a request keeps as many entries (the block table
    is per request): no head-wise or layer-wise allocator, no budget pooled across layers, and
    no method that scores the prompt once over every layer (KVzip's global budget)."""
    return type(policy.allocator) is Uniform and not policy.deferred_prefill


def settings_of(additional_config: Any) -> EvictionSettings | None:
    """The plug-in's settings in an engine's ``additional_config`` (None: not asked for)."""
    if not isinstance(additional_config, dict) or KEY not in additional_config:
        return None
    return EvictionSettings.parse(additional_config[KEY])


def refusals(vllm_config: Any, settings: EvictionSettings, version: str) -> list[str]:
    """Why an engine with this configuration and these settings cannot run the plug-in (empty: it can)."""
    reasons = []
    if not version.startswith(VLLM_SERIES):
        reasons.append(f"it needs vLLM {VLLM_SERIES}x, found {version}")
    if vllm_config.cache_config.enable_prefix_caching:
        reasons.append("prefix caching shares blocks between requests (give enable_prefix_caching=False)")
    if vllm_config.scheduler_config.enable_chunked_prefill:
        reasons.append("chunked prefill is not supported (give enable_chunked_prefill=False)")
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding is not supported")
    if vllm_config.scheduler_config.async_scheduling:
        reasons.append("asynchronous scheduling is not supported (give async_scheduling=False)")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        reasons.append(f"a quantized KV cache ({vllm_config.cache_config.cache_dtype}) is not supported")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        reasons.append("pipeline parallelism is not supported")
    if parallel.tensor_parallel_size > 1 and settings.make_policy().mixes_heads:
        reasons.append(
            f"{settings.policy} reads every KV head of a layer to score one, and tensor parallelism splits the heads "
            "across workers (use a policy that scores each head alone, e.g. h2o, snapkv, streamingllm, epikv)"
        )
    model = vllm_config.model_config
    if model.get_sliding_window() is not None or "sliding_attention" in (
        getattr(model.hf_text_config, "layer_types", None) or ()
    ):
        reasons.append("sliding-window models are not supported")
    if model.uses_alibi:
        reasons.append("ALiBi models are not supported")
    if parallel.worker_cls not in ("auto", WORKER):
        reasons.append(f"it brings its own worker class, and worker_cls is {parallel.worker_cls!r}")
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls not in (None, SCHEDULER):
        reasons.append(f"it brings its own scheduler class, and scheduler_cls is {scheduler_cls!r}")
    return reasons


def configure(vllm_config: Any) -> None:
    """For an engine whose ``additional_config`` names the plug-in: check its settings and the
    engine's, refusing in one line what the plug-in cannot honour, then set the scheduler and
    worker classes that evict, and run the model eagerly (the plug-in's hooks are Python, which
    torch.compile would trace); and check each request's own settings when it is admitted
    (:mod:`kvevict.vllm.requests`). Engines without it are left as they are."""
    try:
        settings = settings_of(vllm_config.additional_config)
    except (TypeError, ValueError) as error:
        raise EngineRefused(str(error)) from None
    if settings is None:
        return
    import vllm

    reasons = refusals(vllm_config, settings, vllm.__version__)
    if reasons:
        raise EngineRefused(f"kvevict's vLLM plug-in refuses this engine: {'; '.join(reasons)}")
    vllm_config.scheduler_config.scheduler_cls = SCHEDULER
    vllm_config.parallel_config.worker_cls = WORKER
    global ENGINE
    ENGINE = settings  # what this process's front end checks each request against
    model = vllm_config.model_config
    if REQUEST_CHECK not in (model.logits_processors or []):
        model.logits_processors = [*(model.logits_processors or []), REQUEST_CHECK]
    if not vllm_config.model_config.enforce_eager:  # before vLLM derives its compilation settings from it
        logger.info("kvevict's vLLM plug-in runs the model eagerly: its hooks after each attention layer are Python")
        vllm_config.model_config.enforce_eager = True
