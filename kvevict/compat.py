"""What differs between the transformers releases kvevict supports (``>=5.0,<6``).

transformers 5.24 renamed the cache argument of a model's, a decoder layer's and
``generate``'s forward from ``past_key_values`` to ``cache``; the old name still works until
5.40, with a FutureWarning on every call. kvevict's own calls pass the name the installed
release expects (:func:`with_cache`), and its hooks read either (:func:`pass_cache`). Users
may pass either name: ``model.generate(..., past_key_values=cache)`` works on every release.

It also reads what differs between machines that torch only probes privately: whether a device
multiplies bf16 in hardware (:func:`multiplies_bf16_natively`).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from packaging.version import Version

CACHE_ARGUMENT = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"
"""The name of the cache argument of a forward or ``generate`` in the installed transformers."""


def with_cache(cache: Any) -> dict[str, Any]:
    """``model(..., **with_cache(cache))``: ``cache`` under the name the installed transformers expects."""
    return {CACHE_ARGUMENT: cache}


def pass_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a module's forward was called with: ``cache=`` from transformers 5.24 on,
    ``past_key_values=`` before (None without one)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def multiplies_bf16_natively(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware: a CUDA device with bf16 support, or a CPU with
    AVX512-BF16 or AMX tiles (torch's probes of them are private, so a release without one reads as no)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False
