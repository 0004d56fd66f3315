"""How many entries each KV head of each layer may keep (DESIGN §2, §3): the budget a
user gives, and the allocators that split it over heads (AdaKV, HeadKV) and layers
(PyramidKV). The allocator stages that apply them live in :mod:`kvevict.policies.allocation`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Budget:
    """A retention budget: ``tokens`` per KV head per layer, or ``keep``, a fraction of
    the prompt (resolved once the prompt length is known). Never both."""

    tokens: int | None = None
    keep: float | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None and self.keep is not None:
            raise ValueError(
                f"give either budget= (tokens per KV head per layer) or keep= (fraction of the prompt), "
                f"not both (got budget={self.tokens}, keep={self.keep})"
            )
        if self.tokens is not None and (
            isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1
        ):
            raise ValueError(f"budget must be a positive integer number of tokens, got {self.tokens!r}")
        if self.keep is not None and not 0 < self.keep <= 1:
            raise ValueError(f"keep must be a fraction of the prompt in (0, 1], got {self.keep!r}")

    @property
    def given(self) -> bool:
        return self.tokens is not None or self.keep is not None

    def resolve(self, prompt_length: int) -> int | None:
        """Tokens per KV head for a prompt of ``prompt_length`` tokens (None: unlimited)."""
        if self.keep is not None:
            return max(1, math.ceil(self.keep * prompt_length))
        return self.tokens

    def __str__(self) -> str:
        if self.tokens is not None:
            return f"budget={self.tokens}"
        return f"keep={self.keep}" if self.keep is not None else "unlimited"


def capped_share(budget: int, cap: int = 128, divisor: int = 4) -> int:
    """``min(cap, budget // divisor)``: the default recent window, reserve or interval that
    several methods size from the budget (H2O/EpiKV/RaaS ``min(128, B/4)``, LazyEviction
    ``min(32, B/4)``, R-KV ``min(128, B/2)``)."""
    return min(cap, budget // divisor)


# -- budget allocators: how a layer's budget is split over heads and layers (DESIGN §3) ------
# Scores come in as a policy's selection scores ``[B, H, n]``: protected entries (sinks,
# recent window) at +inf, padding at -inf. Counts include the protected entries.
def adakv_counts(scores: torch.Tensor, budget: int | torch.Tensor, safeguard: float = 0.2) -> torch.Tensor:
    """AdaKV (Feng et al., 2024): entries each head of a layer keeps, ``[B, H]`` int64.

    Each head keeps its protected entries and has ``B'_h = budget − protected_h`` to
    spend; the layer's ``Σ B'_h`` slots go to the top scores of *all* its heads
    flattened, except that each head first keeps its own top ``⌊safeguard·B'_h⌋``.
    The layer's total stays ``H × budget`` (or everything, when heads hold less). ``budget``
    may be given per head, ``[B, H]``.
    """
    return pooled_counts([scores], [budget], safeguard)[0]


def pooled_counts(
    scores: Sequence[torch.Tensor], budgets: Sequence[int | torch.Tensor], safeguard: float
) -> list[torch.Tensor]:
    """:func:`adakv_counts` of the heads of several layers at once, as if they were the heads of one
    layer (layer ``l``'s scores ``[B, H_l, n_l]`` and budget, an int or ``[B, H_l]``), without padding
    every layer to the longest: each layer's heads are flattened as they are and the layers'
    flattened scores ranked together (the same order of real entries, so the same counts)."""
    held, guaranteed, contests, slots = [], [], [], 0
    for layer, budget in zip(scores, budgets, strict=True):
        protected = torch.isposinf(layer)
        free = torch.isfinite(layer)
        held.append(protected.sum(dim=-1))
        spare = (budget - held[-1]).clamp(min=0)
        floor = (safeguard * spare).floor().long()
        kept = free & (descending_ranks(layer.masked_fill(~free, float("-inf"))) < floor[..., None])
        guaranteed.append(kept.sum(dim=-1))
        contests.append(layer.masked_fill(~free | kept, float("-inf")).flatten(1))
        slots = slots + (spare - floor).sum(dim=-1)  # [B]
    flat = contests[0] if len(contests) == 1 else torch.cat(contests, dim=1)
    wins = (descending_ranks(flat) < slots[:, None]) & torch.isfinite(flat)
    won = wins.split([contest.shape[1] for contest in contests], dim=1)
    return [
        own + kept + layer_wins.view_as(layer).sum(dim=-1)
        for own, kept, layer_wins, layer in zip(held, guaranteed, won, scores)
    ]


def global_counts(
    scores: Sequence[torch.Tensor],
    budget: int,
    safeguard: float = 0.2,
    reach: Sequence[int] | None = None,
    cap: int | None = None,
) -> list[torch.Tensor]:
    """One budget pool over every layer and head (``global+``): entries each head of each
    layer keeps, ``[B, H]`` int64 per layer.

    The layers' selection scores ``[B, H, n_l]`` are ranked together as if their heads were
    the heads of one layer (:func:`pooled_counts`, each layer padded to its own longest head
    only): the pool is what the heads would keep under
    their own budgets, ``Σ min(budget, n_h)`` over every head's ``n_h`` entries (``L·H·budget``
    when each holds more than the budget), and each head keeps its protected entries plus at
    least ``⌊safeguard·(min(budget, n_h) − protected)⌋`` of its own. A sliding-window layer whose
    window is shorter than the budget so brings only its window to the pool, not the budget: a
    larger budget never leaves the other layers fewer entries (docs/fastkvzip.md, round 6).

    A prompt fed in chunks is pooled after every chunk (docs/fastkvzip.md, round 8): ``reach``
    gives, per layer, the entries each of its heads would hold with no eviction at all (the
    tokens seen, or a sliding layer's window), which replaces ``n_h`` in the pool (a head an
    earlier chunk compressed still brings ``min(budget, reach)``, so the pool stays ``L·H·budget``);
    ``cap`` bounds what one head keeps, protected entries included: only its top ``cap``
    entries compete, so the pool goes to other heads' next best rather than growing one head
    with the context.
    """
    if reach is None:  # [B, H]: what each head keeps on its own
        own: list[int | torch.Tensor] = [(layer > float("-inf")).sum(dim=-1).clamp(max=budget) for layer in scores]
    else:
        own = [min(budget, n) for n in reach]
    if cap is not None:  # (protected entries, at +inf, rank first)
        scores = [layer.masked_fill(descending_ranks(layer) >= cap, float("-inf")) for layer in scores]
    return pooled_counts(scores, own, safeguard)


def descending_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry along the last dim (0 = highest; ties: the earlier entry)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def pyramid_budgets(budget: int, window: int, length: int, num_layers: int, beta: int = 20) -> list[int]:
    """PyramidKV (Cai et al., 2024): per-layer budgets, largest at the bottom.

    With ``B' = budget − window``: ``min = ⌊B'/β⌋``, ``max = 2B' − min``; if ``max ≥ n − w``
    then ``max = n − w`` and ``min = 2B' − max``; ``step = ⌊(max − min)/(L − 1)⌋``; layer
    ``ℓ`` keeps ``max − ℓ·step + w`` (DESIGN §3).
    """
    spare = budget - window
    low = spare // beta
    high = 2 * spare - low
    if high >= length - window:
        high = length - window
        low = 2 * spare - high
    step = (high - low) // max(num_layers - 1, 1)
    return [high - layer * step + window for layer in range(num_layers)]


def headkv_capacities(importance: torch.Tensor, budget: int, beta: float = 1.01) -> torch.Tensor:
    """HeadKV (Fu et al., 2024): per-head budgets ``[L, H]`` from head importance.

    ``importance`` ``[L, H]`` is normalised to sum to 1 over every head of the model;
    ``cap = round(s·⌊B/β⌋·L·H + (B − ⌊B/β⌋))``: each head keeps a small base share and the
    pooled ``⌊B/β⌋·L·H`` entries are split by importance (DESIGN §3, ``β = 1.01``).
    """
    layers, heads = importance.shape
    pooled = math.floor(budget / beta)
    share = importance.double() / importance.double().sum()
    return torch.round(share * pooled * layers * heads + (budget - pooled)).long()


def load_head_profile(
    profile: str | Path | Mapping[str, Sequence[float]], num_layers: int, num_query_heads: int, num_kv_heads: int
) -> torch.Tensor:
    """Head importance ``[L, Hkv]`` from a profile (a JSON file or a mapping ``"layer-head"``
    → list of scores, as HeadKV's retrieval-head files): the mean score of each query
    head, then the mean over each KV head's group (GQA)."""
    if not isinstance(profile, Mapping):
        path = Path(profile)
        if not path.is_file():
            raise ValueError(f"head profile {str(path)!r} does not exist; compute one with `kvevict analyze heads`")
        data = json.loads(path.read_text())
        profile = data.get("heads", data)  # kvevict's files wrap the mapping; HeadKV's are the bare mapping
    scores = torch.zeros(num_layers, num_query_heads, dtype=torch.float64)
    missing = []
    for layer in range(num_layers):
        for head in range(num_query_heads):
            values = profile.get(f"{layer}-{head}")
            if not values:
                missing.append(f"{layer}-{head}")
                continue
            scores[layer, head] = sum(values) / len(values)
    if missing:
        raise ValueError(
            f"head profile does not cover this model ({num_layers} layers × {num_query_heads} heads): missing "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; compute one with `kvevict analyze heads`"
        )
    group = num_query_heads // num_kv_heads
    return scores.view(num_layers, num_kv_heads, group).mean(dim=-1)
