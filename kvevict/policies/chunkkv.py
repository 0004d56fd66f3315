"""ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference", arXiv 2502.00299): selection in contiguous chunks, a selector
stage named over any scorer (``chunk+snapkv``, ``chunk+keydiff``, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Selector
from kvevict.policies.params import declare, integer
from kvevict.policies.selection import select_by_tiers

if TYPE_CHECKING:
    from kvevict.policies.base import Assembly, Ranking
    from kvevict.signals import Signals
    from kvevict.views import EntryView

CHUNK_RANKS = "ranks"
"""Shared data of :class:`ChunkKV` with ``reuse > 1``: the chunk ranks ``[B, chunks]`` (int64)
the first layer of a group of layers chose, which the group's other layers reuse."""
CHUNKS_OF = "seen"
"""Shared data of :class:`ChunkKV`: ``[B]`` the ``seen`` count of the eviction that chose them."""


def chunk_ranks(scores: torch.Tensor, positions: torch.Tensor, size: int, valid: torch.Tensor | None) -> torch.Tensor:
    """ChunkKV's chunk ranking (arXiv 2502.00299, Eq. 4–5, Alg. 1): the entries at positions
    ``[c·size, (c+1)·size)`` form chunk ``c``; its score is the sum of its entries' scores over
    every KV head of the layer (so every head keeps the same chunks); a chunk holding a
    protected entry (``+inf``) comes first. Returns ``[B, chunks]`` int64, 0 for the best chunk,
    ties to the earlier chunk."""
    rows = scores.shape[0]
    real = scores.isfinite() if valid is None else valid & scores.isfinite()
    chunk = (positions // size).flatten(1)
    chunks = int(chunk.max()) + 1
    totals = torch.zeros(rows, chunks, dtype=torch.float64, device=scores.device)
    totals.scatter_add_(1, chunk, scores.double().where(real, 0).flatten(1))
    protected = scores == float("inf")
    if valid is not None:
        protected &= valid
    hits = torch.zeros(rows, chunks, dtype=torch.float64, device=scores.device)
    totals = totals.masked_fill(hits.scatter_add_(1, chunk, protected.flatten(1).double()) > 0, float("inf"))
    order = totals.argsort(dim=1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(1, order, torch.arange(chunks, device=scores.device).expand_as(order))


def chunk_keep(
    scores: torch.Tensor, chunk: torch.Tensor, ranks: torch.Tensor, counts: torch.Tensor, valid: torch.Tensor | None
) -> torch.Tensor:
    """Keep mask ``[B, Hkv, n]``: each head keeps the entries of its best-ranked chunks (``chunk``
    ``[B, Hkv, n]`` each entry's chunk, ``ranks`` from :func:`chunk_ranks`), ``counts[b, h]`` of
    them; a count that is not a whole number of chunks takes the best-scored entries of the last
    chunk it reaches."""
    chunks = ranks.shape[1]
    rank = ranks.gather(1, chunk.flatten(1).clamp(max=chunks - 1)).view_as(chunk)
    return select_by_tiers(chunks - rank, scores, counts, valid)


class ChunkKV(Selector):
    """ChunkKV's selection over any scorer (``chunk+X``): the held entries are grouped into
    chunks of ``size`` consecutive positions (10, the paper's default), each chunk is scored by
    the sum of ``X``'s scores of its entries over the layer's KV heads, and every head keeps the
    best chunks whole (arXiv 2502.00299, Eq. 4–5, Alg. 1). A budget that is not a whole number
    of chunks fills its last part with the best-scored entries of the next chunk, so every head
    keeps exactly its budget; a budget under one chunk is refused.

    Layer-wise index reuse (the paper's §3.3): with ``reuse = r``, layers ``0, r, 2r, ...``
    choose their chunks and the ``r − 1`` layers after each reuse that choice (``reuse=1``,
    the default, chooses in every layer). The protected entries (``X``'s sinks and window) put
    their chunks first.
    """

    mixes_heads = True  # a chunk's score sums every KV head of the layer
    name = "chunk"
    batched = True
    summary = "keep whole chunks of 10 consecutive tokens by their summed score, the same in every head (ChunkKV)"
    PARAMS = declare(size=integer(10, low=1), reuse=integer(1, low=1))

    def check(self, policy: Assembly) -> None:
        if policy.scorer is None:
            raise ValueError("chunk selects chunks by a scorer's scores; name it over a scoring policy: chunk+snapkv")

    def min_budget(self) -> int:
        """One chunk: a smaller budget keeps no whole chunk."""
        return self.size

    def keep(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor:
        assert ranking.scores is not None
        shared = self.shared(layer.owner)
        seen = torch.as_tensor(layer.seen, device=layer.device).reshape(-1).expand(ranking.scores.shape[0])
        leader = layer.layer_idx % self.reuse == 0
        reused = None
        if not leader and CHUNK_RANKS in shared and torch.equal(shared[CHUNKS_OF], seen):
            reused = shared[CHUNK_RANKS]
        ranks = reused if reused is not None else chunk_ranks(ranking.scores, layer.positions, self.size, layer.valid)
        if leader and self.reuse > 1:
            shared[CHUNK_RANKS], shared[CHUNKS_OF] = ranks, seen.clone()
        if not leader and (layer.layer_idx + 1) % self.reuse == 0 and CHUNK_RANKS in shared:
            del shared[CHUNK_RANKS], shared[CHUNKS_OF]  # the group's last layer: the next eviction chooses anew
        return chunk_keep(ranking.scores, layer.positions // self.size, ranks, ranking.counts, layer.valid)
