"""The stages an eviction policy is assembled from (DESIGN §1.6, §1.9).

A policy (:class:`~kvevict.policies.pipeline.Policy`) is a few stages with one duty each:

* **scorer** (:class:`Scorer`): the importance of every retained entry, higher kept first;
* **protector** (:class:`Protector`): entries that always survive (sinks, recent window, prompt);
* **allocator** (:class:`Allocator`): how many entries each KV head keeps (uniform, AdaKV,
  PyramidKV, HeadKV);
* **selector** (:class:`Selector`): which entries fill those counts (top-k, CriticalKV's two
  stages, MomentKV's MI loop, ThinKV's and LagKV's quotas);
* **corrector** (:class:`Corrector`): a change of the attention output (MomentKV's NC);
* **observers**: stages that only keep statistics (MomentKV's moments of the evicted set).

Every stage may declare the signals it reads (:meth:`Stage.requirements`) and keep per-token
state (:meth:`Stage.new_tokens`, :meth:`Stage.observe`), always under its own namespace
(:meth:`Stage.state`, :meth:`Stage.memo`, :meth:`Stage.shared`), so two stages never collide.
Nothing per cache lives on a stage object: a policy can serve any number of caches.

A registered base policy is a :class:`Method`: its own scorer (most methods are one
``score`` function), plus the stages it brings (:meth:`Method.stages`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch

from kvevict.budgets import capped_share, descending_ranks
from kvevict.policies.params import Param, choice, declare
from kvevict.signals import NOTHING, Phase, Regime, Requirements, Signals

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.views import CacheSide, EntryView, ScoringCache


class Attachment(Protocol):
    """What :meth:`Stage.attach` returns: hooks on the model, removed by :meth:`close`."""

    def close(self) -> None: ...


Slot = Literal["scorer", "protector", "allocator", "selector", "corrector", "observer"]


class Assembly(Protocol):
    """What :meth:`Stage.check` may read of the policy being assembled: the
    :class:`~kvevict.policies.pipeline.Policy` it is part of (which imports this module)."""

    method: Method
    scorer: Scorer | None
    protector: Protector

    @property
    def regime(self) -> Regime: ...

    @property
    def selects_by_top_scores(self) -> bool: ...


class Namespaced(MutableMapping):
    """One stage's part of a store shared by the stages: ``holder.<attribute>`` (a layer's
    ``state`` or ``memo``, a cache's ``shared``); key ``k`` of the stage is ``"<namespace>/k"``
    there. The store is looked up at every access, so a view stays valid when the layer
    replaces its ``state`` (as it does on every eviction)."""

    def __init__(self, holder: object, attribute: str, namespace: str):
        self._holder, self._attribute = holder, attribute
        self._prefix = f"{namespace}/"

    @property
    def _store(self) -> dict:
        return getattr(self._holder, self._attribute)

    def __getitem__(self, key: str) -> object:
        return self._store[self._prefix + key]

    def __setitem__(self, key: str, value: object) -> None:
        self._store[self._prefix + key] = value

    def __delitem__(self, key: str) -> None:
        del self._store[self._prefix + key]

    def __iter__(self) -> Iterator[str]:
        return iter([key[len(self._prefix) :] for key in self._store if key.startswith(self._prefix)])

    def __len__(self) -> int:
        return sum(1 for key in self._store if key.startswith(self._prefix))


class Stage:
    """A part of a policy with one duty (see the module docstring).

    Parameters are declared in ``PARAMS`` and checked when the stage is built (None, or not
    given: the default); the ones the user gave are remembered, so :meth:`bind` never
    overwrites them with a model's default. Hooks default to doing nothing.
    """

    name: ClassVar[str]
    slot: ClassVar[Slot]
    summary: ClassVar[str] = ""
    PARAMS: ClassVar[Mapping[str, Param]] = {}
    batched: ClassVar[bool] = False
    """The stage's hooks treat the rows of a layer (dim 0) independently, read ``seen`` and
    ``prompt_length`` as ints or ``[B, 1, 1]`` tensors, and keep in ``memo`` and ``shared``
    only tensors (or dataclasses of tensors) with the rows along dim 0, so rows in lockstep
    can run through them at once (:meth:`EntryView.views`; each row's data is read stacked
    and written back split, :class:`~kvevict.rows.StackedRows`).
    Only the class's own declaration counts (a subclass re-declares it), see
    :attr:`~kvevict.policies.Policy.batched`."""
    reads_query: ClassVar[bool] = False
    """The stage reads the pass's queries (:attr:`~kvevict.signals.Signals.query`) when it
    selects (:meth:`Scorer.score`, :meth:`Selector.keep`, ...), not only when it observes the
    pass: a deferred prefill eviction keeps every layer's queries until the end of the prefill
    forward only for such a stage (:meth:`~kvevict.policies.Policy.deferred_signals`)."""
    mixes_heads: ClassVar[bool] = False
    """A head's scores or selection read other KV heads of its layer (TOVA's mean over every head,
    ChunkKV's chunk sums): under vLLM's tensor parallelism, where each worker holds some heads, such
    a policy is refused."""
    rewrites_keys: ClassVar[bool] = False
    """The stage writes the kept keys in place (``rerotate``, ``think``): refused over a quantized
    cache, whose stages see dequantized copies."""
    acts_alone: ClassVar[bool] = False
    """The stage has work of its own over a policy that never evicts (``think`` prunes channels of
    the full cache); other named stages are refused over one."""
    stackable: ClassVar[bool] = False
    """The stage's per-token hooks (:meth:`new_tokens`, :meth:`observe`, :meth:`Scorer.score`,
    :meth:`Protector.protected`) are the same function in every layer, treat rows
    independently and read only the layer's per-token tensors (``positions``, ``state``, the
    pass's attention signals, the frozen hidden-state scores ``owner.hidden.lookup``) and its
    row counters (``seen``, ``prompt_length``, ``budget``, ``decode_step``, ``window``,
    ``num_new``, ``passes``, ``phase()``): no keys or values, no ``layer_idx``, ``memo`` or
    other ``owner`` data; ``new_tokens`` has no side effect and ``observe`` writes only
    ``state``. The decode steps of a pass then end every layer at once, the layers' rows
    stacked into one batch (:meth:`~kvevict.passes.PassEnds.evict_pending`). Only the
    class's own declaration counts, as for :attr:`batched`."""

    def __init__(self, **params: object):
        unknown = [key for key in params if key not in self.PARAMS]
        if unknown:
            known = ", ".join(self.PARAMS) or "none"
            raise ValueError(f"{self.name}: unknown parameter {unknown[0]!r}; its parameters: {known}")
        for key, spec in self.PARAMS.items():
            value = params.get(key)
            value = copy.deepcopy(spec.default) if value is None else value  # None: left unset
            setattr(self, key, spec.check(self.name, key, value))
        self._given = frozenset(key for key, value in params.items() if value is not None)
        self.namespace = self.name
        """Where this stage's state lives (unique within its policy, set when it is assembled)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params().items())})"

    def params(self) -> dict[str, object]:
        """The parameters of this stage (recorded with benchmark results)."""
        return {key: getattr(self, key) for key in self.PARAMS}

    def given(self, key: str) -> bool:
        """Whether the user set parameter ``key`` (to something other than None)."""
        return key in self._given

    # -- the model ----------------------------------------------------------------------
    def model_defaults(self, config: PretrainedConfig) -> dict[str, object]:
        """Values of the parameters that depend on the model, for ``config``."""
        return {}

    def bind(self, config: PretrainedConfig) -> None:
        """Adapt to the decoder's config: fill only the parameters the user left unset
        (binding again to another config recomputes exactly those)."""
        for key, value in self.model_defaults(config).items():
            if not self.given(key):
                setattr(self, key, value)

    def check(self, policy: Assembly) -> None:
        """Refuse (``ValueError`` saying why; the policy's spelling is prefixed) a policy this
        stage cannot work in (called once the policy is assembled)."""

    def attach(self, model: torch.nn.Module, cache: CacheSide) -> Attachment | None:
        """Hooks this stage installs on ``model`` for one ``cache`` (called once the cache bound
        the policy; Fast KVzip's gates read each layer's input), removed by their ``close()``
        when the cache closes; None (the default): none."""
        return None

    def companions(self) -> tuple[Stage, ...]:
        """Observer stages this stage needs beside it (e.g. the statistics NC reads)."""
        return ()

    # -- the hooks ---------------------------------------------------------------------------
    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        """Signals this stage reads in a pass of ``phase`` (``evicting``: the pass ends with
        an eviction; ``regime``: when the policy evicts)."""
        return NOTHING

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        """Initial per-token state ``{key: [B, Hkv, num_new, ...]}`` of appended entries (stored
        under this stage's namespace; read it with :meth:`state`)."""
        return {}

    def observe(self, layer: EntryView, signals: Signals) -> None:
        """Update state from the signals of a pass (after attention, before any eviction)."""

    def on_evict(self, layer: EntryView, evicted: torch.Tensor) -> None:
        """Called with the entries about to be dropped, ``[B, Hkv, n]`` bool, while the layer
        still holds them."""

    stackable_evictions: ClassVar[bool] = False
    """:meth:`on_evict` and :meth:`on_evict_one` read only the layer's keys and values and this
    stage's ``memo``, row by row (rows along dim 0): a stack of layers' decode-step evictions is
    told to it at once, the stack's ``memo`` being every layer's rows' stacked. Only the class's
    own declaration counts, as for :attr:`batched`."""

    def on_evict_one(self, layer: EntryView, slots: torch.Tensor) -> None:
        """:meth:`on_evict` of an eviction that drops entry ``slots[b, h]`` ``[B, Hkv]`` of every
        head (a decode step's): by default with the mask of those; a stage may read the
        entries directly."""
        evicted = torch.zeros(layer.positions.shape, dtype=torch.bool, device=layer.positions.device)
        self.on_evict(layer, evicted.scatter_(-1, slots[..., None], True))

    # -- hidden states (the EpiKV family; see kvevict.hidden) --------------------------------
    hidden_context: int = 0
    """Earlier tokens the hidden-state score of a token depends on (e.g. a rolling window − 1)."""

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers whose outputs the stage reads; the cache hooks only these (none by default)."""
        return ()

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per-token scores ``[B, m]`` of ``m`` consecutive tokens from their hidden-state changes
        ``{layer: [B, m]}``; the first ``hidden_context`` tokens are only history. Computed once
        per token, then frozen (read them with ``layer.owner.hidden.lookup(layer.positions)``)."""
        raise NotImplementedError(f"{self.name} reads no hidden states")

    # -- namespaced storage -------------------------------------------------------------------
    def state(self, layer: EntryView) -> Namespaced:
        """This stage's per-token state in ``layer`` (``[B, Hkv, n, ...]`` tensors, gathered
        with the entries on every eviction)."""
        return Namespaced(layer, "state", self.namespace)

    def memo(self, layer: EntryView) -> Namespaced:
        """This stage's per-layer data that is not per token (e.g. recent queries)."""
        return Namespaced(layer, "memo", self.namespace)

    def shared(self, cache: CacheSide) -> Namespaced:
        """This stage's per-cache data shared by every layer (e.g. a random generator)."""
        return Namespaced(cache, "shared", self.namespace)


class Scorer(Stage):
    """Importance of every retained entry (higher is kept first)."""

    slot = "scorer"
    attention_scores: ClassVar[bool] = False
    """The scores are attention received (probability mass, ``>= 0``): what CriticalKV
    weights by ``‖v W_O‖₁``."""
    comparable_scores: ClassVar[bool] = False
    """The scores mean the same thing in every layer (attention probabilities, possibly
    weighted), so one budget can be ranked across layers as they are (``global+``; other
    scorers are standardised per layer first, see :class:`~kvevict.policies.allocation.GlobalBudget`)."""

    distinct_scores: ClassVar[bool] = False
    """No two entries a head holds ever score the same, and no score is NaN (StreamingLLM's
    positions): the lowest is then found by one ``argmin``, without breaking ties."""

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        """``[B, Hkv, n]``, fp32 (fp64 where the policy needs its exactness)."""
        raise NotImplementedError


class Protector(Stage):
    """Entries that always survive an eviction."""

    slot = "protector"
    sinks = 0

    def recent_window(self, budget: int) -> int:
        """Recent tokens protected at this budget."""
        return 0

    def min_budget(self, budget: int) -> int:
        """Smallest budget that leaves room for the protected entries."""
        return self.sinks + self.recent_window(budget)

    def protected(self, layer: EntryView, budget: int) -> torch.Tensor:
        """``[B, Hkv, n]`` bool."""
        raise NotImplementedError

    def prompt_slack(self, budget: int) -> int:
        """Most entries a head holds beyond ``budget`` after a chunk of a prompt while more of it
        comes (:meth:`held_for_prompt`)."""
        return 0

    def held_for_prompt(self, layer: EntryView) -> torch.Tensor | None:
        """``[B, Hkv, n]`` bool: real entries kept on top of the selection after a chunk of a prompt
        while more of it comes (:attr:`~kvevict.views.EntryView.prompt_continues`); None: none."""
        return None


class Allocator(Stage):
    """How many entries each KV head keeps."""

    slot = "allocator"

    def counts(
        self, layer: EntryView, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        """Entries each KV head keeps, ``[B, Hkv]`` int64, protected ones included. ``scores``
        are the selection scores (protected ``+inf``, padding ``-inf``; None when the policy
        has no scorer); ``protected`` marks the real protected entries."""
        raise NotImplementedError

    across_layers: ClassVar[bool] = False
    """True when the counts of one layer depend on every layer's scores (``global``): the
    prefill eviction then waits until the prefill forward has scored every layer
    (:meth:`allocate_layers`, then :meth:`counts` per layer)."""

    def keeps_all(self, layer_idx: int) -> bool:
        """Whether some head of layer ``layer_idx`` keeps every entry it holds whatever the budget
        (DuoAttention's retrieval heads): a row's ceiling there grows with every new token."""
        return False

    def allocate_layers(self, layers: list[EntryView], scores: list[torch.Tensor], comparable: bool) -> None:
        """With :attr:`across_layers`: decide every layer's counts together from their selection
        scores (``comparable``: the scorer's :attr:`~Scorer.comparable_scores`), leaving what
        :meth:`counts` returns in each layer's memo."""


@dataclass(frozen=True)
class Ranking:
    """What a selector chooses from, for one eviction of one layer."""

    scores: torch.Tensor | None
    """The scorer's scores ``[B, Hkv, n]`` (fp32, or fp64 where a method needs it) with the
    protected entries at ``+inf`` and padding at ``-inf``; None when the policy has no scorer."""
    protected: torch.Tensor
    """The real entries that must survive, ``[B, Hkv, n]`` bool."""
    counts: torch.Tensor
    """Entries each head keeps, protected ones included (the allocator's), ``[B, Hkv]`` int64."""


class Selector(Stage):
    """Which entries fill each head's count."""

    slot = "selector"
    by_top_scores: ClassVar[bool] = False
    """The selection keeps each head's top scores (stage 1 of CriticalKV included), so forcing
    an entry's score to ``+inf`` keeps it, and scores ranked across layers mean what they say
    (``global``, ``kvevict analyze retention``); not so for rule-based selectors (quotas, MI)."""

    stacks: ClassVar[bool] = False
    """:meth:`keep` and :meth:`drop_one` read only the ranking, the layer's per-token tensors
    (``positions``, ``valid``, ``state``, the scorer's scores) and per-row tables in
    ``owner.shared`` (where a :class:`~kvevict.rows.LayerStack` holds each batch row once per
    layer, layer after layer): a decode step's eviction may then run over every layer's rows
    at once, after each layer observed its own pass (:attr:`~kvevict.policies.Policy.stacks_evictions`).
    Only the class's own declaration counts, as for :attr:`batched`."""

    def keep(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor:
        """The keep mask ``[B, Hkv, n]``: ``ranking.counts[b, h]`` real entries of each head."""
        raise NotImplementedError

    def min_budget(self) -> int:
        """The smallest budget this selection can honour (none by default)."""
        return 0

    def drop_one(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor | None:
        """The entry ``[B, Hkv]`` (column) each head drops when every head keeps all but one of
        its entries, every one real (a decode step's eviction): what :meth:`keep` leaves out,
        found without building its mask. None when this selector does not find it so (then
        :meth:`keep` decides)."""
        return None


class Corrector(Stage):
    """A correction of the attention output of every pass (e.g. MomentKV's NC)."""

    slot = "corrector"
    reads_token_state: ClassVar[bool] = True
    """:meth:`correct` may read the layer's per-token state, so a decode step writes its new
    entries' state before the output is corrected, inside the layer; a corrector that reads
    none lets that wait for the end of the pass with the rest of the step (stacked over the
    layers where the policy allows). Only the class's own declaration counts."""

    def correct(
        self,
        layer: EntryView,
        query: torch.Tensor,
        output: torch.Tensor,
        scaling: float,
        log_partition: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel's attention output ``[B, q, Hq, d]``, corrected before the pass evicts;
        ``log_partition`` ``[B, Hq, q]``: the queries' ``log Z`` over the layer's entries (fp32),
        when the pass already computed it."""
        raise NotImplementedError


class Observer(Stage):
    """A stage that only keeps state (read by other stages)."""

    slot = "observer"


# -- the default stages -----------------------------------------------------------------------
def keep_top(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mask ``[B, H, n]`` of the ``counts[b, h]`` highest scores of each head (ties: the
    earlier entry).

    Why two ways: a decode step drops a few entries of hundreds, and finding the few lowest
    (``topk``, O(n)) is much cheaper than ranking all of them (a stable sort); both keep
    exactly the same entries. The few are dropped by value, then among the entries tied
    with the highest dropped value the latest go (what the stable descending sort ranks last)."""
    n = scores.shape[-1]
    drop = (n - counts).clamp(min=0, max=n)
    most = int(drop.max()) if drop.numel() else 0
    if most == 0:
        return torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    if 4 * most > n:
        return descending_ranks(scores) < counts[..., None]
    if most == 1:  # a decode step: each head drops its lowest score, the latest of those tied with it
        slots = lowest_slots(scores)
        if slots is not None:
            keep = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
            return keep.scatter_(-1, slots[..., None], (drop == 0)[..., None])
    lowest = scores.topk(most, dim=-1, largest=False, sorted=True).values  # [B, H, most] ascending
    last = lowest.gather(-1, (drop - 1).clamp(min=0)[..., None])  # the highest dropped value
    last = last.masked_fill(drop[..., None] == 0, float("-inf"))  # a head that drops nothing
    if bool(last.isnan().any()):  # NaN scores: the sort's order of them is the reference
        return descending_ranks(scores) < counts[..., None]
    below, tied = scores < last, scores == last
    needed = drop - below.sum(dim=-1)  # tied entries to drop, the latest first
    from_end = tied.flip(-1).cumsum(dim=-1).flip(-1)  # tied entries at or after each one
    return ~(below | (tied & (from_end <= needed[..., None])))


def lowest_slots(scores: torch.Tensor, distinct: bool = False) -> torch.Tensor | None:
    """The entry ``[B, H]`` (index along the last dim) of each head's lowest score, the latest
    of those tied with it: the one a stable descending sort ranks last, so what dropping one
    entry per head by :func:`keep_top` drops. None when a score is NaN (the sort's order of
    NaN is then the reference). ``distinct``: the lowest score is known to be unique and not
    NaN (:attr:`Scorer.distinct_scores`), so one ``argmin`` finds it."""
    if distinct:
        return scores.argmin(dim=-1)
    lowest, index = scores.flip(-1).min(dim=-1)  # the first in flipped order is the latest
    if bool(lowest.isnan().any()):
        return None
    return scores.shape[-1] - 1 - index


def window_size(window: int | None, budget: int, cap: int = 128) -> int:
    """A recent window: ``window`` tokens, or ``min(cap, budget // 4)`` when None."""
    return capped_share(budget, cap) if window is None else window


class SinksAndWindow(Protector):
    """The first ``sinks`` tokens and the recent window (``window`` tokens; None:
    ``min(cap, budget // 4)``). ``prompt_window``: after a chunk of a prompt while more of it
    comes, the last ``prompt_window`` tokens are kept too, on top of what the budget selects
    (:meth:`held_for_prompt`), so the next chunk's tokens see that much of their past in every
    head. They do not take part in the selection, so it chooses what it would with the usual
    window; the last chunk's eviction ranks them with the rest."""

    name = "sinks-and-window"
    batched = True
    stackable = True

    def __init__(self, sinks: int = 0, window: int | None = 0, cap: int = 128, prompt_window: int = 0):
        super().__init__()
        self.sinks, self.window, self.cap, self.prompt_window = sinks, window, cap, prompt_window

    def recent_window(self, budget: int) -> int:
        return window_size(self.window, budget, self.cap)

    def prompt_slack(self, budget: int) -> int:
        return max(0, self.prompt_window - self.recent_window(budget))

    def held_for_prompt(self, layer: EntryView) -> torch.Tensor | None:
        if not self.prompt_window or not layer.prompt_continues:
            return None
        recent = layer.positions >= layer.seen - self.prompt_window
        return recent if layer.valid is None else recent & layer.valid  # (padding slots have negative positions)

    def protected(self, layer: EntryView, budget: int) -> torch.Tensor:
        pos, window = layer.positions, self.recent_window(budget)
        if not window:  # the sinks alone (StreamingLLM's default)
            return pos < self.sinks
        recent = pos >= layer.seen - window
        return recent | (pos < self.sinks) if self.sinks else recent


class Uniform(Allocator):
    """``budget`` entries per KV head (or all it holds)."""

    name = "uniform"
    batched = True

    def counts(
        self, layer: EntryView, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        return layer.head_lengths().clamp(max=budget)


class TopK(Selector):
    """Per head, the top-scoring entries up to its count (protected entries first)."""

    name = "top-k"
    by_top_scores = True
    batched = True
    stacks = True  # the lowest score of each head: Policy.drop_lowest finds it for every layer at once

    def check(self, policy: Assembly) -> None:
        if policy.scorer is None and policy.method.evicts:
            raise ValueError(f"top-k selection needs a scorer, and {policy.method.name} has none")

    def keep(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor:
        return keep_top(ranking.scores, ranking.counts)


# -- methods ----------------------------------------------------------------------------------
@dataclass
class Stages:
    """What a method brings: its scorer (usually itself), its protector and, where it has its
    own, an allocator, a selector, a corrector and observers. ``replaceable`` names the slots
    whose stage is only a default, which a named stage (``adakv+…``) may take over."""

    scorer: Scorer | None
    protector: Protector
    allocator: Allocator | None = None
    selector: Selector | None = None
    corrector: Corrector | None = None
    observers: tuple[Stage, ...] = ()
    replaceable: frozenset[str] = frozenset()


def regime_param(regimes: tuple[Regime, ...]) -> Param:
    """A method's ``regime`` parameter: one of its regimes, the first by default."""
    return choice(regimes[0], *regimes)


class Method(Scorer):
    """A registered base policy: the scorer of its pipeline, plus the stages it brings
    (:meth:`stages`; by default its ``sinks`` and recent ``window`` as the protector).

    Subclasses set ``name``, ``summary`` (one line), ``regimes`` (the first is the default
    regime; a ``regime`` parameter is added to ``PARAMS``), ``PARAMS`` and :meth:`score`.
    """

    regimes: ClassVar[tuple[Regime, ...]] = ("both", "prefill", "decode")
    evicts: ClassVar[bool] = True
    """False for a method that never evicts (``full``)."""
    evicts_later_chunks: ClassVar[bool] = False
    """True for a decode-time method that also evicts at the later chunks of a prompt prefilled
    in chunks: its per-token scores exist once a pass has run (the earlier chunks are scored
    by the time the next one arrives), so chunked prefill bounds its memory as well."""
    deferred_prefill: ClassVar[bool] = False
    """True when the method scores the prompt only after the whole prefill forward ran
    (KVzip's repeat pass, :meth:`rescore`): its prefill eviction is deferred until then."""
    rescores_chunks: ClassVar[bool] = False
    """True for a :attr:`deferred_prefill` method that can also rescore a prompt prefilled in
    chunks, after each chunk's forward (chunked KVzip): unless one budget is shared across
    layers, such a prompt is then evicted chunk by chunk instead of refused."""
    batches_alone: bool = False
    """True for a method that scores each row of a batch by running its prompt again alone
    (KVzip's repeat in bf16): exact, but a batch then costs one more prefill per row than its
    prompts one at a time, so a caller free to choose (the lm-eval model) runs them one by one."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        params = {key: spec for key, spec in cls.PARAMS.items() if key != "regime"}
        cls.PARAMS = declare(**params, regime=regime_param(cls.regimes))

    regime: Regime

    def stages(self) -> Stages:
        """This method as the scorer, its ``sinks`` and ``window`` parameters (0 where it has
        none) as the protector; a method with stages of its own overrides this."""
        return Stages(scorer=self, protector=SinksAndWindow(getattr(self, "sinks", 0), getattr(self, "window", 0)))

    def evicts_in(self, phase: Phase, later_chunk: bool = False) -> bool:
        """Whether the method evicts in ``phase``; ``later_chunk``: the pass is a prompt chunk
        after the first (chunked prefill), where :attr:`evicts_later_chunks` methods evict too."""
        return self.evicts and (self.regime in ("both", phase) or (later_chunk and self.evicts_later_chunks))

    def rescore(self, cache: ScoringCache, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """With :attr:`deferred_prefill`: after the prefill forward, before the deferred
        eviction, run the method's own scoring passes (KVzip's repeat) through ``cache``."""

    def default_interval(self, budget: int) -> int | None:
        """The decode-time eviction interval this method prescribes (None: every step),
        used when the cache is given no ``interval``."""
        return None

    def clash_advice(self, stage: Stage) -> str:
        """What to do when ``stage`` is named over this method but the method fills its slot."""
        return f"use {self.name} alone"
