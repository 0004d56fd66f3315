"""DuoAttention (Xiao et al., 2024, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads", arXiv 2410.10819): retrieval heads keep every entry, streaming
heads keep attention sinks and a recent window. Which heads retrieve is decided offline by the
paper's optimisation (:mod:`kvevict.headroles`) and shipped for the embedded models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvevict.policies.allocation import bundled_profile
from kvevict.policies.base import Allocator, Method, SinksAndWindow, Stages
from kvevict.policies.params import Param, declare, integer, number

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.signals import Signals
    from kvevict.views import EntryView

FOLDER = "duoattention"
"""Package directory of the shipped gate values (one JSON per model, ``kvevict train-duoattention``)."""
TRAIN = "kvevict train-duoattention --model {model} --out roles.json, then duoattention[roles=roles.json]"


def retrieval_heads(gates: torch.Tensor, share: float) -> torch.Tensor:
    """The retrieval heads ``[layers, Hkv]`` bool: the ``round(share · L · Hkv)`` heads of highest
    gate value ``α`` over the whole model (the paper's deployment thresholds ``α`` globally); ties
    go to the earlier layer and head, so the roles are the same on every machine."""
    flat = gates.flatten().double()
    count = round(share * flat.numel())
    order = sorted(range(flat.numel()), key=lambda index: (-float(flat[index]), index))
    chosen = torch.zeros(flat.numel(), dtype=torch.bool)
    chosen[order[:count]] = True
    return chosen.view(gates.shape)


def load_gates(source: str | Path | torch.Tensor, layers: int, kv_heads: int) -> torch.Tensor:
    """``[layers, Hkv]`` gate values from a roles file (or the tensor itself), refused in one line
    if its shape is not the model's."""
    if isinstance(source, torch.Tensor):
        gates = source.float()
    else:
        gates = torch.tensor(json.loads(Path(source).read_text())["gates"], dtype=torch.float32)
    if tuple(gates.shape) != (layers, kv_heads):
        raise ValueError(
            f"DuoAttention gates {'given' if isinstance(source, torch.Tensor) else f'in {source}'} are "
            f"{tuple(gates.shape)} (layers, KV heads), the model needs {(layers, kv_heads)}; "
            f"train them for this model: {TRAIN.format(model='M')}"
        )
    return gates


ROLES = Param(
    None,
    "a JSON file of DuoAttention gates (path), or the gates as a [layers, KV heads] tensor",
    lambda v: isinstance(v, (str, Path)) or (isinstance(v, torch.Tensor) and v.dim() == 2),
    "the gates shipped for the model",
)


class HeadRoles(Allocator):
    """DuoAttention's budgets: a retrieval head keeps every entry it holds, a streaming head
    ``budget`` (its sinks and recent window)."""

    name = "head-roles"
    batched = True

    def __init__(self) -> None:
        super().__init__()
        self.retrieval: torch.Tensor | None = None
        """``[layers, Hkv]`` bool, set when the method is bound to a model."""

    def keeps_all(self, layer_idx: int) -> bool:
        return self.retrieval is None or bool(self.retrieval[layer_idx].any())

    def counts(
        self, layer: EntryView, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        if self.retrieval is None:
            raise RuntimeError("duoattention is not bound to a model: use it through an EvictionCache")
        held = layer.head_lengths()
        keeps_all = self.retrieval[layer.layer_idx].to(held.device)
        return torch.where(keeps_all, held, held.clamp(max=budget))


class DuoAttention(Method):
    """DuoAttention: full attention in retrieval heads, sinks plus a recent window in streaming heads.

    Each KV head has a gate ``α ∈ [0, 1]`` trained offline (arXiv 2410.10819, §3.1–3.2; Eq. 1:
    ``attn = α·full + (1 − α)·streaming``, Eq. 2–3: the distillation loss over the final hidden
    states of a synthetic passkey task plus ``λ·Σ|α|``; ``kvevict train-duoattention``). The
    ``retrieval`` share of heads with the highest ``α`` (over the whole model) keep every entry;
    the others keep ``sinks`` first tokens and the most recent ``budget − sinks`` (``budget=`` is
    the streaming heads' sinks plus window), at prefill and every decode step, so their cache stays
    constant. Heads of different lengths are packed, as AdaKV's are: resident bytes follow what each
    head holds. No attention weights are read. Defaults: ``retrieval=0.5`` (the paper's share for
    GQA models); ``sinks=16``, the pattern the shipped gates were trained with (16 sinks and 112
    recent tokens: run it at ``budget`` ≈ 128, or train gates for another pattern; the paper's runs
    at 100k-token contexts use longer ones). SmolLM2-135M and Gemma-3-270M ship their gates
    (docs/policies.md); any other model is refused until given ``roles=``.
    """

    name = "duoattention"
    summary = "retrieval heads keep everything, streaming heads sinks + a recent window (offline head roles)"
    batched = True
    distinct_scores = True  # a head holds each position once
    regimes = ("both", "prefill")
    PARAMS = declare(roles=ROLES, retrieval=number(0.5, 0, 1), sinks=integer(16))

    def __init__(self, **params: object):
        super().__init__(**params)
        self._roles = HeadRoles()

    def params(self) -> dict[str, object]:
        params = super().params()
        if isinstance(self.roles, torch.Tensor):
            params["roles"] = f"<tensor {tuple(self.roles.shape)}>"
        elif self.roles is not None:
            params["roles"] = str(self.roles)
        return params

    def bind(self, config: PretrainedConfig) -> None:
        super().bind(config)
        source = self.roles if self.roles is not None else bundled_profile(config, FOLDER)
        if source is None:
            raise ValueError(
                f"duoattention has no head roles for this model ({config.model_type}, "
                f"{config.num_hidden_layers} layers): " + TRAIN.format(model="M")
            )
        gates = load_gates(source, config.num_hidden_layers, config.num_key_value_heads)
        self._roles.retrieval = retrieval_heads(gates, self.retrieval)

    def stages(self) -> Stages:
        return Stages(scorer=self, protector=SinksAndWindow(self.sinks, 0), allocator=self._roles)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return layer.positions.float()
