"""Label-free fidelity: how closely a policy follows the full cache (DESIGN §4).

The full cache's greedy answer is replayed, teacher-forced, under the policy: at every
answer position we compare the policy's next-token distribution with the full cache's.
This works for prefill compression (replay the answer after the compressed prompt) and for
decode-time eviction (replay long generations token by token, evicting as generation
would).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import Cache, PreTrainedModel

from kvevict.batching import left_padded
from kvevict.cache import EvictionCache
from kvevict.compat import with_cache
from kvevict.generation import prefill


@dataclass(frozen=True)
class Fidelity:
    top1: float
    """Share of answer positions where the policy's most likely token is the full cache's
    (for a plain greedy answer: the answer's own token)."""
    kl: float
    """Mean KL(full ‖ policy) over answer positions, in nats."""
    ppl: float
    """Perplexity of the full cache's answer tokens under the policy."""
    tokens: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def fidelity_metrics(reference_logits: torch.Tensor, policy_logits: torch.Tensor, tokens: torch.Tensor) -> Fidelity:
    """Top-1 agreement, mean KL(full ‖ policy) and perplexity from ``[T, V]`` logits that
    predict the ``T`` reference ``tokens`` (computed in fp32, log domain)."""
    reference = reference_logits.float().log_softmax(dim=-1)
    policy = policy_logits.float().log_softmax(dim=-1)
    kl = (reference.exp() * (reference - policy)).sum(dim=-1).clamp_min(0).mean()
    nll = -policy.gather(-1, tokens[:, None].to(policy.device)).mean()
    top1 = (policy.argmax(dim=-1) == reference.argmax(dim=-1)).float().mean()
    return Fidelity(top1=top1.item(), kl=kl.item(), ppl=nll.exp().item(), tokens=int(tokens.numel()))


@torch.inference_mode()
def replay(
    model: PreTrainedModel, cache: Cache, ids: torch.Tensor, answer: torch.Tensor, *, step_by_step: bool
) -> torch.Tensor:
    """Teacher-force ``answer`` ``[T]`` after the prompt ``ids`` ``[1, n]`` (``cache`` may
    already hold a prefix of it). Returns the ``[T, V]`` logits that predict each answer
    token. ``step_by_step`` feeds the answer one token per pass, as generation does, so
    decode-time eviction happens at the same steps; otherwise it is fed in one pass."""
    ids, answer = ids.to(model.device), answer.to(model.device)
    logits = [model(input_ids=ids[:, cache.get_seq_length() :], **with_cache(cache)).logits[0, -1:]]
    if isinstance(cache, EvictionCache):  # the answer is decoded, not a chunk of the prompt
        cache.end_prompt()
    forced = answer[:-1]
    if step_by_step:
        logits += [model(input_ids=token.view(1, 1), **with_cache(cache)).logits[0, -1:] for token in forced]
    elif forced.numel():
        logits.append(model(input_ids=forced[None], **with_cache(cache)).logits[0])
    return torch.cat(logits, dim=0)


@torch.inference_mode()
def reference_logits(model: PreTrainedModel, ids: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Full-cache logits predicting each ``answer`` token after ``ids`` (one forward pass)."""
    sequence = torch.cat([ids, answer[None, :-1].to(ids.device)], dim=-1).to(model.device)
    return model(input_ids=sequence).logits[0, ids.shape[-1] - 1 :]


FULL_BLOCK = 64
"""Forced tokens the full cache takes per pass in :func:`teacher_forced` (it evicts nothing, so
a block in one pass gives the logits that one token per pass would, at a fraction of the time)."""


@torch.inference_mode()
def teacher_forced(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    sequences: Sequence[Sequence[int]],
    make_cache: Callable[[], EvictionCache],
    progress: bool = False,
) -> list[tuple[float, float]]:
    """Teacher-forced fidelity of a cache against the full cache along given sequences: row
    ``i`` feeds ``prompts[i]`` ``[1, n_i]`` then ``sequences[i]`` (``T`` tokens each) token by
    token, both through a cache from ``make_cache`` (evicting as generation would) and through
    the full cache, as one left-padded batch each. At every one of the ``T`` positions the two
    next-token distributions are compared; returns per row (top-1 agreement, mean
    KL(full ‖ cache) in nats), in fp32 and the log domain. Fed a policy's own generation this
    asks whether the full cache would have predicted it; fed the full cache's, whether the policy
    would: neither breaks down because the free-running sequences diverged once."""
    from tqdm import tqdm

    length = len(sequences[0])
    if any(len(tokens) != length for tokens in sequences) or len(prompts) != len(sequences):
        raise ValueError("teacher forcing takes one sequence of the same number of tokens per prompt")
    ids, mask = left_padded(list(prompts))
    forced = torch.tensor([list(tokens) for tokens in sequences], device=model.device)
    cache, full = make_cache(), EvictionCache(model, "full")
    logits, after_prompt = prefill(model, ids, cache, mask), prefill(model, ids, full, mask)[:, None]

    def full_block(first: int, last: int) -> torch.Tensor:
        """The full cache's logits after forced tokens ``first .. last − 1``, in one pass (it evicts
        nothing, so that is what one token per pass gives)."""
        tokens = forced[:, first:last]
        positions = full.next_positions() + torch.arange(tokens.shape[1], device=model.device)
        return model(input_ids=tokens, position_ids=positions, **with_cache(full)).logits

    agree = torch.zeros(len(prompts), device=model.device)
    kl = torch.zeros(len(prompts), device=model.device)
    for t in tqdm(range(length), desc="teacher forcing", unit="token", disable=not progress):
        block = t % FULL_BLOCK
        if block == 0:  # the logits predicting positions t .. t + FULL_BLOCK − 1
            if t == 0:
                full_logits = torch.cat([after_prompt, full_block(0, FULL_BLOCK - 1)], dim=1)
            else:
                full_logits = full_block(t - 1, t - 1 + FULL_BLOCK)
        policy, reference = logits.float().log_softmax(dim=-1), full_logits[:, block].float().log_softmax(dim=-1)
        agree += policy.argmax(dim=-1) == reference.argmax(dim=-1)
        kl += (reference.exp() * (reference - policy)).sum(dim=-1).clamp_min(0)
        if t + 1 < length:  # the evicting cache, as generation: one token per pass
            token = forced[:, t : t + 1]
            logits = model(input_ids=token, position_ids=cache.next_positions(), **with_cache(cache)).logits[:, -1]
    cache.close()
    full.close()
    return [(a / length, k / length) for a, k in zip(agree.tolist(), kl.tolist())]
