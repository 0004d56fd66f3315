"""Question answering over a long context with a compressed cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.batching import left_padded, padded_positions
from kvevict.cache import EvictionCache
from kvevict.compat import with_cache
from kvevict.policies import Policy

CONTEXT_QUESTION_SEPARATOR = "\n\n"


def split_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str = "",
    answer_prefix: str = "",
    *,
    chat_template: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the context part and of the rest (question + generation prompt +
    answer prefix), ``[1, n]`` each. The chat template is applied when the tokenizer has one
    (and ``chat_template`` is true); otherwise the text is ``context\\n\\nquestion prefix``."""
    user = context + (CONTEXT_QUESTION_SEPARATOR + question if question else "")
    if chat_template and tokenizer.chat_template:
        messages = [{"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        special = False  # the template already holds the special tokens
        text += answer_prefix
    else:
        text, special = user, True
        text += " " + answer_prefix if answer_prefix else ""
    split = text.index(context) + len(context)
    head = tokenizer(text[:split], add_special_tokens=special, return_tensors="pt").input_ids
    tail = tokenizer(text[split:], add_special_tokens=False, return_tensors="pt").input_ids
    return head, tail


CONTEXT_MARK = "\ue000"
"""A character no template holds, standing for a context already in the cache (:func:`question_ids`)."""


def question_ids(
    tokenizer: PreTrainedTokenizerBase, question: str, answer_prefix: str = "", *, chat_template: bool = True
) -> torch.Tensor:
    """Token ids ``[1, m]`` of what follows a context prefilled on its own (:func:`split_prompt`'s
    rest: the question, the end of the user turn, the generation prompt and the answer prefix),
    for a context that is only in the cache (a saved, compressed document)."""
    return split_prompt(tokenizer, CONTEXT_MARK, question, answer_prefix, chat_template=chat_template)[1]


def greedy_after(
    model: PreTrainedModel, cache: EvictionCache, ids: torch.Tensor, max_new_tokens: int, stop_tokens: Sequence[int]
) -> list[int]:
    """Feed ``ids`` ``[1, m]`` after what ``cache`` holds (its prompt done: a decode pass), then
    decode greedily until a stop token or ``max_new_tokens``; returns the new tokens."""
    tokens: list[int] = []
    with torch.inference_mode():
        logits = model(input_ids=ids.to(model.device), **with_cache(cache)).logits[0, -1]
        while len(tokens) < max_new_tokens:
            tokens.append(int(logits.argmax()))
            if tokens[-1] in stop_tokens or len(tokens) == max_new_tokens:
                break
            token = torch.tensor([[tokens[-1]]], device=model.device)
            logits = model(input_ids=token, **with_cache(cache)).logits[0, -1]
    return tokens


def stop_tokens_of(model: PreTrainedModel) -> list[int]:
    """The model's end-of-sequence tokens (its generation config's)."""
    eos = model.generation_config.eos_token_id
    return list(eos) if isinstance(eos, list) else [] if eos is None else [eos]


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    ids: torch.Tensor,
    cache: EvictionCache,
    mask: torch.Tensor | None = None,
    chunk: int | None = None,
    *,
    every_logit: bool = False,
    progress: bool = False,
) -> torch.Tensor:
    """Process the prompt ``ids`` into ``cache``, compressed under its policy: in one pass, or
    ``chunk`` tokens per pass (each chunk attends to the retained entries plus itself, then the
    cache evicts back to its budget: never more than ``budget + chunk`` entries per KV head, or
    :meth:`~kvevict.policies.Policy.prompt_held` ``+ chunk`` before the last chunk).
    ``mask``: the attention mask of a left-padded batch; real tokens get positions from 0, as in
    ``generate``. The prompt then ends: whatever is fed next is decoded, not compressed with it.
    Returns the logits after the prompt's last token, ``[B, V]``; with ``every_logit``, those
    after each of its tokens, ``[B, n, V]`` (each chunk's read through the entries retained before it).
    ``progress``: a progress bar over the chunks (a long document)."""
    from tqdm import tqdm

    check_chunk(chunk)
    ids = ids.to(model.device)
    if cache.prompt_length is None and cache.get_seq_length() == 0:
        cache.prompt_length = ids.shape[-1]  # keep= refers to the whole prompt
    if mask is not None:
        mask = mask.to(model.device)
        positions = padded_positions(mask)
    step = chunk or ids.shape[-1]
    logits = []
    starts = range(0, ids.shape[-1], step)
    for start in tqdm(starts, desc="prefill", unit="chunk", disable=not progress or len(starts) < 2):
        end = start + step
        extra = {} if mask is None else {"attention_mask": mask[:, :end], "position_ids": positions[:, start:end]}
        output = model(
            input_ids=ids[:, start:end],
            **with_cache(cache),
            use_cache=True,
            logits_to_keep=int(not every_logit),
            **extra,
        )
        logits.append(output.logits)
    cache.end_prompt()
    return torch.cat(logits, dim=1) if every_logit else output.logits[:, -1]


def check_chunk(chunk: int | None) -> None:
    """Refuse a prefill chunk that is not a positive number of tokens."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"the prefill chunk must be a positive number of tokens (or None: one pass), got {chunk!r}")


@torch.inference_mode()
def continue_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    ids: torch.Tensor,
    cache: EvictionCache | None,
    max_new_tokens: int,
    mask: torch.Tensor | None = None,
    **constraints: object,
) -> torch.Tensor | list[torch.Tensor]:
    """Greedy generation after ``ids``, of which ``cache`` may already hold a prefix; returns
    the new token ids ``[n]`` (decode-time policies keep evicting). With ``mask`` (a left-padded
    batch ``[B, n]``): a list of each row's new tokens, up to its end of sequence, as alone.
    ``constraints`` are deterministic generation options such as ``no_repeat_ngram_size``."""
    ids = ids.to(model.device)
    output = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask.to(model.device),
        **with_cache(cache),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad_token_id(tokenizer),
        **constraints,
    )
    new = output[:, ids.shape[-1] :]
    if mask is None:
        return new[0]
    eos = model.generation_config.eos_token_id
    ends = torch.isin(
        new, torch.tensor(eos if isinstance(eos, list) else [] if eos is None else [eos], device=new.device)
    )
    # a row that ended is padded while the others go on: cut it after its end, as generated alone
    return [row[: int(end.nonzero()[0]) + 1] if bool(end.any()) else row for row, end in zip(new, ends)]


def compress(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    heads: Sequence[torch.Tensor],
    tails: Sequence[torch.Tensor],
    cache: EvictionCache,
    *,
    query_aware: bool,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``cache`` with one batch of prompts (contexts ``heads``, the rest ``tails``,
    ``[1, n]`` each, left-padded into one batch): the contexts alone, or (``query_aware``) each
    whole prompt but its last token, which starts decoding. Returns the whole prompts' batch
    ``(input_ids, attention_mask)`` to continue from (context-only: the rest is padded on its
    own, after the contexts)."""
    pad = pad_token_id(tokenizer)
    if query_aware:
        ids, mask = left_padded([torch.cat([head, tail], dim=-1) for head, tail in zip(heads, tails)], pad)
        prefill(model, ids[:, :-1], cache, mask[:, :-1], chunk)
        return ids, mask
    head_ids, head_mask = left_padded(heads, pad)
    prefill(model, head_ids, cache, head_mask, chunk)
    tail_ids, tail_mask = left_padded(tails, pad)
    return torch.cat([head_ids, tail_ids], dim=-1), torch.cat([head_mask, tail_mask], dim=-1)


def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str | Sequence[str],
    question: str | Sequence[str] = "",
    *,
    answer_prefix: str = "",
    policy: str | Policy = "full",
    budget: int | None = None,
    keep: float | None = None,
    query_aware: bool = False,
    max_new_tokens: int = 64,
    cache: EvictionCache | None = None,
    prefill_chunk: int | None = None,
    quant: str | None = None,
    quant_group: int | None = None,
    residual: int | None = None,
) -> str | list[str]:
    """Answer ``question`` about ``context`` with a KV cache compressed by ``policy``.

    The context is compressed once on its own (*context-only*); with ``query_aware`` the
    question is part of the compressed prompt (all of it but its last token). Question and answer
    prefix are then fed and the answer is decoded greedily; decode-time policies keep evicting while it is written.
    Pass ``cache`` to inspect the cache afterwards (its policy and budget are used).

    Lists of contexts and/or questions (a single string goes with every item of the other
    list) are answered as one left-padded batch, each row evicted on its own: returns a list
    with, for each, what it gets alone.
    ``prefill_chunk``: compress the prompts ``prefill_chunk`` tokens at a time (bounded memory:
    at most ``budget + prefill_chunk`` entries per KV head, :meth:`EvictionCache.peak_entries`).
    ``quant``: hold the retained entries quantized (``"int8"``, ``"int4"``, ``"int2"``; KIVI,
    :mod:`kvevict.quant`), ``quant_group`` and ``residual`` as :class:`EvictionCache`'s (None: its defaults).
    """
    batched = not isinstance(context, str) or not isinstance(question, str)
    contexts = [context] if isinstance(context, str) else list(context)
    questions = [question] if isinstance(question, str) else list(question)
    if len(contexts) == 1 < len(questions):
        contexts *= len(questions)
    if len(questions) == 1 < len(contexts):
        questions *= len(contexts)
    if not contexts or len(contexts) != len(questions):
        raise ValueError(
            f"give as many contexts as questions (or one of either), got {len(contexts)} and {len(questions)}"
        )
    if cache is None:
        cache = EvictionCache(
            model, policy, budget=budget, keep=keep, quant=quant, quant_group=quant_group, residual=residual
        )
    elif policy != "full" or any(x is not None for x in (budget, keep, quant, quant_group, residual)):
        raise ValueError(
            "give either cache= or policy=/budget=/keep=/quant=/quant_group=/residual= (the cache already has "
            "its policy, budget and storage)"
        )
    heads, tails = [], []
    for text, ask in zip(contexts, questions):
        head, tail = split_prompt(tokenizer, text, ask, answer_prefix)
        if tail.shape[-1] == 0:  # a bare prompt without a chat template (base models): its last token starts decoding
            head, tail = head[:, :-1], head[:, -1:]
        heads.append(head)
        tails.append(tail)
    ids, mask = compress(model, tokenizer, heads, tails, cache, query_aware=query_aware, chunk=prefill_chunk)
    new_tokens = continue_greedy(model, tokenizer, ids, cache, max_new_tokens, mask)
    replies = [tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in new_tokens]
    return replies if batched else replies[0]
