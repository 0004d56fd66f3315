"""ExpectedAttention (Devoto et al., NVIDIA 2025, "Expected Attention: KV Cache Compression
by Estimating Attention from Future Queries Distribution"; kvpress's ExpectedAttentionPress).

Future queries are modelled as a Gaussian: the mean ``μ`` and covariance ``Σ`` of the head's
pre-RoPE queries seen so far (the prompt's, sinks skipped; at decode, the recent ones). A key
``k_i`` (post-RoPE, as cached) then receives, in expectation over the query and over the
next ``n_future`` positions, ``E[exp(s·q·k_i)] = exp(z_i)`` with the averaged rotation
``R̄ = mean_t R_t`` (``μ' = R̄μ``, ``Σ' = R̄ΣR̄ᵀ``):

    z_i = s·k_i·μ' + s²·k_iᵀΣ'k_i / 2        (s = 1/√d: the DESIGN's k·μ'/√d + kᵀΣ'k/(2d))

then ``p = softmax_i(z)`` per query head, the GQA mean, and ``(p_i + ε)·‖v_i‖₂`` (ε = 1e-2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.models import rotate_half
from kvevict.policies.base import Method
from kvevict.policies.params import declare, flag, integer, number
from kvevict.signals import Signals, group_reduce

if TYPE_CHECKING:
    from kvevict.views import EntryView

RECENT_QUERIES = "queries"
"""Memo key (this stage's namespace): the last ``stats_window`` pre-RoPE queries ``[B, Hq, m, d]`` fp32 (decode)."""


def rotate_half_matrix(d: int, device: torch.device | None = None) -> torch.Tensor:
    """``P`` with ``P x = rotate_half(x) = [-x₂, x₁]`` (transformers' RoPE convention)."""
    half = d // 2
    eye = torch.eye(half, device=device)
    p = torch.zeros(d, d, device=device)
    p[:half, half:] = -eye
    p[half:, :half] = eye
    return p


def rope_inverse(query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE queries from post-RoPE ones: ``R_t = cos + sin·P`` (``cos``/``sin`` ``[q, d]``
    of the queries' positions, scaled RoPE included) has inverse ``(cos − sin·P)/(cos² + sin²)``
    because ``P`` commutes with the per-pair diagonals and ``P² = −I``. fp32."""
    q = query.float()
    return (q * cos - rotate_half(q) * sin) / (cos * cos + sin * sin)


def average_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``R̄ = mean_t (diag(cos_t) + diag(sin_t)·P)`` over future positions, ``[d, d]`` fp32."""
    d = cos.shape[-1]
    return torch.diag(cos.float().mean(dim=0)) + torch.diag(sin.float().mean(dim=0)) @ rotate_half_matrix(d, cos.device)


def query_statistics(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[B, H, d]`` and (population) covariance ``[B, H, d, d]`` of ``[B, H, m, d]`` queries, fp32."""
    q = queries.float()
    mean = q.mean(dim=2)
    centred = q - mean[:, :, None]
    return mean, centred.transpose(-1, -2) @ centred / q.shape[2]


def expected_logits(
    keys: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor | None, rotation: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``z_i = s·k_i·μ' + s²·k_iᵀΣ'k_i/2`` per query head, ``[B, Hq, n]`` fp32.

    ``keys`` ``[B, Hkv, n, d]`` (post-RoPE); ``mean`` ``[B, Hq, d]`` and ``cov``
    ``[B, Hq, d, d]`` of the pre-RoPE queries (``cov=None``: the mean alone); ``rotation``
    ``R̄`` ``[d, d]``. Query head ``h`` reads KV head ``h // (Hq/Hkv)``.
    """
    b, hkv, n, d = keys.shape
    hq = mean.shape[1]
    k = keys.float()
    mu = (mean.float() @ rotation.T).reshape(b, hkv, hq // hkv, d)  # μ' = R̄μ
    z = torch.einsum("bknd,bkgd->bkgn", k, mu) * scaling
    if cov is not None:
        sigma = (rotation @ cov.float() @ rotation.T).reshape(b, hkv, hq // hkv, d, d)  # Σ' = R̄ΣR̄ᵀ
        z = z + torch.einsum("bknd,bkgde,bkne->bkgn", k, sigma, k) * (scaling * scaling / 2)
    return z.reshape(b, hq, n)


def expected_attention_scores(
    logits: torch.Tensor, values: torch.Tensor, eligible: torch.Tensor, eps: float = 1e-2
) -> torch.Tensor:
    """``(p_i + ε)·‖v_i‖₂`` with ``p = softmax(z)`` over the ``eligible`` entries
    ``[B, Hkv, n]`` (sinks and padding excluded), GQA mean; ``[B, Hkv, n]`` fp32, ``-inf``
    where not eligible."""
    hkv = values.shape[1]
    allowed = eligible.repeat_interleave(logits.shape[1] // hkv, dim=1)
    probs = group_reduce(logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1).nan_to_num(0.0), hkv)
    scores = (probs + eps) * values.float().norm(dim=-1)
    return scores.masked_fill(~eligible, float("-inf"))


class ExpectedAttention(Method):
    """ExpectedAttention (NVIDIA, 2025): keep the entries future queries are expected to read.

    DESIGN §3: ``μ``, ``Σ`` of each head's pre-RoPE queries over the prompt (the first
    ``sinks`` tokens skipped); RoPE averaged over the next ``n_future = 512`` positions;
    ``z_i = k_i·μ'/√d + k_iᵀΣ'k_i/(2d)``; softmax over the non-sink entries, GQA mean,
    ``(p_i + ε)·‖v_i‖`` (``ε = 1e-2``); ``sinks = 4`` kept. Pre-RoPE queries are the pass's
    post-RoPE queries rotated back (exact; q/k norms, as in Qwen3, act before RoPE and stay
    in). At decode (``regime="decode"|"both"``) the statistics are those of the last
    ``stats_window`` queries (prompt and generated). ``covariance=False`` drops the ``Σ`` term.
    Scores are probabilities weighted by value norms, comparable across layers (``global+``).
    """

    name = "expected-attention"
    summary = "what future queries are expected to read: Gaussian query statistics, averaged RoPE (query-agnostic)"
    regimes = ("prefill", "decode", "both")
    comparable_scores = True
    reads_query = True  # its scores at selection: the prompt's statistics and the pass's own queries

    PARAMS = declare(
        n_future=integer(512, low=1),
        eps=number(1e-2, 0),
        covariance=flag(True),
        stats_window=integer(256, low=2),
        sinks=integer(4),
        window=integer(0),
    )

    def pre_rope_queries(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        """The pass's queries before RoPE ``[B, Hq, q, d]`` fp32, from their absolute positions."""
        positions = torch.arange(layer.seen - signals.num_new, layer.seen, device=signals.query.device)
        cos, sin = layer.owner.rotary(positions, layer.layer_idx)
        return rope_inverse(signals.query, cos, sin)

    def observe(self, layer: EntryView, signals: Signals) -> None:
        if self.evicts_in("decode"):  # keep the recent queries for decode-time statistics
            first = max(0, self.sinks - (layer.seen - signals.num_new))
            new = self.pre_rope_queries(layer, signals)[:, :, first:]
            memo = self.memo(layer)
            old = memo.get(RECENT_QUERIES)
            recent = new if old is None else torch.cat([old, new], dim=2)
            memo[RECENT_QUERIES] = recent[:, :, -self.stats_window :]

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        if signals.phase == "prefill":  # the whole prompt's queries, sinks skipped
            queries = self.pre_rope_queries(layer, signals)[:, :, self.sinks :]
        else:
            queries = self.memo(layer)[RECENT_QUERIES]
        if queries.shape[2] == 0:
            raise ValueError(f"expected-attention: no query after the {self.sinks} sinks to estimate statistics")
        mean, cov = query_statistics(queries)
        future = torch.arange(layer.seen, layer.seen + self.n_future, device=queries.device)
        cos, sin = layer.owner.rotary(future, layer.layer_idx)
        logits = expected_logits(
            layer.keys, mean, cov if self.covariance else None, average_rotation(cos, sin), signals.scaling
        )
        eligible = layer.positions >= self.sinks
        if layer.valid is not None:
            eligible &= layer.valid
        return expected_attention_scores(logits, layer.values, eligible, self.eps)
