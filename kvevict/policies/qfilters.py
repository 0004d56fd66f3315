"""Q-Filters (Godey et al., 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache
Compression", arXiv 2503.02812): a key's score is its projection on the principal direction of
its head's queries, found offline (:mod:`kvevict.calibration`) and shipped for the embedded models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvevict.policies.allocation import bundled_profile
from kvevict.policies.base import Method
from kvevict.policies.params import WRITTEN_WINDOW, Param, declare, integer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.signals import Signals
    from kvevict.views import EntryView

FOLDER = "qfilters"
"""Package directory of the shipped filters (one JSON per model, ``kvevict calibrate-qfilters``)."""
CALIBRATE = "kvevict calibrate-qfilters --model {model} --out filters.json, then qfilters[filters=filters.json]"


def qfilter_directions(queries: torch.Tensor) -> torch.Tensor:
    """One KV head's Q-Filter from its query heads' queries ``[m, d]`` (every query of the group,
    post-RoPE, as attention reads them): the first right singular vector of the uncentred query
    matrix (Eq. 3), oriented so that the queries project positively on it on average. Then
    ``E[⟨q, k⟩] ≈ κ ⟨u, k⟩`` with ``κ > 0``: the keys that project highest draw the most attention.
    ``[d]`` fp32, unit norm."""
    matrix = queries.double()
    direction = torch.linalg.svd(matrix, full_matrices=False).Vh[0]
    if float((matrix @ direction).mean()) < 0:
        direction = -direction
    return direction.float()


def qfilter_scores(keys: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """Q-Filters' score of every key (Eq. 4): ``⟨k_i, u_h⟩``, ``keys`` ``[B, Hkv, n, d]``,
    ``filters`` ``[Hkv, d]``. ``[B, Hkv, n]`` fp32."""
    return torch.einsum("bhnd,hd->bhn", keys.float(), filters.to(keys.device, torch.float32))


def load_filters(source: str | Path | torch.Tensor, layers: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``[layers, Hkv, d]`` from a filters file (or the tensor itself), refused in one line if its
    shape is not the model's."""
    if isinstance(source, torch.Tensor):
        filters = source.float()
    else:
        filters = torch.tensor(json.loads(Path(source).read_text())["filters"], dtype=torch.float32)
    if tuple(filters.shape) != (layers, kv_heads, head_dim):
        raise ValueError(
            f"Q-Filters {'given' if isinstance(source, torch.Tensor) else f'in {source}'} are "
            f"{tuple(filters.shape)} (layers, KV heads, head dim), the model needs "
            f"{(layers, kv_heads, head_dim)}; compute them for this model: {CALIBRATE.format(model='M')}"
        )
    return filters


FILTERS = Param(
    None,
    "a JSON file of Q-Filters (path), or the filters as a [layers, KV heads, head dim] tensor",
    lambda v: isinstance(v, (str, Path)) or (isinstance(v, torch.Tensor) and v.dim() == 3),
    "the filters shipped for the model",
)


class QFilters(Method):
    """Q-Filters: evict the keys that project least on their head's query direction.

    Score (arXiv 2503.02812, Eq. 3–4; docs/policies.md): ``⟨k_i, u_h⟩``, where ``u_h`` is the
    first right singular vector of KV head ``h``'s (post-RoPE) queries on calibration text,
    oriented so the queries project positively on it (:func:`qfilter_directions`). No attention
    weights, no query at run time: it runs beside fused attention and evicts while decoding too
    (``regime=both``). The filters are computed offline once per model (``kvevict
    calibrate-qfilters``); SmolLM2-135M and Gemma-3-270M ship theirs, any other model is refused
    until given ``filters=``. Defaults: 4 sinks and a recent window of 16 tokens (without it,
    decoding evicts the tokens just written whenever they project low, and the answer repeats
    one digit).
    """

    name = "qfilters"
    summary = "evict the keys that project least on their head's offline query direction (no attention)"
    batched = True
    PARAMS = declare(filters=FILTERS, sinks=integer(4), window=WRITTEN_WINDOW)

    def __init__(self, **params: object):
        super().__init__(**params)
        self._filters: torch.Tensor | None = None

    def params(self) -> dict[str, object]:
        params = super().params()
        if isinstance(self.filters, torch.Tensor):
            params["filters"] = f"<tensor {tuple(self.filters.shape)}>"
        elif self.filters is not None:
            params["filters"] = str(self.filters)
        return params

    def bind(self, config: PretrainedConfig) -> None:
        super().bind(config)
        source = self.filters if self.filters is not None else bundled_profile(config, FOLDER)
        if source is None:
            raise ValueError(
                f"qfilters has no filters for this model ({config.model_type}, {config.num_hidden_layers} layers): "
                + CALIBRATE.format(model="M")
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._filters = load_filters(source, config.num_hidden_layers, config.num_key_value_heads, head_dim)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        if self._filters is None:
            raise RuntimeError("qfilters is not bound to a model: use it through an EvictionCache")
        return qfilter_scores(layer.keys, self._filters[layer.layer_idx])
