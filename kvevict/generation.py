"""Question answering over a long context with a compressed cache."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.cache import EvictionCache
from kvevict.policies import Policy

CONTEXT_QUESTION_SEPARATOR = "\n\n"


def split_prompt(
    tokenizer: PreTrainedTokenizerBase, context: str, question: str = "", answer_prefix: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the context part and of the rest (question + generation prompt +
    answer prefix), ``[1, n]`` each. The chat template is applied when the tokenizer has one."""
    user = context + (CONTEXT_QUESTION_SEPARATOR + question if question else "")
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
        special = False  # the template already holds the special tokens
    else:
        text, special = user, True
    text += answer_prefix
    split = text.index(context) + len(context)
    head = tokenizer(text[:split], add_special_tokens=special, return_tensors="pt").input_ids
    tail = tokenizer(text[split:], add_special_tokens=False, return_tensors="pt").input_ids
    return head, tail


@torch.inference_mode()
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
) -> str:
    """Answer ``question`` about ``context`` with a KV cache compressed by ``policy``.

    The context is compressed once on its own (*context-only*); with ``query_aware`` the
    question is part of the compressed prompt. Question and answer prefix are then fed and
    the answer is decoded greedily; decode-time policies keep evicting while it is written.
    Pass ``cache`` to inspect the cache afterwards (its policy and budget are used).
    """
    if cache is None:
        cache = EvictionCache(model, policy, budget=budget, keep=keep)
    elif policy != "full" or budget is not None or keep is not None:
        raise ValueError("give either cache= or policy=/budget=/keep= (the cache already has its policy and budget)")
    head, tail = split_prompt(tokenizer, context, question, answer_prefix)
    ids = torch.cat([head, tail], dim=-1).to(model.device)
    if not query_aware:
        model(input_ids=ids[:, : head.shape[-1]], past_key_values=cache, use_cache=True)
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
    )
    return tokenizer.decode(output[0, ids.shape[-1] :], skip_special_tokens=True).strip()
