"""Question answering over a long context with a compressed cache."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.cache import EvictionCache
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


@torch.inference_mode()
def prefill(model: PreTrainedModel, ids: torch.Tensor, cache: EvictionCache, chunk: int | None = None) -> torch.Tensor:
    """Process the prompt ``ids`` into ``cache``, compressed under its policy: in one pass, or
    ``chunk`` tokens per pass (each chunk attends to the retained entries plus itself, then the
    cache evicts back to its budget: never more than ``budget + chunk`` entries per KV head).
    The prompt then ends: whatever is fed next is decoded, not compressed with it. Returns the
    logits after the prompt's last token, ``[B, V]``."""
    check_chunk(chunk)
    ids = ids.to(model.device)
    if cache.prompt_length is None and cache.get_seq_length() == 0:
        cache.prompt_length = ids.shape[-1]  # keep= refers to the whole prompt
    step = chunk or ids.shape[-1]
    for start in range(0, ids.shape[-1], step):
        chunk_ids = ids[:, start : start + step]
        logits = model(input_ids=chunk_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    cache.end_prompt()
    return logits[:, -1]


def check_chunk(chunk: int | None) -> None:
    """Refuse a prefill chunk that is not a positive number of tokens."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"the prefill chunk must be a positive number of tokens (or None: one pass), got {chunk!r}")


@torch.inference_mode()
def continue_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    ids: torch.Tensor,
    cache: EvictionCache,
    max_new_tokens: int,
    **constraints: object,
) -> torch.Tensor:
    """Greedy generation after ``ids``, of which ``cache`` may already hold a prefix; returns
    the new token ids ``[n]`` (decode-time policies keep evicting). ``constraints`` are
    deterministic generation options such as ``no_repeat_ngram_size``."""
    ids = ids.to(model.device)
    output = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **constraints,
    )
    return output[0, ids.shape[-1] :]


def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str = "",
    *,
    answer_prefix: str = "",
    policy: str | Policy = "full",
    budget: int | None = None,
    keep: float | None = None,
    query_aware: bool = False,
    max_new_tokens: int = 64,
    cache: EvictionCache | None = None,
    prefill_chunk: int | None = None,
) -> str:
    """Answer ``question`` about ``context`` with a KV cache compressed by ``policy``.

    The context is compressed once on its own (*context-only*); with ``query_aware`` the
    question is part of the compressed prompt (all of it but its last token). Question and answer prefix are then fed and
    the answer is decoded greedily; decode-time policies keep evicting while it is written.
    Pass ``cache`` to inspect the cache afterwards (its policy and budget are used).
    ``prefill_chunk``: compress the prompt ``prefill_chunk`` tokens at a time (bounded memory:
    at most ``budget + prefill_chunk`` entries per KV head, :meth:`EvictionCache.peak_entries`).
    """
    if cache is None:
        cache = EvictionCache(model, policy, budget=budget, keep=keep)
    elif policy != "full" or budget is not None or keep is not None:
        raise ValueError("give either cache= or policy=/budget=/keep= (the cache already has its policy and budget)")
    head, tail = split_prompt(tokenizer, context, question, answer_prefix)
    if tail.shape[-1] == 0:  # a bare prompt without a chat template (base models): its last token starts decoding
        head, tail = head[:, :-1], head[:, -1:]
    ids = torch.cat([head, tail], dim=-1)
    # query-aware: everything but the last prompt token is compressed; that token starts decoding
    prefill(model, ids[:, :-1] if query_aware else head, cache, prefill_chunk)
    new_tokens = continue_greedy(model, tokenizer, ids, cache, max_new_tokens)
    return tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
