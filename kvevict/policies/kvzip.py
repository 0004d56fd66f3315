"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", arXiv 2505.23416).

After the context is prefilled, the model is asked to repeat it, teacher-forced: the repeat
input is a repeat instruction and the context itself, fed over the cache in chunks of at most
``chunk`` context tokens (a later chunk's instruction asks to continue from the last
``overlap`` tokens of the previous chunk). An entry ``i`` of a layer and KV head scores

    s_i = max over repeat queries j and the query heads h of the group of  A_h(j, i)

where ``A`` is the repeat query's attention probability (softmax over the context entries
plus the repeat tokens, causal within the repeat; in a sliding-window layer, over those inside
the query's window, as the model reads them). With ``plus=True`` the probability is
weighted by ``‖W_O^h v_i‖₂ / ‖h_j‖₂`` (the value as head ``h`` writes it to the residual
stream, over the norm of that stream at the repeat token: the decoder layer's input). The
repeat pass's own entries are dropped afterwards (:meth:`EvictionCache.scoring_pass`), the
sinks are kept, and the bottom entries of all layers and heads together are evicted (one
pool of ``L·H·B``, no per-head floor, as the paper) or, with ``per_layer=True``, each head
keeps its own budget.

``repeat=shuffled`` (not the paper's) repeats the context's sentences in a seeded random order
instead of in order, so the repeat must find each sentence's next words by their content, as a
question finds its answer, rather than copy on from the previous position (docs/fastkvzip.md,
round 40).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from kvevict.batching import left_padded, padded_positions
from kvevict.compat import multiplies_bf16_natively, with_cache
from kvevict.models import tokenizer_of
from kvevict.policies.allocation import GlobalBudget
from kvevict.policies.base import Method, SinksAndWindow, Stage, Stages
from kvevict.policies.params import Param, choice, declare, flag, integer
from kvevict.signals import (
    COLUMN_SUM_CHUNK,
    LogitSpec,
    SlidingWindow,
    as_dtype,
    as_float32,
    as_spec,
    attention_logits,
    attention_rows,
    group_reduce,
    projected_value_norms,
    query_chunks,
)

if TYPE_CHECKING:
    from kvevict.views import EntryView, ScoringCache

SCORES = "scores"
"""Memo key (this stage's namespace): running max ``[B, Hkv, n_context]`` fp32 over the repeat chunks."""
BEST = "best"
"""Per-token state key (``per_layer``): each entry's best score over the repeat passes it saw ``[B, Hkv, n]`` fp32."""
VALUE_WEIGHTS = "value_weights"
"""Memo key (``plus``): ``‖W_O^h v_i‖₂`` of the context entries ``[B, Hq, n_context]``."""
SCORING_CHUNK = 64
"""Repeat queries per block of :func:`attend_and_score`: its logits ``[B·Hkv, G·64, n]`` fp32 (1.5 MiB
per KV head at 2k) stay in a core's cache through the block's six passes; 256 spilled (25 % slower
on this CPU, docs/fastkvzip.md)."""
FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
NEXT_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
SENTENCE_ENDS = (".", "!", "?")
"""A token ends a sentence (``repeat=shuffled``) when its text, stripped of trailing spaces, ends with one of these
or it holds a line break."""
SHUFFLE_SEED = 0
"""The seed of ``repeat=shuffled``'s sentence order: the same context always gets the same repeat."""


def reconstruction_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    context: int,
    *,
    value_weights: torch.Tensor | None = None,
    query_weights: torch.Tensor | None = None,
    chunk: int = COLUMN_SUM_CHUNK,
    products: torch.dtype | None = None,
    window: SlidingWindow | None = None,
) -> torch.Tensor:
    """KVzip's score of the first ``context`` entries from one repeat pass, ``[B, Hkv, context]`` fp32.

    ``query`` ``[B, Hq, r, d]`` are the repeat queries; ``keys`` ``[B, Hkv, context + r, d]``
    the context entries followed by the repeat's own (causal within the repeat). For each
    entry: the max over the repeat queries and the GQA group of its attention probability,
    each probability first multiplied by ``value_weights[b, h, i]`` and ``query_weights[b, j]``
    when given (KVzip+). Queries are taken ``chunk`` at a time: never an ``r × n`` matrix.
    ``products``: the dtype of the query–key products (:func:`attention_logits`; None: fp32).
    ``window``: a sliding layer's; each repeat query sees only the entries inside it, as the
    model's own attention does (an entry no repeat query sees scores 0).
    """
    best = query.new_zeros(*query.shape[:2], context, dtype=torch.float32)
    for start, stop, rows, keys_seen, _ in query_chunks(query, keys, None, chunk):
        inside = None if window is None else window.visible(start, stop, keys_seen.shape[-2])
        probs = attention_rows(rows, keys_seen, scaling, visible=inside, products=products)[..., :context]
        if query_weights is not None:
            probs = probs * query_weights[:, None, start:stop, None]
        if value_weights is not None:
            probs = probs * value_weights[:, :, None, :]
        best = torch.maximum(best, probs.amax(dim=2))
    return group_reduce(best, keys.shape[1], "max")


def causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, products: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``r`` queries ``[B, Hq, r, d]`` over their own ``r`` keys and values
    ``[B, Hkv, r, d]`` (GQA): the output ``[B, Hq, r, d]`` and each query's log-sum-exp of its
    logits ``[B, Hq, r]`` fp32. On a CPU, torch's fused flash kernel (it skips the blocks above
    the diagonal and returns the log-sum-exp); elsewhere the explicit product. ``products``: the
    dtype all three take (None: the query's; keys and values follow it)."""
    group = query.shape[1] // keys.shape[1]
    dtype = query.dtype if products is None else products
    query, keys, values = as_dtype(query, dtype), as_dtype(keys, dtype), as_dtype(values, dtype)
    if query.is_cpu:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, keys, values, 0.0, True, scale=scaling
        )
        return output, lse.float()
    product = torch.float32 if products is None else products
    logits = attention_logits(query, keys, scaling, products=product)
    lse = logits.logsumexp(dim=-1)
    probs = (logits - lse[..., None]).exp()
    b, hq, r, _ = probs.shape
    grouped = as_dtype(probs, product).reshape(b * keys.shape[1], group * r, r)
    output = torch.bmm(grouped, as_dtype(values, product).flatten(0, 1))
    return as_dtype(output.view(b, hq, r, -1), values.dtype), lse


def attend_and_score(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    context: int,
    *,
    value_weights: torch.Tensor | None = None,
    query_weights: torch.Tensor | None = None,
    chunk: int = SCORING_CHUNK,
    products: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The repeat pass's attention output ``[B, r, Hq, d]`` (the kernel's layout) and KVzip's
    scores ``[B, Hkv, context]`` (as :func:`reconstruction_scores`) from one computation, for
    repeat queries that see every one of the ``context`` entries and, causally, their own.

    The repeat's own block runs through :func:`causal_attention` (its output ``o_R`` and
    log-sum-exp ``λ_R`` per query); the context block, ``chunk`` queries at a time, is one
    grouped product ``ℓ = q·kᵀ·scaling`` with ``m_j = max_i ℓ_ji`` and ``E = exp(ℓ − m)``, the
    only ``exp`` per logit (the output needs it anyway). With ``λ_C = m + log Σ_i E`` and
    ``λ = logaddexp(λ_C, λ_R)`` (the query's log-sum-exp over everything it sees) and
    ``c_j = exp(m_j − λ_j)``: the output is ``c·(E v) + exp(λ_R − λ)·o_R``, and entry ``i``'s
    attention probability under query ``j`` is ``E_ji·c_j``, whose max over queries (and the GQA
    group) is the score. The logits over the context are computed once, not once by the kernel
    and once more to score them, and the repeat's columns, which KVzip does not score, only in
    the fused kernel's causal half.

    ``products``: the dtype both blocks' matrix products take (bf16: KVzip's ``precision``);
    their results, the ``exp`` and the scores stay fp32. None: the context block in fp32, the
    causal block in the query's dtype."""
    b, hq, r, d = query.shape
    hkv = keys.shape[1]
    group = hq // hkv
    dtype = torch.float32 if products is None else products
    own, own_lse = causal_attention(query, keys[:, :, context:], values[:, :, context:], scaling, products)
    context_keys = as_dtype(keys[:, :, :context], dtype).flatten(0, 1).transpose(1, 2)  # [B·Hkv, d, n]
    context_values = as_dtype(values[:, :, :context], dtype).flatten(0, 1)  # [B·Hkv, n, d]
    best = query.new_zeros(b, hq, context, dtype=torch.float32)
    output = query.new_empty(b, r, hq, d, dtype=values.dtype)
    # (scaling the r × d queries, not the r × n logits: one pass fewer)
    scaled = as_dtype(query.float() * scaling, dtype)
    for start in range(0, r, chunk):
        stop = min(start + chunk, r)
        rows = stop - start
        grouped = scaled[:, :, start:stop].reshape(b * hkv, group * rows, d)
        logits = as_float32(torch.bmm(grouped, context_keys))  # [B·Hkv, G·rows, n]
        top = logits.amax(dim=-1, keepdim=True)
        weights = logits.sub_(top).exp_()  # E, in place of the logits
        top, total = top.view(b, hq, rows), weights.sum(dim=-1).view(b, hq, rows)
        own_lse_rows = own_lse[:, :, start:stop]
        lse = torch.logaddexp(top + total.log(), own_lse_rows)
        scale = (top - lse).exp()[..., None]  # c_j
        mixed = as_float32(torch.bmm(as_dtype(weights, dtype), context_values)).view(b, hq, rows, d) * scale
        mixed += own[:, :, start:stop].float() * (own_lse_rows - lse).exp()[..., None]
        output[:, start:stop] = mixed.transpose(1, 2).to(values.dtype)
        probs = weights.view(b, hq, rows, context).mul_(scale)
        if query_weights is not None:
            probs = probs * query_weights[:, None, start:stop, None]
        if value_weights is not None:
            probs = probs * value_weights[:, :, None, :]
        best = torch.maximum(best, probs.amax(dim=2))
    return output, group_reduce(best, hkv, "max")


def sentence_ends(tokenizer: Any, token_ids: list[int]) -> list[bool]:
    """Whether each token ends a sentence (:data:`SENTENCE_ENDS`), from its own text. Blank tokens
    right after an end (a line break after ``?``) belong to the sentence they follow."""
    texts = tokenizer.batch_decode([[token] for token in token_ids])
    ends = ["\n" in text or text.rstrip().endswith(SENTENCE_ENDS) for text in texts]
    for index in range(len(texts) - 1):
        if ends[index] and not texts[index + 1].strip():
            ends[index], ends[index + 1] = False, True
    return ends


def shuffled_sentences(context_ids: torch.Tensor, ends: list[bool], seed: int = SHUFFLE_SEED) -> torch.Tensor:
    """``context_ids`` ``[1, n]`` with its sentences in a seeded random order (``repeat=shuffled``).

    A sentence runs to a token ``ends`` marks, or to the end of the context. Every token
    appears once, and a sentence's tokens stay together and in order."""
    sentences, start = [], 0
    for index, last in enumerate(ends):
        if last:
            sentences.append(context_ids[:, start : index + 1])
            start = index + 1
    if start < len(ends):
        sentences.append(context_ids[:, start:])
    order = torch.randperm(len(sentences), generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.cat([sentences[index] for index in order], dim=-1) if sentences else context_ids


def repeat_chunks(
    context_ids: torch.Tensor,
    first: torch.Tensor,
    later: torch.Tensor,
    suffix: torch.Tensor,
    chunk: int = 2048,
    overlap: int = 8,
) -> list[torch.Tensor]:
    """The teacher-forced repeat inputs ``[1, r]``: chunk ``c`` of the context (``chunk``
    tokens) after ``first`` (the instruction) and ``suffix`` (what the chat template puts
    before the answer); a later chunk is preceded by ``later`` and the last ``overlap``
    tokens of the chunk before it, so it restarts where that one ended."""
    pieces = list(context_ids.split(chunk, dim=-1))
    inputs = []
    for index, piece in enumerate(pieces):
        lead = first if index == 0 else torch.cat([later, pieces[index - 1][:, -overlap:]], dim=-1)
        inputs.append(torch.cat([lead, suffix, piece], dim=-1))
    return inputs


class KVzip(Method):
    """KVzip: keep the entries the model reads to reconstruct the context (query-agnostic).

    DESIGN §3: repeat instruction + the context in chunks of ``chunk = 2048`` tokens
    (``overlap = 8`` tokens of the previous chunk restart a later one); score = max over
    repeat queries and the GQA group of the attention probability; ``sinks = 4`` kept; the
    repeat entries are discarded; global bottom-k across layers and heads (``per_layer=True``:
    each head keeps ``B``). ``plus=True``: KVzip+ weighting ``‖W_O^h v_i‖₂ / ‖h_j‖₂``.
    The repeat instruction is tokenised with the model's tokenizer (known for models from
    :func:`kvevict.load_model`, or give ``tokenizer=``); without one the repeat is the bare
    context (a warning says so). Prefill only; costs about one more prefill per context
    (see docs/policies.md).

    ``precision``: what the repeat pass computes in; the prefill's own entries are untouched.
    ``fp32``: the scoring products in fp32, the layers in the model's dtype.
    ``bf16``: the layers run under bf16 autocast (a model in fp32) and the attention and
    scoring products take bf16 operands, as the paper's GPU runs do; the softmax, the ``exp``
    and the scores stay fp32. It is faster where bf16 is multiplied in hardware (a warning
    says when it is not; docs/fastkvzip.md, rounds 12 and 14). ``auto`` (default): bf16 where
    the device multiplies bf16 in hardware, fp32 elsewhere. In bf16 each row of a batch is
    scored by prefilling its prompt again alone (:meth:`_score_alone`): bf16 rounds the
    last-bit differences between a padded and a lone forward up to whole bf16 steps, which
    would let a row keep other near-tied entries than alone. For the same reason bf16 KVzip
    may keep slightly different entries on different CPUs (instruction sets sum bf16 products
    in different orders): on SmolLM2, 99.4–99.6 % of the entries fp32 keeps, and near-tied ones
    otherwise. ``precision=fp32`` keeps the same entries on every CPU.

    ``repeat``: ``context`` (default, the paper's) repeats the context in order; ``shuffled``
    repeats its sentences (ending at ``.``, ``!``, ``?`` or a line break) in an order seeded by
    :data:`SHUFFLE_SEED`, each sentence whole (:func:`shuffled_sentences`; needs a tokenizer).

    Chunked prefill (``per_layer=True`` only; docs/fastkvzip.md, round 3): after each chunk's
    forward the chunk alone is repeated over the retained entries and the chunk, every entry
    keeps the max of its scores over the repeats it saw (per-token state), and each head is
    evicted back to its budget: at most ``budget + chunk`` entries per KV head between passes
    (plus the repeat's own while it runs).
    """

    name = "kvzip"
    summary = "keep what the model reads to repeat the context (KVzip reconstruction, global budget; prefill)"
    regimes = ("prefill",)
    deferred_prefill = True
    rescores_chunks = True  # with per_layer=true: each chunk repeated and evicted in turn (class docstring)
    comparable_scores = True

    PARAMS = declare(
        chunk=integer(2048, low=1),
        overlap=integer(8),
        per_layer=flag(False),
        plus=flag(False),
        sinks=integer(4),
        precision=choice("auto", "auto", "fp32", "bf16"),
        instruction=Param(FIRST_INSTRUCTION, "a string", lambda v: isinstance(v, str)),
        repeat=choice("context", "context", "shuffled"),
    )

    def __init__(self, *, tokenizer: Any = None, **params: object):
        """``tokenizer``: the one to write the repeat instruction with (default: the one
        :func:`kvevict.load_model` loaded with the model). Not a recorded parameter."""
        super().__init__(**params)
        if not self.per_layer and self.sinks < 1:
            raise ValueError("kvzip: a global budget needs sinks >= 1 (with no floor, a head could keep nothing)")
        self._tokenizer = tokenizer

    def stages(self) -> Stages:
        # the paper's global bottom-k: one pool over every layer and head, no per-head floor
        allocator = None if self.per_layer else GlobalBudget(safeguard=0.0)
        return Stages(scorer=self, protector=SinksAndWindow(self.sinks, 0), allocator=allocator)

    def clash_advice(self, stage: Stage) -> str:
        return f"kvzip shares one budget across layers itself; use {stage.name}+kvzip[per_layer=true]"

    @property
    def batches_alone(self) -> bool:  # bf16 (``auto`` may be): each row of a batch prefilled again alone
        return self.precision != "fp32"

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        if not self.per_layer:
            return {}
        return {BEST: layer.keys.new_zeros(*layer.keys.shape[:2], num_new, dtype=torch.float32)}

    def score(self, layer: EntryView, signals: Any) -> torch.Tensor:
        scores = self.memo(layer).pop(SCORES)
        if not self.per_layer:
            return scores
        best = self.state(layer)[BEST]  # the scores of the earlier chunks' repeats (0 for this chunk's entries)
        best.copy_(torch.maximum(best, scores))
        return best

    # -- the repeat pass --------------------------------------------------------------
    def products(self, device: torch.device) -> torch.dtype | None:
        """The repeat pass's product dtype under ``precision`` (class docstring) on ``device``: bf16,
        or None (fp32 scoring). ``auto``: bf16 where ``device`` multiplies bf16 in hardware."""
        native = self.precision != "fp32" and multiplies_bf16_natively(device)
        if self.precision == "fp32" or (self.precision == "auto" and not native):
            return None
        if not native:
            warnings.warn(
                f"kvzip[precision=bf16]: this {device.type} does not multiply bf16 in hardware, so the repeat pass "
                "runs slower than in fp32",
                stacklevel=3,
            )
        return torch.bfloat16

    def repeat_inputs(self, decoder: torch.nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """The repeat pass's chunks for a prefilled ``input_ids`` ``[1, n]``."""
        tokenizer = self._tokenizer if self._tokenizer is not None else tokenizer_of(decoder)
        empty = input_ids.new_zeros(1, 0)
        if tokenizer is None:
            if self.repeat == "shuffled":
                raise ValueError(
                    "kvzip[repeat=shuffled] needs a tokenizer to find the context's sentences; load the model with "
                    "kvevict.load_model or give kvzip a tokenizer="
                )
            if self.instruction:
                warnings.warn(
                    "kvzip: no tokenizer is known for this model, so the repeat pass feeds the bare context without "
                    "its instruction; load the model with kvevict.load_model or give kvzip a tokenizer=",
                    stacklevel=2,
                )
            return repeat_chunks(input_ids, empty, empty, empty, self.chunk, self.overlap)

        def ids(text: str) -> torch.Tensor:
            return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.long).reshape(1, -1)

        prefix, suffix = "", ""
        if getattr(tokenizer, "chat_template", None):  # the instruction ends the user turn, the answer repeats
            marker = "\x00kvzip\x00"
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
            )
            prefix, suffix = text.split(marker)
        start = ids(prefix).shape[-1] if prefix else 0
        template = ids(prefix).to(input_ids.device)
        context = input_ids[:, start:] if start and torch.equal(input_ids[:, :start], template) else input_ids
        if self.repeat == "shuffled":
            context = shuffled_sentences(context, sentence_ends(tokenizer, context[0].tolist()))
        first = ids(self.instruction).to(input_ids.device) if self.instruction else empty
        later = ids(NEXT_INSTRUCTION).to(input_ids.device) if self.instruction else empty
        return repeat_chunks(context, first, later, ids(suffix).to(input_ids.device), self.chunk, self.overlap)

    def rescore(self, cache: ScoringCache, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """The repeat pass, chunk by chunk, each a scoring pass that leaves no trace: every
        layer's running max of the reconstruction scores lands in its memo (read by :meth:`score`).
        A batch repeats each row's own prompt (the rows that deferred their eviction), as one
        left-padded batch per chunk; each row scores only its own entries, as alone. In bf16 a
        batch's rows are scored one by one, each prompt prefilled again alone (:meth:`_score_alone`)."""
        if input_ids is None:
            raise ValueError("kvzip needs the prefill's input_ids (not inputs_embeds) to run its repeat pass")
        prompts = {view.row: view.num_new for view, _ in cache.deferred}  # the prompt, or this chunk of it
        products = self.products(input_ids.device)
        if products is not None and len(input_ids) > 1:
            self._score_alone(cache, decoder, input_ids, prompts, products)
        else:
            self._repeat(cache, decoder, input_ids, prompts, products)

    def _score_alone(
        self,
        cache: ScoringCache,
        decoder: torch.nn.Module,
        input_ids: torch.Tensor,
        prompts: dict[int, int],
        products: torch.dtype,
    ) -> None:
        """Score each row of a batch exactly as its prompt alone: bf16 rounds the last-bit differences
        between a padded batch's forward and a lone one up to whole bf16 steps, so each prompt is
        prefilled again alone, in a cache of its own that holds what the lone prompt's holds when its
        repeat starts (:meth:`EvictionCache.alone`: same policy and budget, the eviction left
        waiting), repeated there, and its scores handed to its row (one more prefill per row than
        fp32's batched repeat)."""
        _check_one_pass(cache)
        for row, length in prompts.items():
            prompt = input_ids[row : row + 1, input_ids.shape[-1] - length :]
            solo = cache.alone()
            try:
                decoder(input_ids=prompt, **with_cache(solo), use_cache=True)
                self._repeat(solo, decoder, prompt, {0: length}, products)
                for layer, alone in zip(cache.eviction_layers, solo.eviction_layers):
                    self.memo(layer.row_view(row))[SCORES] = self.memo(alone.row_view(0)).pop(SCORES)
            finally:
                solo.close()

    def _repeat(
        self,
        cache: ScoringCache,
        decoder: torch.nn.Module,
        input_ids: torch.Tensor,
        prompts: dict[int, int],
        products: torch.dtype | None,
    ) -> None:
        """Run the repeat of each of ``prompts`` (row: its prompt's tokens at the end of ``input_ids``)
        through ``cache`` (:meth:`rescore`)."""
        layers_in_bf16 = products is not None and next(decoder.parameters()).dtype == torch.float32
        repeats = {
            row: self.repeat_inputs(decoder, input_ids[row : row + 1, input_ids.shape[-1] - length :])
            for row, length in prompts.items()
        }
        norms: dict[int, torch.Tensor] = {}
        hooks = []
        if self.plus:  # ‖h_j‖ of the residual stream entering each decoder layer at the repeat tokens
            for index, module in enumerate(decoder.layers):

                def remember(module: torch.nn.Module, args: tuple, kwargs: dict, index: int = index) -> None:
                    hidden = args[0] if args else kwargs["hidden_states"]
                    norms[index] = hidden.float().norm(dim=-1)

                hooks.append(module.register_forward_pre_hook(remember, with_kwargs=True))

        def observe(
            layer: Any, query: torch.Tensor, spec: LogitSpec, module: torch.nn.Module | None
        ) -> torch.Tensor | None:
            """Score the layer's repeat queries; attend by the same logits (:func:`attend_and_score`) when the
            pass is one row's whole repeat over its untouched prompt (no padding, window, soft-cap or sinks)."""
            output = None
            for row in prompts:
                view = layer.row_view(row)
                if view.num_new:
                    whole = (
                        layer.batch_size == 1
                        and view.num_new == query.shape[-2]
                        and view.keys is layer.keys
                        and layer.valid is None
                        and layer.window is None
                        and not layer.compacted
                        and as_spec(spec).softcap is None
                        and as_spec(spec).sinks is None
                    )
                    output = observe_row(view, query[row : row + 1, :, -view.num_new :], spec, module, whole)
            return output

        def observe_row(
            view: Any, query: torch.Tensor, spec: LogitSpec, module: torch.nn.Module | None, attend: bool
        ) -> torch.Tensor | None:
            context = view.length - view.num_new  # the row's prompt entries, then its repeat's
            memo = self.memo(view)
            value_weights = query_weights = None
            if self.plus:
                if VALUE_WEIGHTS not in memo:
                    if module is None or not hasattr(module, "o_proj"):
                        raise ValueError("kvzip[plus=true] needs the attention module's output projection (o_proj)")
                    memo[VALUE_WEIGHTS] = projected_value_norms(
                        view.values[:, :, :context], module.o_proj.weight, query.shape[1], ord=2, per_query_head=True
                    )
                value_weights = memo[VALUE_WEIGHTS]
                query_weights = 1.0 / norms[view.layer_idx][view.row : view.row + 1, -view.num_new :].clamp(min=1e-6)
            output = None
            if attend:
                output, scores = attend_and_score(
                    query,
                    view.keys,
                    view.values,
                    as_spec(spec).scaling,
                    context,
                    value_weights=value_weights,
                    query_weights=query_weights,
                    products=products,
                )
            else:
                scores = reconstruction_scores(
                    query,
                    view.keys,
                    spec,
                    context,
                    value_weights=value_weights,
                    query_weights=query_weights,
                    products=products,
                    window=SlidingWindow.of(view, view.num_new),
                )
            old = memo.get(SCORES)
            memo[SCORES] = scores if old is None else torch.maximum(old, scores)
            return output

        try:
            for chunk in range(max(len(inputs) for inputs in repeats.values())):
                pieces = [
                    repeats[row][chunk] if chunk < len(repeats.get(row, ())) else None for row in range(len(input_ids))
                ]
                autocast = torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=layers_in_bf16)
                with cache.scoring_pass(observe), autocast:
                    decoder(**_repeat_batch(cache, pieces), **with_cache(cache), use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        for layer in cache.eviction_layers:
            for row in prompts:
                self.memo(layer.row_view(row)).pop(VALUE_WEIGHTS, None)


def _repeat_batch(cache: ScoringCache, pieces: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The decoder inputs of one repeat chunk: one row's ``input_ids`` as they are; a batch left-padded
    (a row with no chunk: all padding), after each row's prompt (its first pass's left padding masked),
    at positions that continue each row's own."""
    if len(pieces) == 1:
        return {"input_ids": pieces[0]}
    _check_one_pass(cache)
    device = next(piece for piece in pieces if piece is not None).device
    ids, mask = left_padded(
        [piece.cpu() if piece is not None else torch.zeros(1, 0, dtype=torch.long) for piece in pieces]
    )
    ids, mask = ids.to(device), mask.to(device)
    past = (
        torch.arange(cache.get_seq_length(), device=device)[None, :]
        >= torch.tensor(cache.row_offsets, device=device)[:, None]
    )
    seen = torch.tensor([info.seen for info in cache.eviction_layers[0].rows], device=device)[:, None]
    return {
        "input_ids": ids,
        "attention_mask": torch.cat([past.long(), mask], dim=-1),
        "position_ids": seen + padded_positions(mask),
    }


def _check_one_pass(cache: ScoringCache) -> None:
    """A batch is scored only when its prompts came in one (left-padded) pass."""
    if cache.eviction_layers[0].passes != 1:
        raise ValueError("kvzip scores a batch whose prompts came in one pass (left-padded): do not split the prefill")
