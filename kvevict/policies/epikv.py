"""The hidden-state family of EpiKV (Kolawole & Smith, "Epiphany-Aware KV Cache Eviction
Without the Attention Matrix", seed 000, §3.2–3.3; DESIGN §3 "EpiKV family").

Signal (Eq. 1): ``g_l(t) = ‖h_l(t) − h_l(t−1)‖₂``, read by forward hooks on the decoder
layers a policy names (:mod:`kvevict.hidden`). Every score is computed once, when its token
has passed every hooked layer, then frozen; the policies read no attention at all (except the
hybrid ``attn-x-hs``), so they run unchanged on SDPA and FlashAttention kernels.

Bands (DESIGN §3): for a 32-layer model A = layer 10 (band 7–13), B = layer 21 (band 18–25).
For ``L`` layers each index ``l`` becomes ``round(l·L/32)``, halves rounded up
(``(2·l·L + 32) // 64``), clipped to ``L − 1``: 30 layers → A = 9 (7–12), B = 20 (17–23).

Rolling statistics run over the whole sequence, prompt included, trailing and causal: the
window of token ``t`` is the last ``min(t + 1, w)`` values up to and including ``g(t)``.

Eviction (App. D; DESIGN §3 "Policy"): the prompt is kept while it fits beside the recent
``min(128, K/4)`` tokens, the rest of the budget ``K`` goes to the top tokens by score. A
prompt prefilled in one pass is held whole until the first decode step, as in the paper.
Chunked prefill (kvevict's extension for bounded memory, DESIGN §1.10; not in the paper):
after each prompt chunk but the first, every layer evicts back to ``K`` by the same rule, so
the prompt so far, which no longer fits, is ranked by the same frozen score. At a layer that
runs before the hooked layers have seen the chunk, the chunk's tokens have no score yet and
count as ``+inf``: that layer keeps the whole chunk plus the top ``K − C`` older tokens; a
layer past them ranks the chunk too. A chunk after the first must hold at most ``K`` tokens
(:func:`~kvevict.policies.selection.check_prompt_chunk`, a ``ValueError`` otherwise); the
smaller ``C`` is against ``K``, the more of the older prompt the early layers rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvevict.policies.h2o import CumulativeAttention
from kvevict.policies.params import RECENT_WINDOW, Param, declare, integer, is_integer, layer_indices
from kvevict.policies.selection import PromptKeeping, check_prompt_chunk
from kvevict.signals import Signals

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.views import EntryView

ROLLING = 64
EPSILON = 1e-6
REFERENCE_DEPTH = 32
LAYER_A, LAYER_B = 10, 21
BAND_A, BAND_B = (7, 13), (18, 25)


# -- rolling statistics (pure functions over the last dimension) ------------------------------
def _rolling_means(x: torch.Tensor, window: int, end: int | torch.Tensor | None = None) -> torch.Tensor:
    """Trailing-window means of ``x`` along its last dimension, in float64 (the window of ``t``
    holds ``min(t + 1, window)`` values). A decode step scores one token from a window of 64
    this way, so the operation count, not their size, is the cost: one cumulative sum, with
    ``window`` zeros in front so each window is one difference of slices.

    ``end``: ``x`` holds a sequence's values up to position ``end − 1`` (an int, or ``[B, 1, 1]``
    per row), zeros standing in for any before position 0; a window then counts only the
    values at positions ``≥ 0``, ``min(p + 1, window)`` for the value at ``p`` (a fixed-length
    history of rows of different lengths, :mod:`kvevict.policies.kvvar`). The zeros add
    nothing to the sums, so the means are those of the unpadded series bit for bit."""
    if window < 1:
        raise ValueError(f"rolling window must be >= 1, got {window}")
    n = x.shape[-1]
    cumulative = torch.nn.functional.pad(x.double().cumsum(dim=-1), (window, 0))
    count = torch.arange(1, n + 1, dtype=torch.float64, device=x.device)
    if end is not None:  # position + 1 of each value (at least 1 where a zero stands in)
        count = (count + (end - n)).clamp_(min=1)
    return (cumulative[..., window:] - cumulative[..., :n]).div_(count.clamp_(max=window))


def _rolling_moments(x: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trailing-window means of ``x`` and of ``x²`` (float64), from one cumulative sum of both."""
    x = x.double()
    mean, square_mean = _rolling_means(torch.stack([x, x * x]), window)
    return mean, square_mean


def rolling_mean(x: torch.Tensor, window: int = ROLLING, end: int | torch.Tensor | None = None) -> torch.Tensor:
    """Mean of the trailing ``window`` values, the current one included (fewer at the start;
    ``end``: ``x`` ends at position ``end − 1`` behind zeros, see :func:`_rolling_means`)."""
    return _rolling_means(x, window, end).float()


def rolling_zscore(x: torch.Tensor, window: int = ROLLING, eps: float = EPSILON) -> torch.Tensor:
    """Eq. 3: ``(x(t) − μ(t)) / (σ(t) + ε)`` over the trailing ``window`` values, the current
    one included; ``σ`` is the population standard deviation."""
    x = x.double()  # once: the moments' own conversion is then a no-op
    mean, square_mean = _rolling_moments(x, window)
    std = (square_mean - mean * mean).clamp_(min=0).sqrt_()
    return ((x - mean) / std.add_(eps)).float()


def stacked_changes(changes: dict[int, torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """The changes of ``layers`` ``[len(layers), B, T]``: their rolling statistics then run as one
    batch of operations (each scores a new token every decode step; per layer, a band of 13
    layers would issue ~300 small operations per step). Every value is what the layer's own
    series gives (the statistics run along the last dimension)."""
    return torch.stack([changes[layer] for layer in layers])


# -- layers -------------------------------------------------------------------------------------
def scale_layer(layer: int, num_layers: int) -> int:
    """Layer ``layer`` of a 32-layer model mapped to a ``num_layers``-layer one (round half up)."""
    return min(num_layers - 1, (2 * layer * num_layers + REFERENCE_DEPTH) // (2 * REFERENCE_DEPTH))


def scale_band(band: tuple[int, int], num_layers: int) -> tuple[int, ...]:
    """The layers of a band ``(first, last)`` of a 32-layer model, scaled to ``num_layers``."""
    first, last = (scale_layer(layer, num_layers) for layer in band)
    return tuple(range(first, last + 1))


# -- policies -----------------------------------------------------------------------------------
class HiddenStatePolicy(PromptKeeping):
    """Base of the hidden-state policies: prompt and recent window kept, the rest by the
    frozen per-token score (unscored tokens, i.e. the ones in flight, count as ``+inf``);
    a prompt prefilled in chunks is evicted after each chunk but the first (module docstring)."""

    PARAMS = declare(rolling=integer(ROLLING, low=1), window=RECENT_WINDOW)

    @property
    def hidden_context(self) -> int:
        return self.rolling - 1

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return frozen_scores(layer)


def frozen_scores(layer: EntryView) -> torch.Tensor:
    """The frozen hidden-state scores of the layer's entries (``+inf`` where not scored yet),
    after refusing a prompt chunk too large to rank (also for selectors that are not
    :class:`~kvevict.policies.selection.PromptAndWindow`, e.g. Segment-HS's quotas)."""
    if layer.budget is not None:
        check_prompt_chunk(layer, layer.budget)
    seen = getattr(layer, "seen", None)  # rows in lockstep may have seen different numbers (a tensor)
    return layer.owner.hidden.lookup(layer.positions, end=seen if isinstance(seen, int) else None)


class HSVariance(HiddenStatePolicy):
    """HS-variance (Eq. 2): ``s(t) = ḡ_A(t) − ḡ_B(t)``, rolling means over 64 tokens.

    Args:
        layers: ``(A, B)`` decoder layers (default: 10 and 21 scaled to the model's depth).
        rolling: window of the rolling statistics (64).
        window: recent tokens kept (None: ``min(128, K/4)``); the prompt is kept while it fits.
    """

    name = "hs-variance"
    batched = True
    stackable = True
    summary = "keep prompt + recent; rank decode tokens by rolling-mean hidden-state change g_A - g_B (EpiKV)"
    PARAMS = declare(layers=layer_indices(2), **HiddenStatePolicy.PARAMS)

    def model_defaults(self, config: PretrainedConfig) -> dict[str, object]:
        depth = config.num_hidden_layers
        return {"layers": (scale_layer(LAYER_A, depth), scale_layer(LAYER_B, depth))}

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.pair()

    def pair(self) -> tuple[int, int]:
        """Layers ``(A, B)``: the given ones, or the defaults of the model bound to (10 and 21)."""
        return self.layers or (LAYER_A, LAYER_B)

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        mean_a, mean_b = rolling_mean(stacked_changes(changes, self.pair()), self.rolling)
        return mean_a - mean_b


class EpiKV(HSVariance):
    """EpiKV (Eq. 3), the paper's primary method: ``s(t) = z_A(t) − z_B(t)`` where ``z_l`` is
    the causal rolling z-score of ``g_l`` over the trailing 64 values (current included,
    population std + 1e-6), which removes the positional trend of the raw signal."""

    name = "epikv"
    batched = True
    stackable = True
    summary = "keep prompt + recent; rank decode tokens by rolling z-score of hidden-state change z_A - z_B"

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        z_a, z_b = rolling_zscore(stacked_changes(changes, self.pair()), self.rolling)
        return z_a - z_b


def _bands(value: object) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(layer_indices().accepts(band) for band in value)


class BandAdaptive(HiddenStatePolicy):
    """Band-adaptive: the bands averaged, ``s(t) = mean_{l∈A} z_l(t) − mean_{l∈B} z_l(t)``
    (each layer z-scored before averaging, so no layer dominates by its magnitude).

    Args:
        bands: ``(band A layers, band B layers)`` (default: 7–13 and 18–25 scaled to the depth).
    """

    name = "band-adaptive"
    batched = True
    stackable = True
    summary = "keep prompt + recent; rank by mean rolling z-score of band A (7-13) minus band B (18-25)"
    PARAMS = declare(
        bands=Param(
            None,
            "(band A layers, band B layers), two lists of layer indices (integers >= 0)",
            _bands,
            "7-13 and 18-25 scaled from the model's depth",
            lambda bands: (tuple(bands[0]), tuple(bands[1])),
        ),
        **HiddenStatePolicy.PARAMS,
    )

    def model_defaults(self, config: PretrainedConfig) -> dict[str, object]:
        depth = config.num_hidden_layers
        return {"bands": (scale_band(BAND_A, depth), scale_band(BAND_B, depth))}

    def band_layers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The given bands, or the defaults of the model bound to (7-13 and 18-25)."""
        return self.bands or (tuple(range(7, 14)), tuple(range(18, 26)))

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        first, second = self.band_layers()
        return tuple(sorted({*first, *second}))

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        first, second = self.band_layers()
        z = rolling_zscore(stacked_changes(changes, first + second), self.rolling)
        return z[: len(first)].mean(dim=0) - z[len(first) :].mean(dim=0)


def standardize(x: torch.Tensor, eps: float = EPSILON) -> torch.Tensor:
    """``(x − mean) / (std + eps)`` over the last dimension (population std), fp32."""
    x = x.float()
    return (x - x.mean(dim=-1, keepdim=True)) / (x.std(dim=-1, correction=0, keepdim=True) + eps)


class AttnXHS(CumulativeAttention, HiddenStatePolicy):
    """Attn×HS, the attention + hidden-state hybrid of seed 000 (Table 1): cumulative
    attention (H2O's, prompt column sums included, GQA mean) plus ``z_A``.

    The two live on different scales, so the cumulative attention is standardised over the
    entries of each KV head at eviction time: ``score = standardize(Σ attention) + z_A``.
    Attention-requiring (column sums in chunks, never an n×n matrix). Prompt and recent
    window kept as in the rest of the family.

    Args:
        layer: the band-A layer (default 10 scaled to the depth).
    """

    name = "attn-x-hs"
    batched = True
    summary = "keep prompt + recent; rank by standardised cumulative attention + z_A (hybrid)"
    regimes = ("decode",)
    attention_scores = False  # standardised attention plus a z-score
    PARAMS = declare(
        **HiddenStatePolicy.PARAMS,
        layer=Param(None, "a layer index (integer >= 0)", lambda v: is_integer(v) and v >= 0, "10 scaled"),
    )

    def model_defaults(self, config: PretrainedConfig) -> dict[str, object]:
        return {"layer": scale_layer(LAYER_A, config.num_hidden_layers)}

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        return (LAYER_A if self.layer is None else self.layer,)

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        return rolling_zscore(changes[self.hidden_layers(0)[0]], self.rolling)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return standardize(super().score(layer, signals)) + frozen_scores(layer)
