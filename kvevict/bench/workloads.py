"""The jobs a throughput run serves (:class:`~kvevict.bench.serving.Job`).

* :class:`PromptJob`: a prompt prefilled (compressed under the setting's policy, in chunks
  where only that admits it), then generated from: the one-shot workload (a long prompt,
  a short answer) and the long-generation one (a short prompt, a long generation).
* :class:`QuestionJob`: *compress once, ask many times*. A document's context is prefilled
  and compressed once (:class:`Library`); each question about it starts from a copy of that
  compressed cache, fed the question. Under the full cache this is prefix caching: the
  context's entries are computed once and copied per question, none dropped.

What every job of a setting learns from the ones before it (:class:`Learned`) sharpens
the predictions admission makes before a cache exists; the real figures are checked once
it does (:mod:`kvevict.bench.serving`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from kvevict.bench.longgen import GENERATION
from kvevict.bench.runner import Setting
from kvevict.bench.serving import padded_bytes
from kvevict.cache import EvictionCache, decode_ceiling
from kvevict.compat import with_cache
from kvevict.generation import prefill


def setting_cache(setting: Setting, model: PreTrainedModel, prompt_length: int) -> EvictionCache:
    """A batch-1 cache of ``setting`` for a prompt of ``prompt_length`` tokens."""
    budget = {} if setting.policy == "full" else {"budget": setting.budget, "keep": setting.keep}
    return EvictionCache(model, setting.policy, prompt_length=prompt_length, quant=setting.quant, **budget)


@dataclass
class Learned:
    """What a setting's built caches showed, for the next predictions."""

    prefill_factor: float = 1.0
    """Most entries per head a one-pass prefill held, per prompt token (KVzip's repeat: ~2)."""
    chunk_peak: int = 0
    """Most entries per head a chunked prefill held."""
    retained_share: float = 0.0
    """Most entries per head a compressed prompt kept, per prompt token (head-wise budgets)."""
    chunks: list[int | None] = field(default_factory=list)


def _prompt_entries(cache: EvictionCache, length: int, learned: Learned) -> int:
    """Entries per head a prompt of ``length`` tokens leaves in ``cache`` once prefilled."""
    budget = cache.budget.resolve(length)
    policy = cache.policy
    if budget is None or not (policy.evicts_in("prefill") or policy.deferred_prefill):
        return length
    if policy.allocator.name == "uniform":
        return min(length, budget)
    return min(length, round(learned.retained_share * length)) if learned.retained_share else length


def predict_ceiling(cache: EvictionCache, length: int, new_tokens: int, learned: Learned) -> int:
    """The ceiling (:meth:`EvictionCache.row_ceiling`) of a row whose prompt of ``length``
    tokens is still to be prefilled into ``cache``."""
    if any(cache.policy.allocator.keeps_all(layer.layer_idx) for layer in cache.eviction_layers):
        return length + new_tokens  # a head that keeps every entry (DuoAttention's retrieval heads)
    held = _prompt_entries(cache, length, learned)
    budget = cache.budget.resolve(length)
    if budget is None or not cache.policy.evicts_in("decode"):
        return decode_ceiling(held, new_tokens, None, 1)
    return decode_ceiling(held, new_tokens, budget, cache.interval or cache.policy.default_interval(budget) or 1)


class PromptJob:
    """A prompt ``[1, n]`` to prefill under ``setting``, then ``new_tokens`` to generate."""

    def __init__(
        self,
        model: PreTrainedModel,
        ids: torch.Tensor,
        setting: Setting,
        new_tokens: int,
        learned: Learned,
        chunk: int | None = None,
    ):
        self.model, self.ids, self.setting, self.new_tokens = model, ids, setting, new_tokens
        self.learned, self.chunk = learned, chunk
        self._cache: EvictionCache | None = None
        self._chunk_used: int | None = None
        self._start_peak: list[int] = []

    @property
    def length(self) -> int:
        return self.ids.shape[-1]

    def cache(self) -> EvictionCache:
        if self._cache is None:
            self._cache = setting_cache(self.setting, self.model, self.length)
        return self._cache

    def _chunkable(self) -> int | None:
        """The prefill chunk the setting may use: where the policy scores a prompt chunk by
        chunk and its budget plus a chunk holds less than the whole prompt. A decode-time
        policy that evicts later chunks holds the first one whole, so it takes chunks of at most
        its budget (:class:`~kvevict.policies.selection.PromptKeeping`)."""
        cache, chunk = self.cache(), self.chunk
        policy = cache.policy
        if chunk is None or self.setting.policy == "full" or not policy.takes_chunks:
            return None
        budget = cache.budget.resolve(self.length)
        if not policy.evicts_in("prefill", True) or budget is None or self._chunk_entries(chunk) >= self.length:
            return None
        return chunk if policy.evicts_in("prefill") or chunk <= budget else None

    def _chunk_entries(self, chunk: int) -> int:
        """Most entries a head holds while the prompt goes in ``chunk`` tokens at a time under a
        per-head budget: what the policy holds between chunks (its budget, and a prompt window's
        slack before the last chunk) and the chunk."""
        cache = self.cache()
        return cache.policy.prompt_held(cache.budget.resolve(self.length)) + chunk

    def transient_bytes(self, free_bytes: int, column_bytes: Sequence[int]) -> int | None:
        one_pass = padded_bytes([round(self.length * self.learned.prefill_factor)] * len(column_bytes), column_bytes)
        if one_pass <= free_bytes:
            self._chunk_used = None
            return one_pass
        chunk = self._chunkable()
        if chunk is None:
            return None
        if self.learned.chunk_peak:
            peak = self.learned.chunk_peak
        else:  # head-wise budgets exceed the budget on some heads
            uniform = self.cache().policy.allocator.name == "uniform"
            peak = min(self.length, self._chunk_entries(chunk)) if uniform else self.length
        self._chunk_used = chunk
        chunked = padded_bytes([peak] * len(column_bytes), column_bytes)
        return chunked if chunked <= free_bytes else None

    def predicted_ceiling(self) -> list[int]:
        cache = self.cache()
        return [predict_ceiling(cache, self.length, self.new_tokens - 1, self.learned)] * len(cache.eviction_layers)

    def start(self) -> tuple[EvictionCache, torch.Tensor]:
        cache, learned = self.cache(), self.learned
        logits = prefill(self.model, self.ids, cache, chunk=self._chunk_used)
        if self._chunk_used is None:
            learned.prefill_factor = max(learned.prefill_factor, cache.peak_entries() / self.length)
        else:
            learned.chunk_peak = max(learned.chunk_peak, cache.peak_entries())
        self._start_peak = [cache.peak_entries()] * len(cache.eviction_layers)  # (every layer held it)
        held = max(layer.rows[0].width for layer in cache.eviction_layers)
        learned.retained_share = max(learned.retained_share, held / self.length)
        learned.chunks.append(self._chunk_used)
        self._cache = None
        return cache, logits[0]

    def start_peak(self) -> list[int]:
        return self._start_peak


@dataclass
class Document:
    """A context to compress once and the questions to ask about it: ``context`` ``[1, n]``
    and, per question, the tokens that follow the context ``[1, m]`` (question and answer prefix)."""

    context: torch.Tensor
    questions: list[torch.Tensor]
    samples: list[Any] = field(default_factory=list)
    """The task's sample of each question (for scoring)."""


class Library:
    """The compressed documents of a compress-once-ask-many run: a document is prefilled and
    compressed once, when its first question starts, and freed when its last one has started."""

    def __init__(self, model: PreTrainedModel, documents: Sequence[Document], setting: Setting, learned: Learned):
        self.model, self.documents, self.setting, self.learned = model, documents, setting, learned
        self.caches: dict[int, EvictionCache] = {}
        self.asked = [0] * len(documents)
        self.document_bytes: list[int] = []
        """Resident bytes of each document once compressed."""

    def resident_bytes(self) -> int:
        return sum(cache.kv_bytes() for cache in self.caches.values())

    def compressed(self, document: int) -> EvictionCache:
        """The document's compressed cache (built the first time: a one-pass context-only prefill)."""
        if document not in self.caches:
            ids = self.documents[document].context
            cache = setting_cache(self.setting, self.model, ids.shape[-1])
            prefill(self.model, ids, cache)
            self.learned.prefill_factor = max(self.learned.prefill_factor, cache.peak_entries() / ids.shape[-1])
            self.caches[document] = cache
            self.document_bytes.append(cache.kv_bytes())
        return self.caches[document]

    def asked_one(self, document: int) -> None:
        """A question about ``document`` started; its last one frees the document's cache."""
        self.asked[document] += 1
        if self.asked[document] == len(self.documents[document].questions):
            self.caches.pop(document).close()


class QuestionJob:
    """Question ``question`` about document ``document`` of ``library``: a copy of the
    compressed document, fed the question, then ``new_tokens`` to generate."""

    def __init__(self, library: Library, document: int, question: int, new_tokens: int):
        self.library, self.document, self.question, self.new_tokens = library, document, question, new_tokens
        self._start_peak: list[int] = []

    @property
    def _tail(self) -> torch.Tensor:
        return self.library.documents[self.document].questions[self.question]

    def _context_length(self) -> int:
        return self.library.documents[self.document].context.shape[-1]

    def transient_bytes(self, free_bytes: int, column_bytes: Sequence[int]) -> int | None:
        length, learned = self._context_length(), self.library.learned
        if self.document in self.library.caches:  # a copy of the compressed document, then the question
            transient = padded_bytes(self.predicted_ceiling(), column_bytes)
        else:  # the document's own prefill the first time
            transient = padded_bytes([round(length * learned.prefill_factor)] * len(column_bytes), column_bytes)
        return transient if transient <= free_bytes else None

    def predicted_ceiling(self) -> list[int]:
        library, grows = self.library, self._tail.shape[-1] + self.new_tokens
        cache = library.caches.get(self.document)
        if cache is not None:  # each layer's longest head in the compressed document
            return [layer.rows[0].width + grows for layer in cache.eviction_layers]
        probe = setting_cache(library.setting, library.model, self._context_length())
        try:
            held = _prompt_entries(probe, self._context_length(), library.learned)
            return [held + grows] * len(probe.eviction_layers)
        finally:
            probe.close()

    def start(self) -> tuple[EvictionCache, torch.Tensor]:
        library = self.library
        compressing = self.document not in library.caches
        document = library.compressed(self.document)
        prefill_peak = document.peak_entries() if compressing else 0  # (a copy inherits the document's peaks)
        questions = self._tail.shape[-1]
        self._start_peak = [max(prefill_peak, layer.rows[0].width + questions) for layer in document.eviction_layers]
        cache = copy.deepcopy(document)
        library.asked_one(self.document)
        logits = library.model(input_ids=self._tail.to(library.model.device), **with_cache(cache)).logits
        return cache, logits[0, -1]

    def start_peak(self) -> list[int]:
        return self._start_peak


class EssayTokens:
    """Greedy next tokens for long generations (``longgen``'s generation options): never a
    ``banned`` token (the end of text) and never one that repeats an n-gram of the row's own
    sequence, so a small model's greedy text stays long and informative. Each row's n-grams
    are indexed as it grows (O(1) per token)."""

    def __init__(self, banned: Sequence[int] | set[int] = (), size: int = GENERATION["no_repeat_ngram_size"]):
        self.banned, self.size = sorted(banned), size
        self._grams: dict[int, tuple[list[int], dict[tuple[int, ...], set[int]]]] = {}

    def __call__(self, logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> list[int]:
        logits = logits.float().clone()
        if self.banned:
            logits[:, self.banned] = -torch.inf
        n = self.size - 1
        for row, history in enumerate(histories):
            indexed, grams = self._grams.setdefault(id(history), ([0], {}))
            for end in range(max(indexed[0], n), len(history)):  # the n-grams completed since the last call
                grams.setdefault(tuple(history[end - n : end]), set()).add(history[end])
            indexed[0] = len(history)
            repeated = grams.get(tuple(history[-n:])) if len(history) >= n else None
            if repeated:
                logits[row, list(repeated)] = -torch.inf
        return logits.argmax(-1).tolist()
