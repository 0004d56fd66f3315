"""A policy: a method and the stages named beside it, assembled into one pipeline.

``critical+adakv+snapkv`` is SnapKV's scorer and protector, AdaKV's allocator and
CriticalKV's selector. A named stage fills its slot (``critical`` the selector; ``adakv``,
``pyramidkv``, ``headkv`` the allocator; ``moment-nc`` the corrector), so the order of the
prefixes is irrelevant; a slot named twice, or a slot the method fills with its own stage
(MomentKV's MI loop, ThinKV's quotas), is refused when the policy is built, with what is
allowed (DESIGN §1.9). This is what the cache and the attention path talk to.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property, reduce
from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import (
    Attachment,
    Corrector,
    Method,
    Ranking,
    Selector,
    Stage,
    TopK,
    Uniform,
    lowest_slots,
)
from kvevict.signals import NOTHING, Phase, Regime, Requirements, Signals

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.views import CacheSide, EntryView

NAMED_SLOTS = ("observer", "corrector", "selector", "allocator")
"""Slots a prefix may fill, in the order they are spelled in a policy's name."""
ROLES = {
    "observer": "rework what is kept",
    "allocator": "set how many entries each head keeps",
    "selector": "choose the entries to keep",
    "corrector": "correct the attention output",
}


class Policy:
    """An eviction policy: ``method`` plus the ``named`` stages (prefixes) over it.

    Built by :func:`kvevict.make_policy`; refuses, with a ``ValueError``, any composition
    whose stages clash. Holds no per-cache state: one policy object serves any number of
    caches (each cache binds its own copy to its model, see :meth:`bound`).
    """

    def __init__(self, method: Method, named: Sequence[Stage] = ()):
        self.method = method
        spelled = "+".join([*(stage.name for stage in named), method.name])
        brought = method.stages()
        chosen: dict[str, Stage | None] = {
            "allocator": brought.allocator,
            "selector": brought.selector,
            "corrector": brought.corrector,
            "observer": None,  # a method's own observers are a tuple of their own (brought.observers)
        }
        prefixes: dict[str, Stage] = {}
        for stage in named:
            slot = stage.slot
            if slot not in NAMED_SLOTS:
                raise ValueError(f"{spelled}: {stage.name} is a {slot}, which cannot be named over a policy")
            if not method.evicts and not stage.acts_alone:
                raise ValueError(
                    f"{spelled}: {method.name} never evicts, so {stage.name} would have nothing to do; "
                    f"put {stage.name} over an evicting policy"
                )
            if slot in prefixes:
                raise ValueError(
                    f"{spelled}: {prefixes[slot].name} and {stage.name} are both {slot}s (they {ROLES[slot]}); "
                    f"name one {slot}"
                )
            own = chosen[slot]
            if own is not None and slot not in brought.replaceable:
                raise ValueError(
                    f"{spelled}: {stage.name} and {method.name}'s own {own.name} are both {slot}s "
                    f"(they {ROLES[slot]}); {method.clash_advice(stage)}"
                )
            prefixes[slot] = chosen[slot] = stage
        self.named = tuple(prefixes[slot] for slot in NAMED_SLOTS if slot in prefixes)
        """The named stages, in the order of the policy's name."""
        self.scorer = brought.scorer
        self.protector = brought.protector
        self.allocator = chosen["allocator"] or Uniform()
        self.selector = chosen["selector"] or TopK()
        self.corrector: Corrector | None = chosen["corrector"]  # type: ignore[assignment]
        observers = [*brought.observers, *(companion for stage in self.named for companion in stage.companions())]
        if chosen["observer"] is not None:
            observers.append(chosen["observer"])
        stages = [self.scorer, self.protector, self.allocator, self.selector, self.corrector, *observers]
        self.stages: tuple[Stage, ...] = tuple(stage for stage in stages if stage is not None)
        """Every stage, in the order their hooks run."""
        taken: dict[str, int] = {}
        for stage in self.stages:  # a unique namespace each, so no two stages share a key
            taken[stage.name] = taken.get(stage.name, 0) + 1
            stage.namespace = stage.name if taken[stage.name] == 1 else f"{stage.name}#{taken[stage.name]}"
        for stage in self.stages:
            try:
                stage.check(self)
            except ValueError as refusal:
                raise ValueError(f"{spelled}: {refusal}") from None

    def __repr__(self) -> str:
        return f"Policy({self.name!r}, {self.params()!r})"

    @property
    def name(self) -> str:
        """The canonical name: the named stages (corrector, selector, allocator) + the method."""
        return "+".join([*(stage.name for stage in self.named), self.method.name])

    @property
    def summary(self) -> str:
        return (self.named[0] if self.named else self.method).summary

    def params(self) -> dict[str, object]:
        """The method's parameters and, under each prefix, its stage's: what :func:`make_policy`
        takes, ``make_policy(policy.name, **policy.params())`` builds the same policy."""
        return {**self.method.params(), **{stage.name: stage.params() for stage in self.named}}

    # -- when and how much ---------------------------------------------------------------
    @property
    def regime(self) -> Regime:
        return self.method.regime

    def evicts_in(self, phase: Phase, later_chunk: bool = False) -> bool:
        return self.method.evicts_in(phase, later_chunk)

    def recent_window(self, budget: int) -> int:
        """Recent tokens protected at this budget."""
        return self.protector.recent_window(budget)

    def min_budget(self, budget: int) -> int:
        """Smallest budget this policy can honour: its sinks plus its recent window, and what its
        selection needs (ChunkKV's one chunk)."""
        return max(self.protector.min_budget(budget), self.selector.min_budget())

    def check_budget(self, budget: int) -> None:
        need = self.min_budget(budget)
        if budget < self.selector.min_budget():
            raise ValueError(
                f"budget {budget} is smaller than {self.name}'s selection can keep ({self.selector.name}: at least "
                f"{need}); use a budget >= {need}"
            )
        if budget < need:
            raise ValueError(
                f"budget {budget} is smaller than {self.name}'s sinks ({self.protector.sinks}) + recent window "
                f"({self.recent_window(budget)}) = {need}; use a budget >= {need} or make_policy({self.name!r}, "
                "sinks=..., window=...) with smaller values"
            )

    def default_interval(self, budget: int) -> int | None:
        """The decode-time eviction interval the method prescribes (None: every step)."""
        return self.method.default_interval(budget)

    # -- the model ---------------------------------------------------------------------------
    def bind(self, config: PretrainedConfig) -> None:
        """Adapt every stage to the decoder's config (only parameters the user left unset)."""
        for stage in self.stages:
            stage.bind(config)
        self.__dict__.pop("_requirements", None)  # parameters may have changed

    def bound(self, config: PretrainedConfig) -> Policy:
        """A copy of this policy bound to ``config``; this one is left as it is."""
        twin = copy.deepcopy(self)
        twin.bind(config)
        return twin

    @property
    def selects_by_top_scores(self) -> bool:
        """Whether this policy keeps each head's top scores (a scorer and a top-score selector)."""
        return self.scorer is not None and self.selector.by_top_scores

    # -- what the cache and the attention path call ---------------------------------------
    @property
    def corrects_output(self) -> bool:
        """True when :meth:`correct_output` changes the attention output (NC): the reference is
        then attention over the retained entries *plus* that correction."""
        return self.corrector is not None

    @cached_property
    def corrects_by_token_state(self) -> bool:
        """Whether the correction may read the per-token state (see
        :attr:`~kvevict.policies.base.Corrector.reads_token_state`)."""
        return self.corrector is not None and vars(type(self.corrector)).get("reads_token_state", True)

    def requirements(self, phase: Phase, evicting: bool) -> Requirements:
        """Every signal a stage reads in this pass (a function of the stages' parameters,
        computed once per phase and eviction: this runs in every layer of every pass)."""
        known = self.__dict__.setdefault("_requirements", {})
        if (phase, evicting) not in known:
            needs = (stage.requirements(phase, evicting, self.regime) for stage in self.stages)
            known[phase, evicting] = reduce(Requirements.__or__, needs, NOTHING)
        return known[phase, evicting]

    @cached_property
    def reads_decode_row(self) -> bool:
        """Whether a decode step may read the new query's attention row (as such, or as the
        column sums of its one query)."""
        return any(
            needs.last_query_attention or needs.column_sums
            for needs in (self.requirements("decode", False), self.requirements("decode", True))
        )

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        """Initial per-token state of appended entries, each stage's under its namespace."""
        return {
            f"{stage.namespace}/{key}": value
            for stage in self._overriding("new_tokens")
            for key, value in stage.new_tokens(layer, num_new).items()
        }

    def observe(self, layer: EntryView, signals: Signals) -> None:
        for stage in self._overriding("observe"):
            stage.observe(layer, signals)

    def _overriding(self, hook: str) -> tuple[Stage, ...]:
        """The stages whose class implements ``hook`` (the others' is the base class's no-op):
        the hooks run in every layer of every pass, most stages have nothing to do there."""
        known = self.__dict__.setdefault("_overriding_stages", {})
        if hook not in known:
            known[hook] = tuple(
                stage for stage in self.stages if getattr(type(stage), hook) is not getattr(Stage, hook)
            )
        return known[hook]

    def select(self, layer: EntryView, signals: Signals, budget: int) -> torch.Tensor:
        """The entries to keep, ``[B, Hkv, n]`` bool: scores (protected at ``+inf``, padding at
        ``-inf``), then the allocator's counts per head, then the selector's choice."""
        scores, protected = self.selection_scores(layer, signals, budget)
        counts = self.allocator.counts(layer, scores, protected, budget)
        return self._with_prompt_window(layer, self.selector.keep(layer, signals, Ranking(scores, protected, counts)))

    def _with_prompt_window(self, layer: EntryView, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` and, while more of a prompt fed in chunks comes, what the protector holds for
        it (:meth:`~kvevict.policies.base.Protector.held_for_prompt`), which the selection left
        out (:meth:`selection_scores`). With scores that are per-token state, an entry the last
        chunk's selection keeps is kept by every earlier one: each ranks a subset of the entries
        the last one ranks, for the same budget, so holding more between chunks never loses it."""
        held = self.protector.held_for_prompt(layer)
        return keep if held is None else keep | held

    def prompt_held(self, budget: int) -> int:
        """Most entries a head holds after a chunk of a prompt while more of it comes: ``budget``
        and the protector's :meth:`~kvevict.policies.base.Protector.prompt_slack`."""
        return budget + self.protector.prompt_slack(budget)

    def drop_lowest(self, layer: EntryView, signals: Signals, budget: int) -> torch.Tensor | None:
        """The entry ``[B, Hkv]`` (column of ``layer``) each head drops, when this eviction drops
        exactly one per head under uniform counts: what :meth:`select` leaves out, found by one
        minimum (top-k) or the selector's :meth:`~kvevict.policies.base.Selector.drop_one`
        instead of a mask (a decode step's eviction, every step). None for any other eviction
        (:meth:`select` then decides): another allocator, padding or ragged heads, more than one
        entry over the budget, a NaN, or a selector that does not find it so."""
        if (
            layer.valid is not None
            or layer.length != budget + 1
            or type(self.allocator) is not Uniform
            or layer.prompt_continues  # (it may hold more: _with_prompt_window)
        ):
            return None
        if self.keeps_uniform_top:
            scores = self._scores(layer, signals, self.protector.protected(layer, budget))
            return lowest_slots(scores, distinct=self.distinct_scores)
        if type(self.selector).drop_one is Selector.drop_one:  # (no shortcut: select decides, scores once)
            return None
        scores, protected = self.selection_scores(layer, signals, budget)
        counts = self.allocator.counts(layer, scores, protected, budget)
        return self.selector.drop_one(layer, signals, Ranking(scores, protected, counts))

    @cached_property
    def distinct_scores(self) -> bool:
        """Whether the scorer's own class declares :attr:`~kvevict.policies.base.Scorer.distinct_scores`
        (a subclass may score otherwise, so an inherited flag does not count). The lowest of a
        one-drop eviction is then unique: a budget covers the sinks and the window
        (:meth:`check_budget`), so one of the ``budget + 1`` entries is not protected."""
        return vars(type(self.scorer)).get("distinct_scores", False)

    @cached_property
    def keeps_uniform_top(self) -> bool:
        """Whether every head keeps its ``budget`` top scores (:class:`Uniform` counts and
        :class:`TopK`, exactly those classes: a subclass may decide otherwise)."""
        return self.scorer is not None and type(self.allocator) is Uniform and type(self.selector) is TopK

    @cached_property
    def batched(self) -> bool:
        """Whether rows in lockstep may run through the hooks at once: every stage's own class
        declares :attr:`~kvevict.policies.base.Stage.batched` (a subclass that inherits the
        flag has hooks nobody checked for it, so it does not count)."""
        return all(vars(type(stage)).get("batched", False) for stage in self.stages)

    @cached_property
    def stacks_layers(self) -> bool:
        """Whether the decode steps of several layers may end as one batch of their rows
        (:class:`~kvevict.rows.LayerStack`: the new entries' state, the observation and
        :meth:`drop_lowest`): its evictions stack (:attr:`stacks_evictions`) and keep each head's
        top scores, and the own classes of every stage that keeps per-token state declare
        :attr:`~kvevict.policies.base.Stage.stackable`."""
        hooked = {*self._overriding("new_tokens"), *self._overriding("observe")}
        return (
            self.keeps_uniform_top
            and self.stacks_evictions
            and all(vars(type(stage)).get("stackable", False) for stage in hooked)
        )

    @cached_property
    def stacks_evictions(self) -> bool:
        """Whether the decode-step evictions of several layers may run as one batch of their
        rows once each layer observed its own pass (:meth:`drop_lowest` over a
        :class:`~kvevict.rows.LayerStack`): uniform counts, the own classes of the scorer and
        the protector declare :attr:`~kvevict.policies.base.Stage.stackable`, the selector's
        :attr:`~kvevict.policies.base.Selector.stacks`, and every stage that watches evictions
        :attr:`~kvevict.policies.base.Stage.stackable_evictions` (it is told the stack's at once,
        :meth:`on_evict_one`). :attr:`stacks_layers` stacks the per-token hooks too."""
        return (
            self.scorer is not None
            and type(self.allocator) is Uniform
            and all(vars(type(stage)).get("stackable", False) for stage in (self.scorer, self.protector))
            and vars(type(self.selector)).get("stacks", False)
            and all(vars(type(stage)).get("stackable_evictions", False) for stage in self._overriding("on_evict"))
        )

    @property
    def deferred_prefill(self) -> bool:
        """Whether the prefill eviction waits for the end of the prefill forward (the method
        rescores the prompt, or the allocator shares one budget across layers)."""
        return self.method.deferred_prefill or self.allocator.across_layers

    @property
    def rescores_chunks(self) -> bool:
        """Whether a deferred prefill eviction may run after every chunk of a prompt prefilled in
        chunks: the method rescores each chunk and each layer keeps its own budget (chunked
        KVzip), or one budget is pooled across layers over scores a pass computes as it runs
        (``fastkvzip``, ``global+X``): after each chunk has passed every layer, the layers
        evict at once to the pool (:class:`~kvevict.policies.allocation.GlobalBudget`)."""
        if self.allocator.across_layers:
            return not self.method.deferred_prefill
        return self.method.rescores_chunks

    @property
    def batches_alone(self) -> bool:
        """Whether a batch's rows are scored by running each prompt again alone (the method's
        :attr:`~Method.batches_alone`)."""
        return self.method.batches_alone

    @property
    def takes_chunks(self) -> bool:
        """Whether a prompt may be compressed chunk by chunk: the policy evicts as each pass ends,
        or its deferred eviction runs after every chunk (:attr:`rescores_chunks`)."""
        return not self.deferred_prefill or self.rescores_chunks

    def chunk_refusal(self, remedy: str) -> str:
        """The one message of every refusal of a prompt fed in chunks (a policy that does not
        :attr:`takes_chunks`), ending with ``remedy``: what the caller can do instead."""
        return (
            f"policy {self.name!r} evicts the prefill once the whole prompt has run through every layer (it scores the "
            f"prompt with a pass of its own, or shares one budget across layers), so it cannot compress a prompt chunk "
            f"by chunk: {remedy}"
        )

    def select_layers(self, deferred: Sequence[tuple[EntryView, Signals]]) -> list[torch.Tensor]:
        """A deferred prefill eviction: the keep mask of every layer (given with its prefill
        signals), the allocator first seeing the selection scores of all of them."""
        ranked = [self.selection_scores(layer, signals, layer.budget) for layer, signals in deferred]
        layers = [layer for layer, _ in deferred]
        comparable = self.scorer is not None and self.scorer.comparable_scores
        self.allocator.allocate_layers(layers, [scores for scores, _ in ranked], comparable)
        keeps = []
        for (layer, signals), (scores, protected) in zip(deferred, ranked):
            counts = self.allocator.counts(layer, scores, protected, layer.budget)
            keep = self.selector.keep(layer, signals, Ranking(scores, protected, counts))
            keeps.append(self._with_prompt_window(layer, keep))
        return keeps

    def selection_scores(
        self, layer: EntryView, signals: Signals, budget: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The scorer's scores with the protected entries at ``+inf`` and padding at ``-inf``
        (None without a scorer), and the real protected entries. Entries the protector holds for
        a prompt that continues (:meth:`_with_prompt_window`) are kept beside the selection, so
        they are out of it, at ``-inf``: the budget goes to the entries older than them."""
        protected = self.protector.protected(layer, budget)
        if self.scorer is None:
            return None, protected if layer.valid is None else protected & layer.valid
        scores = self._scores(layer, signals, protected)
        held = self.protector.held_for_prompt(layer)
        if held is not None:
            scores = scores.masked_fill(held & ~torch.isposinf(scores), float("-inf"))
        return scores, torch.isposinf(scores)  # the scorer's own +inf (e.g. SnapKV's window) included

    def _scores(self, layer: EntryView, signals: Signals, protected: torch.Tensor) -> torch.Tensor:
        """The scorer's scores (fp32, or its fp64), ``protected`` at ``+inf`` and padding at ``-inf``."""
        scores = self.scorer.score(layer, signals)
        scores = scores if scores.dtype == torch.float64 else scores.float()
        # where, not masked_fill: the same values, and on a CPU half the time (a decode step's
        # eviction fills every head of every stacked layer, every step)
        scores = torch.where(protected, float("inf"), scores)
        return scores if layer.valid is None else torch.where(layer.valid, scores, float("-inf"))

    @cached_property
    def reads_query(self) -> bool:
        """Whether a stage reads the pass's queries when it selects
        (:attr:`~kvevict.policies.base.Stage.reads_query`)."""
        return any(stage.reads_query for stage in self.stages)

    def deferred_signals(self, signals: Signals) -> Signals:
        """What a layer's deferred prefill eviction keeps of its pass's ``signals`` until the end of
        the prefill forward: without the queries (none, ``[B, Hq, 0, d]``) unless a stage reads
        them when it selects. Every layer keeps its signals until then, and its queries
        ``[B, Hq, q, d]`` are as large as the pass (a chunk of 256 tokens: 590 KB a layer of SmolLM2)."""
        if self.reads_query:
            return signals
        b, hq, _, d = signals.query.shape
        return replace(signals, query=signals.query.new_empty(b, hq, 0, d))  # (no view: it would keep them)

    @cached_property
    def observes(self) -> bool:
        """Whether a stage observes a pass (:meth:`observe`): otherwise what a pass brings the
        policy is its new entries' state and, at an eviction, the pass's signals."""
        return bool(self._overriding("observe"))

    @cached_property
    def keeps_token_state(self) -> bool:
        """Whether a stage keeps per-token state (:meth:`new_tokens`): otherwise a pass that neither
        evicts nor is observed asks nothing of the policy."""
        return bool(self._overriding("new_tokens"))

    @cached_property
    def mixes_heads(self) -> bool:
        """Whether a stage reads other KV heads of a layer to score or select one (:attr:`Stage.mixes_heads`)."""
        return any(stage.mixes_heads for stage in self.stages)

    @cached_property
    def watches_evictions(self) -> bool:
        """Whether a stage reads the evicted entries (:meth:`on_evict`): otherwise the cache
        does not build the mask of them."""
        return bool(self._overriding("on_evict"))

    def on_evict(self, layer: EntryView, evicted: torch.Tensor) -> None:
        for stage in self._overriding("on_evict"):
            stage.on_evict(layer, evicted)

    def on_evict_one(self, layer: EntryView, slots: torch.Tensor) -> None:
        for stage in self._overriding("on_evict"):
            stage.on_evict_one(layer, slots)

    def correct_output(
        self,
        layer: EntryView,
        query: torch.Tensor,
        output: torch.Tensor,
        scaling: float,
        log_partition: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel's attention output ``[B, q, Hq, d]`` of a pass, corrected before the layer
        evicts (unchanged without a corrector); ``log_partition``: the queries' ``log Z`` over
        the layer's entries where the pass computed it (a decode step attended by its row)."""
        if self.corrector is None:
            return output
        return self.corrector.correct(layer, query, output, scaling, log_partition)

    def attach(self, model: torch.nn.Module, cache: CacheSide) -> Attachment | None:
        """The method's hooks on ``model`` for ``cache`` (:meth:`~kvevict.policies.base.Stage.attach`)."""
        return self.method.attach(model, cache)

    # -- hidden states: the method's ---------------------------------------------------------
    @property
    def hidden_context(self) -> int:
        return self.method.hidden_context

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.method.hidden_layers(num_layers)

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.method.hidden_scores(changes)
