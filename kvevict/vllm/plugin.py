"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in each of its processes.

vLLM reads a plug-in's per-engine settings from ``additional_config`` but offers no hook that
sees the whole engine configuration before the engine picks its scheduler and worker classes.
So :func:`register` wraps one function, ``VllmConfig.try_verify_and_update_config`` (the
per-model configuration hook that ``VllmConfig.__post_init__`` calls before the platform's own
checks), with :func:`kvevict.vllm.config.configure`, which leaves engines without a ``kvevict``
entry as they are. The wrap is made only for the vLLM series the plug-in is written against,
and ``tests/vllm/test_plugin.py`` fails when vLLM changes either function.
"""

from __future__ import annotations

import functools
import logging

from kvevict.vllm.config import VLLM_SERIES, configure

logger = logging.getLogger(__name__)

WRAPPED = "try_verify_and_update_config"


def register() -> None:
    """Install the configuration hook (once per process; vLLM may call this more than once)."""
    import vllm
    from vllm.config import VllmConfig

    original = getattr(VllmConfig, WRAPPED, None)
    if original is None or getattr(original, "kvevict_configure", False):
        return
    if not vllm.__version__.startswith(VLLM_SERIES):
        logger.warning(
            "kvevict's vLLM plug-in is written for vLLM %sx and found %s: engines that ask for it are refused",
            VLLM_SERIES,
            vllm.__version__,
        )

    @functools.wraps(original)
    def try_verify_and_update_config(self: VllmConfig) -> None:
        original(self)
        configure(self)

    try_verify_and_update_config.kvevict_configure = True  # type: ignore[attr-defined]
    setattr(VllmConfig, WRAPPED, try_verify_and_update_config)
