"""How many entries a request holds, step by step, under a uniform budget: the arithmetic of
:class:`~kvevict.cache.EvictionCache`'s schedule (``RowView.eviction_due``), as a pure function
of the tokens processed, so that vLLM's scheduler (which frees and allocates blocks) and its
workers (which evict and compact) agree on every request's length without telling each other.

A leaf module: it imports neither vLLM nor the cache, so both hosts and the tests share it.

The schedule, for a prompt of ``P`` tokens and a budget ``B`` (``keep=`` resolved against ``P``):

- the prompt's pass holds all ``P`` entries while it attends, then, if the policy evicts at
  prefill and ``P > B``, keeps ``B``;
- decode step ``s`` (the first token after the prompt is step 1) appends one entry, then, if
  the policy evicts while decoding, the head holds more than ``B`` and ``s`` is a multiple of
  ``interval``, keeps ``B``: between evictions a head holds at most ``B + interval - 1``
  entries after a step, ``B + interval`` during one.
"""

from __future__ import annotations

from dataclasses import dataclass


def lifetime(prompt_length: int, max_tokens: int | None, max_model_len: int) -> int:
    """The most tokens a request may process: its prompt and every token it may generate, within
    the engine's longest sequence (``max_tokens`` None: up to it). The scheduler sizes admissions
    and the workers decide whether a request ever evicts by it, so they agree."""
    return max_model_len if max_tokens is None else min(prompt_length + max_tokens, max_model_len)


@dataclass(frozen=True)
class EvictionSchedule:
    """One request's schedule (module docstring). ``budget`` None: nothing is ever evicted."""

    prompt_length: int
    budget: int | None
    interval: int
    at_prefill: bool
    at_decode: bool

    def __post_init__(self) -> None:
        if self.prompt_length < 1:
            raise ValueError(f"a request's prompt holds at least one token, got {self.prompt_length}")
        if self.interval < 1:
            raise ValueError(f"interval must be an integer >= 1, got {self.interval}")

    @property
    def after_prompt(self) -> int:
        """Entries a head holds once the prompt's pass evicted (if it did)."""
        if self.at_prefill and self.budget is not None and self.prompt_length > self.budget:
            return self.budget
        return self.prompt_length

    @property
    def first_decode_eviction(self) -> int | None:
        """The decode step of the first eviction while decoding (None: there is none)."""
        if not self.at_decode or self.budget is None:
            return None
        held = self.after_prompt
        # the first multiple of the interval at which the held entries plus the steps exceed the budget
        multiple = max(1, (self.budget - held) // self.interval + 1)
        return multiple * self.interval

    def held(self, tokens: int) -> int:
        """Entries a head holds once ``tokens`` tokens (prompt and decode steps) were processed and
        the last step's eviction, if any, was done. During the prompt's pass (``tokens`` short of
        the prompt, as a chunk of it would be): all of them."""
        if tokens < self.prompt_length:
            return tokens
        steps = tokens - self.prompt_length
        first = self.first_decode_eviction
        if first is None or steps < first:
            return self.after_prompt + steps
        assert self.budget is not None
        return self.budget + (steps - first) % self.interval

    def evicts_within(self, most_tokens: int) -> bool:
        """Whether anything is evicted over at most ``most_tokens`` processed tokens."""
        return self.held(most_tokens) < most_tokens

    def peak(self, most_tokens: int) -> int:
        """The most entries a head holds during any pass over at most ``most_tokens`` processed
        tokens: the prompt while its pass attends, then one more than :meth:`held` before each
        step (``budget + interval`` at each eviction, if the request lives to one)."""
        prompt = self.prompt_length
        if most_tokens <= prompt:
            return most_tokens
        steps, first = most_tokens - prompt, self.first_decode_eviction
        if first is None or steps < first:
            return max(prompt, self.after_prompt + steps)
        assert self.budget is not None
        return max(prompt, self.after_prompt + first, self.budget + min(self.interval, steps - first))
