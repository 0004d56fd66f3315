"""A request's own eviction settings, checked when the front end admits it.

``SamplingParams(extra_args={"kvevict": {"budget": N}})`` runs a request at its own budget under
the engine's policy, ``{"kvevict": {"policy": "full"}}`` without eviction; through the OpenAI
server, ``extra_body={"vllm_xargs": {"kvevict": '{"budget": N}'}}`` (its ``vllm_xargs`` take no
nested dict, so the same dict as JSON text)
(:meth:`~kvevict.vllm.config.EvictionSettings.for_request`). The only per-request check vLLM's
front end offers is a logits processor's ``validate_params``: :class:`RequestSettings` is one that
changes no logits and refuses what a request may not set, so the response is an error (HTTP 400
from the server) rather than a setting silently ignored. The scheduler and the workers then read
the same settings from the request's parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from kvevict.vllm import config


class RequestSettings(LogitsProcessor):
    """Refuses, at admission, a request whose ``extra_args["kvevict"]`` the engine cannot honour;
    changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        if config.ENGINE is not None:
            config.ENGINE.for_request(sampling_params.extra_args)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass
