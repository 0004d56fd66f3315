"""DuoAttention's offline optimisation of head roles (arXiv 2410.10819, §3.2): every KV head gets
a gate ``α ∈ [0, 1]`` mixing its full attention with streaming attention (sinks and a recent
window), ``attn = α·full + (1 − α)·streaming`` (Eq. 1). The model stays frozen; the gates are
trained so that the final hidden states over a synthetic passkey task's answer match the full
model's (Eq. 2, the distillation loss), while an L1 term pushes gates to 0 (Eq. 3):
``L = L_distill + λ·Σ|α|``. Heads whose gate stays high need the full context: the retrieval heads
of :class:`~kvevict.policies.duoattention.DuoAttention`.

The mixed attention runs through a registered attention function (transformers'
``AttentionInterface``): the model's classes are untouched.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface

from kvevict.policies.allocation import model_fingerprint
from kvevict.signals import causal_mask

MIXED = "kvevict_duo_mixed"
"""The attention function the gates are trained through."""


@dataclass(frozen=True)
class Recipe:
    """The optimisation's settings. The paper trains on contexts of thousands of tokens with a
    longer streaming pattern on GPUs; these defaults are sized for the embedded models on a 2-core
    CPU (~10 minutes per model) and for the budgets of a few hundred entries they are run at."""

    sinks: int = 16
    recent: int = 112
    """The streaming pattern trained against: the deployed budget is ``sinks + recent`` or so."""
    length: int = 512
    """Tokens of each synthetic context (essay haystack, passkeys inside, the question at the end)."""
    passkeys: int = 3
    passkey_words: int = 5
    steps: int = 60
    lr: float = 0.02
    penalty: float = 0.05
    """λ of the L1 term on the gates."""
    seed: int = 0


class _Training:
    """The gates being trained and the streaming pattern, read by :func:`_mixed_attention`."""

    gates: torch.Tensor | None = None
    sinks = 0
    recent = 0


def streaming_mask(base: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """``base`` (``[..., q, k]`` bool, True: attends) restricted to each query's first ``sinks``
    keys and its ``recent`` most recent ones (the query itself included)."""
    queries, keys = base.shape[-2:]
    q = torch.arange(keys - queries, keys, device=base.device)[:, None]
    k = torch.arange(keys, device=base.device)[None, :]
    return base & ((k < sinks) | (q - k < recent))


def _mixed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if _Training.gates is None:
        raise RuntimeError(f"the attention function {MIXED!r} runs only inside train_gates")
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if attention_mask is None:
        base = causal_mask(query.shape[2], key.shape[2], query.device)
    else:
        base = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    sdpa = torch.nn.functional.scaled_dot_product_attention
    full = sdpa(query, key, value, attn_mask=base, scale=scaling)
    streaming = sdpa(
        query, key, value, attn_mask=streaming_mask(base, _Training.sinks, _Training.recent), scale=scaling
    )
    alpha = _Training.gates[module.layer_idx].clamp(0, 1).repeat_interleave(groups)[None, :, None, None]
    mixed = alpha * full + (1 - alpha) * streaming
    return mixed.transpose(1, 2).contiguous(), None


AttentionInterface.register(MIXED, _mixed_attention)


def passkey_sample(
    tokenizer: Any, haystack: list[int], vocabulary: list[str], recipe: Recipe, rng: random.Random
) -> tuple[list[int], int]:
    """One synthetic passkey context (the paper's training data, §3.2): ``recipe.passkeys`` passkeys
    of ``passkey_words`` words drawn from ``vocabulary``, placed at random depths of an essay window,
    then the request to recite them, then the passkeys themselves. Returns the token ids
    (``recipe.length`` of them) and how many of the last tokens are the answer (where the loss is taken)."""
    keys = [" ".join(rng.choices(vocabulary, k=recipe.passkey_words)) for _ in range(recipe.passkeys)]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    inserts = [encode(f" Passkey {i + 1} is: {key}. Remember it. ") for i, key in enumerate(keys)]
    question = encode("\n\nRecite the passkeys in order.\n")
    answer = encode(" ".join(f"Passkey {i + 1} is: {key}." for i, key in enumerate(keys)))
    room = recipe.length - len(question) - len(answer) - sum(map(len, inserts))
    if room < recipe.passkeys:
        raise ValueError(f"a context of {recipe.length} tokens has no room for {recipe.passkeys} passkeys")
    start = rng.randrange(0, len(haystack) - room)
    filler = haystack[start : start + room]
    cuts = sorted(rng.sample(range(room), recipe.passkeys))
    ids, previous = [], 0
    for cut, insert in zip(cuts, inserts):
        ids += filler[previous:cut] + insert
        previous = cut
    ids += filler[previous:] + question + answer
    return ids, len(answer)


def train_gates(model: Any, tokenizer: Any, haystack: str, recipe: Recipe, progress: Any = None) -> torch.Tensor:
    """The gates ``[layers, Hkv]`` of ``model`` after ``recipe.steps`` steps of Adam, one passkey
    context per step (``progress``: a tqdm-like wrapper of the step range). Deterministic for a seed
    on one thread."""
    rng = random.Random(recipe.seed)
    vocabulary = sorted({word.lower() for word in re.findall(r"[A-Za-z]{4,10}", haystack)})
    config = model.config.get_text_config()
    gates = torch.ones(config.num_hidden_layers, config.num_key_value_heads, requires_grad=True)
    optimiser = torch.optim.Adam([gates], lr=recipe.lr)
    haystack_ids = tokenizer.encode(haystack, add_special_tokens=False)
    model.requires_grad_(False)
    decoder = model.get_decoder()
    previous = model.config._attn_implementation
    steps = range(recipe.steps) if progress is None else progress(range(recipe.steps))
    _Training.sinks, _Training.recent = recipe.sinks, recipe.recent
    try:
        for _ in steps:
            ids, answer = passkey_sample(tokenizer, haystack_ids, vocabulary, recipe, rng)
            input_ids = torch.tensor([ids], device=model.device)
            model.set_attn_implementation("sdpa")
            with torch.no_grad():
                target = decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0, -answer:].float()
            model.set_attn_implementation(MIXED)
            _Training.gates = gates
            hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0, -answer:].float()
            distill = (hidden - target).pow(2).sum(-1).mean()
            loss = distill + recipe.penalty * gates.abs().sum()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            with torch.no_grad():
                gates.clamp_(0, 1)
    finally:
        _Training.gates = None
        model.set_attn_implementation(previous)
    return gates.detach().clone()


def save_gates(path: Path, config: Any, gates: torch.Tensor, recipe: Recipe, source: str) -> None:
    """Write ``gates`` for the model of ``config`` (its fingerprint picks them when the model loads)."""
    record = {
        "model": model_fingerprint(config),
        "recipe": {**asdict(recipe), "haystack": source},
        "gates": gates.tolist(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
