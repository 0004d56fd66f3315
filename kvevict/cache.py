"""The eviction cache: a transformers ``Cache`` whose layers evict under a policy (DESIGN §1).

Owns: building a cache for a model and a policy (checks, the attention wrapper, hooks),
the sequences' cache-wide data (data shared across layers per row, left padding offsets,
hidden-state recorder), accounting (bytes, peaks), and the rows of a running batch
(``splice``, ``remove_rows``). Each layer is an :class:`~kvevict.layer.EvictionLayer`; the end
of every pass is :class:`~kvevict.passes.PassEnds`'s.

Must not touch: a layer's storage or rows directly (it asks the layers).

When a pass evicts: a layer observes the pass (the policy's signals, e.g. the new query's
attention row) inside its own attention; a prefill eviction runs there too (or, for
policies that rescore or allocate across layers, once the prefill forward ends). A decode
step of a full layer that holds one lockstep view of every row leaves all its per-token work
for the end of the pass (:class:`~kvevict.passes.PassHook`): the new entries' state, the
observation of the signals its attention computed, the eviction. Nothing reads a layer's
state between its attention and the next pass, so the retained entries are the same, and
this work runs back to back for every layer, on warm CPU caches, rather than each piece
between two streams of model weights. Where the policy's stages allow it, the layers that
hold as many entries end their step as one batch of their rows
(:class:`~kvevict.rows.LayerStack`), their storage one tensor per kind
(:class:`~kvevict.storage.LayerArena`).

Nothing in the cache's layers points back at it but weak references (layers, hooks, the
hidden-state recorder): a dropped cache is freed at once, its hooks removed with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from kvevict.arena import LayerArena
from kvevict.attention import install as install_attention
from kvevict.budgets import Budget
from kvevict.hidden import HiddenStateRecorder
from kvevict.layer import EvictionLayer
from kvevict.models import RotaryTable, check_policy_fits, check_supported, source_of
from kvevict.passes import PassEnds, PassHook, SidePassObserver
from kvevict.persist import check_model, policy_of, read_file, restore, save_file
from kvevict.policies import Method, Policy, make_policy
from kvevict.quant import QuantConfig
from kvevict.rows import RowView, SequenceState
from kvevict.signals import Signals

__all__ = ["EvictionCache", "EvictionLayer", "KeptEntries", "RowView"]


def decode_ceiling(held: int, new_tokens: int, budget: int | None, interval: int, steps: int = 0) -> int:
    """The most entries a head holding ``held`` will hold while it decodes ``new_tokens`` more,
    ``steps`` decode steps after its prompt: under a decode-time ``budget`` (None: no decode-time
    eviction) at most the budget plus one interval, or, before its first decode-time eviction,
    what the prompt left plus one interval."""
    if budget is None:
        return held + new_tokens
    before_first_eviction = held - steps if steps < interval else 0
    return min(held + new_tokens, max(budget, before_first_eviction) + interval)


@dataclass(frozen=True)
class KeptEntries:
    """What a cache retains (:meth:`EvictionCache.kept`): ``entries`` over every layer, KV head
    and row, against ``full``, what a full cache holds for the same tokens; ``heads`` (layers ×
    KV heads × rows), and the ``longest`` and ``shortest`` head."""

    entries: int
    full: int
    heads: int
    longest: int
    shortest: int

    @property
    def share(self) -> float:
        """The share of a full cache's entries kept (1.0 for an empty cache)."""
        return self.entries / self.full if self.full else 1.0

    @property
    def mean(self) -> float:
        """Entries per KV head, mean over layers, heads and rows."""
        return self.entries / self.heads if self.heads else 0.0

    def __str__(self) -> str:
        """``kept 10.0% of the entries (mean 122.5 per KV head, longest 1198, shortest 4)``, or
        ``(128 per KV head)`` where every head holds as many."""
        per_head = (
            f"{self.longest} per KV head"
            if self.longest == self.shortest
            else f"mean {self.mean:.1f} per KV head, longest {self.longest}, shortest {self.shortest}"
        )
        return f"kept {100 * self.share:.1f}% of the entries ({per_head})"


class EvictionCache(PassEnds, Cache):
    """A transformers ``Cache`` that evicts entries under a policy and a budget.

    Use it as ``past_key_values`` of ``model(...)`` or ``model.generate(...)``::

        cache = EvictionCache(model, "snapkv", budget=256)
        model.generate(input_ids, past_key_values=cache, max_new_tokens=32)

    Args:
        model: the causal LM; its attention implementation is switched to kvevict's wrapper
            of the same kernel (a pure pass-through for any other cache).
        policy: a registered policy name (see :func:`kvevict.list_policies`), a policy made by
            :func:`kvevict.make_policy`, or a method object (``LazyEviction(alpha=1e-3)``). The
            cache binds its own copy to the model; the object passed is left as it is.
        budget: retained tokens per KV head per layer.
        keep: fraction of the prompt to retain (resolved at prefill). Not with ``budget``.
        interval: decode-time eviction runs every ``interval`` steps once over budget
            (1 = every step; larger lets the cache grow to ``budget + interval``). Default:
            the policy's own schedule (LazyEviction's and R-KV's window), else 1.
        prompt_length: tokens of the whole prompt (its columns, left padding included), for a
            prompt prefilled in chunks (``generate(..., prefill_chunk_size=C)``): ``keep=`` then
            refers to it, and exactly the passes up to it are prompt chunks. Without it, every
            pass of more than one token until the first single-token one is a prompt chunk.
        quant: ``"int8"``, ``"int4"`` or ``"int2"``: hold the retained keys and values quantized
            between passes (KIVI, :mod:`kvevict.quant`): keys per channel in groups of
            ``quant_group`` tokens, values per token in groups of ``quant_group`` channels, each
            row's most recent entries at full precision until ``residual`` (whole groups, at
            least one) are there, then quantized whole: fewer than ``max(residual, quant_group)``
            (``quant_group`` None: 32, or the head dimension where smaller; ``residual`` None: 32).
            Each pass attends (and its policy reads) the entries as dequantized, one layer at a
            time. None (default): every entry at the model's dtype, as without the option.

    Chunked prefill: each chunk attends to the retained entries plus itself, then the cache
    evicts back to the budget (prefill-time policies score each chunk as they score a whole
    prompt), so it never holds more than ``budget + C`` entries per KV head
    (:meth:`peak_entries`). Call :meth:`end_prompt` before feeding more than one token that
    is not prompt (a question after a context compressed on its own).

    Sliding-window layers (all-sliding or hybrid models) drop what left their window, then
    are evicted to the budget like full layers: one never holds more than
    ``min(window, budget)`` + interval entries between passes. Models kvevict cannot evict
    exactly are refused (:func:`kvevict.models.check_supported`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy: str | Policy = "full",
        *,
        budget: int | None = None,
        keep: float | None = None,
        interval: int | None = None,
        prompt_length: int | None = None,
        quant: str | None = None,
        quant_group: int | None = None,
        residual: int | None = None,
    ):
        check_supported(model)
        policy = make_policy(policy) if isinstance(policy, str) else policy
        if isinstance(policy, Method):
            policy = Policy(policy)
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a policy name or a kvevict Policy, got {type(policy).__name__}")
        self.budget = Budget(budget, keep)
        if not self.budget.given and policy.method.evicts:
            raise ValueError(f"policy {policy.name!r} needs a budget: give budget= (tokens) or keep= (fraction)")
        if budget is not None:
            policy.check_budget(budget)
        check_policy_fits(model, policy.corrects_output, budget)
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f"interval must be an integer >= 1 (1 = evict every step), got {interval!r}")
        self.interval = interval
        if prompt_length is not None and (
            isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 1
        ):
            raise ValueError(f"prompt_length must be a positive number of tokens, got {prompt_length!r}")
        self.prompt_length = prompt_length
        """Tokens of the whole prompt when it is prefilled in chunks (None: unknown)."""
        config = model.config.get_text_config(decoder=True)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.quant = QuantConfig.make(quant, quant_group, residual, head_dim)
        """How the retained keys and values are quantized between passes (None: they are not)."""
        rewriting = [stage.name for stage in policy.stages if stage.rewrites_keys]
        if self.quant is not None and rewriting:
            raise ValueError(
                f"{rewriting[0]} rewrites the kept keys, which a quantized cache holds as codes; use it without quant="
            )
        install_attention(model)
        self.policy = policy.bound(config)
        """This cache's copy of the policy, bound to the model (the object passed is left as it is)."""
        self._clear_sequences()
        hidden_layers = self.policy.hidden_layers(config.num_hidden_layers)
        self.hidden = (
            HiddenStateRecorder(
                model, hidden_layers, self.policy.hidden_scores, context=self.policy.hidden_context, cache=self
            )
            if hidden_layers
            else None
        )
        """Hooks on the decoder layers the policy reads (:mod:`kvevict.hidden`); None if it reads none."""
        self.source = source_of(model)
        """What :func:`kvevict.load_model` loaded the model from, if it did (recorded by :meth:`save`)."""
        self._identity_model = weakref.ref(model)
        self.hooks = self.policy.attach(model, self)
        """Hooks the policy installed on the model for this cache (Fast KVzip's gates); None if none."""
        self.rotary = RotaryTable(model)
        """cos/sin of the model's RoPE at any position (ExpectedAttention's future rotations)."""
        self.side_pass: SidePassObserver | None = None
        """Set while a policy runs a scoring pass of its own through this cache (KVzip)."""
        self._pass_hook = PassHook(model.get_decoder(), self)
        self.ends_passes = self.quant is None
        """Whether :class:`PassHook` ends the passes (until :meth:`close`; then each layer evicts
        inside its attention again). Not for a quantized cache: each layer evicts inside its
        attention and goes back to codes at once (:meth:`EvictionLayer.attended`)."""
        self.stacks_pending = True
        """Whether the end of a pass scores the layers' pending evictions as one batch where
        the policy allows it (:meth:`evict_pending`); the same entries are kept either way."""
        self.steady_steps = True
        """Whether a decode step like the last one skips the checks that one made
        (:meth:`EvictionLayer.settle`); the same entries are kept either way."""
        _, layer_kwargs = get_layer_types_and_kwargs(config)  # check_supported: full or sliding layers only
        layers = [EvictionLayer(self, i, kwargs.get("sliding_window")) for i, kwargs in enumerate(layer_kwargs)]
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        quant = "" if self.quant is None else f", quant={self.quant}"
        return f"EvictionCache(policy={self.policy!r}, {self.budget}, interval={self.interval}{quant})"

    def _clear_sequences(self) -> None:
        """The cache-wide data of the sequences held (besides each layer's own)."""
        self.sequences: list[SequenceState] = []
        """The counters of each row of the batch (seen, prompt length, ...), once for every layer."""
        self.appended_pass = 0
        """The last pass (numbered as each layer counts its passes) whose tokens the counters count."""
        self.begun_pass = 0
        """The last pass whose padding and starts the counters took in."""
        self._shared_rows: dict[int, dict[str, object]] = {}
        """Per-row policy data shared across layers (e.g. ThinKV's per-token entropy)."""
        self.row_offsets: list[int] = [0]
        """Left padding of each row of the batch (columns before its first real token)."""
        self.deferred: list[tuple[RowView, Signals]] = []
        """Row views whose prefill eviction waits for the end of the prefill forward, with their signals."""
        self.pending: list[EvictionLayer] = []
        """Layers whose decode step waits for the end of the pass, in the order they attended."""
        self._arenas: dict[tuple[int, ...], LayerArena] = {}
        """The storage of layers that stack, by their indices (:class:`LayerArena`)."""

    def reset(self) -> None:
        """Empty the cache for new sequences: what a fresh cache of the same model and policy
        holds (every layer, the policy's shared data such as a seeded generator, the recorded
        hidden states), keeping the hooks installed."""
        super().reset()
        self._clear_sequences()
        if self.hidden is not None:
            self.hidden.reset()

    def close(self) -> None:
        """Remove the hooks from the model (also done on garbage collection)."""
        if self.hidden is not None:
            self.hidden.close()
        if self.hooks is not None:
            self.hooks.close()
        self._pass_hook.close()
        self.ends_passes = False
        self._arenas = {}  # the layers keep their storage; nothing stacks any more

    # -- saving and loading ------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write this cache to ``path`` (safetensors): its retained entries and everything it
        needs to go on decoding exactly, with the model's identity and the policy
        (:mod:`kvevict.persist`). Save between passes: after a prefill, or between decode steps."""
        model = self._identity_model()
        if model is None:
            raise ValueError("the model of this cache was garbage-collected: nothing to save it for")
        return save_file(self, path, model)

    @classmethod
    def load(cls, path: str | Path, model: PreTrainedModel) -> EvictionCache:
        """A cache :meth:`save` wrote, for ``model`` (the same model: its identity is checked),
        answering exactly as the saved one would. A file of another model, a truncated or
        corrupted one, or one of another format version raises a ``ValueError``; an
        unreadable path an ``OSError``."""
        metadata, tensors = read_file(path)
        check_model(metadata, model, path)
        name, params, budget = policy_of(metadata)
        cache = cls(
            model,
            make_policy(name, **params),
            budget=budget["budget"],
            keep=budget["keep"],
            interval=budget["interval"],
            prompt_length=budget["prompt_length"],
            **budget.get("quant", {}),
        )
        restore(cache, metadata, tensors, path, model.device)
        return cache

    def alone(self) -> EvictionCache:
        """An empty cache for one prompt of this cache's batch as it runs alone: the same model,
        policy, budget and quantization, but its passes are not ended (no :class:`PassHook`), so
        after a forward it holds what the lone prompt's cache holds when its pass ends, deferred
        evictions still waiting. Where a policy recomputes one row of a batch as alone (KVzip's
        bf16 repeat). Close it after use (it is a context manager)."""
        model = self._identity_model()
        if model is None:
            raise ValueError("the model of this cache was garbage-collected: no forward can run for it")
        quant = {} if self.quant is None else self.quant.options()
        solo = EvictionCache(model, self.policy, budget=self.budget.tokens, keep=self.budget.keep, **quant)
        solo._pass_hook.close()
        return solo

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def eviction_layers(self) -> list[EvictionLayer]:
        return [layer for layer in self.layers if isinstance(layer, EvictionLayer)]

    @property
    def shared(self) -> dict[str, object]:
        """Policy data shared across layers of the first row (every row has its own: :meth:`row_shared`)."""
        return self.row_shared(0)

    def row_shared(self, row: int) -> dict[str, object]:
        """Policy data shared across layers, for one row of the batch."""
        return self._shared_rows.setdefault(row, {})

    def kv_bytes(self) -> int:
        """Resident bytes: every distinct tensor storage the layers hold for their entries
        (keys, values, positions, validity, per-token state, room to grow), counted once even
        where layers share one (an arena). :meth:`retained_bytes` is the real entries' part."""
        storages = {}
        for layer in self.eviction_layers:
            for x in layer.storage.tensors():
                storage = x.untyped_storage()
                storages[(storage.data_ptr(), x.device)] = storage.nbytes()
        return sum(storages.values())

    def retained_bytes(self) -> int:
        """Bytes of the real (retained) entries' keys and values, every layer."""
        return sum(layer.retained_bytes() for layer in self.eviction_layers)

    def row_bytes(self) -> list[tuple[int, int]]:
        """Per row of the batch: (resident bytes, bytes of its real entries' keys and values)
        over every layer (see :meth:`EvictionLayer.row_bytes`)."""
        totals: list[list[int]] = []
        for layer in self.layers:
            rows = layer.row_bytes()
            totals += [[0, 0] for _ in range(len(rows) - len(totals))]
            for total, (allocated, real) in zip(totals, rows):
                total[0] += allocated
                total[1] += real
        return [(allocated, real) for allocated, real in totals]

    def layer_bytes(self) -> list[tuple[int, int]]:
        """Per layer (full-attention and sliding alike): (resident bytes, bytes of the real
        entries' keys and values)."""
        return [(layer.kv_bytes(), layer.retained_bytes()) for layer in self.layers]

    def column_bytes(self) -> list[int]:
        """Per eviction layer: resident bytes of one entry of one row in its padded storage (keys,
        values, positions, validity, per-token state: what :meth:`kv_bytes` grows by per column)."""
        return [layer.column_bytes() for layer in self.eviction_layers]

    def row_ceiling(self, row: int, new_tokens: int) -> list[int]:
        """Per eviction layer: the most entries any KV head of row ``row`` will hold there while
        it decodes ``new_tokens`` more tokens, one per pass: what a scheduler reserves for it. A
        decode-time policy holds at most its budget plus its eviction interval (the entries
        appended since its last eviction), or, before its first decode-time eviction, what the
        prompt left plus one interval; a row that no longer evicts, or a layer where a head keeps every
        entry (:meth:`~kvevict.policies.base.Allocator.keeps_all`), grows by every new token; a
        sliding-window layer holds its window (and the token that enters it)."""
        sequence = self.sequences[row]
        evicting = sequence.budget is not None and self.policy.evicts_in("decode")
        steps, interval = sequence.seen - sequence.prompt_length, sequence.interval
        ceilings = []
        for layer in self.eviction_layers:
            held = layer.rows[row].width
            budget = sequence.budget if evicting and not self.policy.allocator.keeps_all(layer.layer_idx) else None
            ceiling = decode_ceiling(held, new_tokens, budget, interval, steps)
            ceilings.append(ceiling if layer.window is None else min(ceiling, layer.window + 1))
        return ceilings

    def decode_peak(self) -> int:
        """Most entries any KV head held while decoding (budget + interval for lagged eviction)."""
        return max((layer.decode_peak for layer in self.eviction_layers), default=0)

    def peak_entries(self) -> int:
        """Most entries any KV head of any layer held at any moment of this cache's life,
        prefill included (after a pass appended, before it evicted): at most ``budget + C``
        per head with chunked prefill of chunk ``C`` (before the last chunk, the policy's
        :meth:`~kvevict.policies.Policy.prompt_held` for the budget: ``fastkvzip``'s prompt
        window), the whole prompt when it is prefilled in one pass."""
        return max((row.peak for layer in self.eviction_layers for row in layer.rows), default=0)

    def end_prompt(self) -> None:
        """The prompt is complete: the next passes are decode passes, however many tokens they
        hold (a question fed after a context compressed on its own is not compressed with it)."""
        for layer in self.eviction_layers:
            layer.prompt_open = False

    # -- continuous batching ---------------------------------------------------------------
    def splice(self, row: int, source: EvictionCache, source_row: int = 0) -> None:
        """Put the sequence row ``source_row`` of ``source`` holds (a cache of the same model,
        policy and budget, its prompt done) into batch row ``row`` of this cache, replacing a
        finished sequence, or as a new last row when ``row`` is the batch size: that row then goes
        on exactly as the sequence would alone. ``source`` keeps what it holds (a batch whose rows
        started together is spliced row by row). Decode such a batch with each row's own positions
        (``position_ids=cache.next_positions()``): its rows have seen different numbers of tokens."""
        if not isinstance(source, EvictionCache) or source is self:
            raise ValueError("splice takes another EvictionCache holding the sequence to put into this batch")
        if repr(source.policy) != repr(self.policy) or source.budget != self.budget or source.quant != self.quant:
            raise ValueError(
                f"cannot splice a cache of {source.policy.name!r} ({source.budget}) into one of "
                f"{self.policy.name!r} ({self.budget}): rows of a batch share the policy and the budget (and quant=)"
            )
        if self.deferred or source.deferred:
            raise ValueError(
                f"a cache of {self.policy.name!r} has a prefill eviction pending (its prompt's pass did not end), "
                "so it cannot be spliced: finish the prompt's forward pass first"
            )
        layers = list(zip(self.eviction_layers, source.eviction_layers))
        if any(not mine.is_initialized or not theirs.is_initialized for mine, theirs in layers):
            raise ValueError("splice needs both caches to hold a prefilled sequence")
        rows = source.eviction_layers[0].batch_size
        if not 0 <= source_row < rows:
            raise ValueError(f"source row {source_row} is out of range: the source cache has rows 0 .. {rows - 1}")
        if not 0 <= row <= self.eviction_layers[0].batch_size:
            raise ValueError(f"row {row} is out of range: 0 .. {self.eviction_layers[0].batch_size} (a new last row)")
        sequence = source.sequences[source_row].copy()
        self.sequences[row : row + 1] = [sequence]
        for mine, theirs in layers:
            mine.splice(row, theirs, sequence, source_row)
            mine.prompt_open = False
        if self.hidden is not None and source.hidden is not None:
            self.hidden.splice(row, source.hidden, source_row)
        self._shared_rows[row] = source.row_shared(source_row)
        self.row_offsets[row : row + 1] = [0]

    def remove_rows(self, rows: Sequence[int]) -> None:
        """Drop the batch rows ``rows`` (finished sequences): the others go on as before, renumbered in order."""
        size = self.eviction_layers[0].batch_size
        if not rows or any(not 0 <= r < size for r in rows) or len(set(rows)) >= size:
            raise ValueError(f"remove_rows takes distinct rows in 0 .. {size - 1}, leaving at least one; got {rows}")
        for layer in self.eviction_layers:
            layer.remove_rows(list(rows))
        kept = [i for i in range(size) if i not in set(rows)]
        self.sequences = [self.sequences[i] for i in kept]
        if self.hidden is not None:
            self.hidden.remove_rows(kept)
        self._shared_rows = {new: self.row_shared(old) for new, old in enumerate(kept)}
        self.row_offsets = [self.row_offsets[i] for i in kept]

    def pass_tokens(self) -> list[int]:
        """Real tokens of each row in the pass under way (the last ones of its columns; the
        rest is left padding), as the layers learned them from the model's mask."""
        return [sequence.new for sequence in self.sequences]

    # -- the rows' counters, moved once per pass by the first layer to run it -------------------
    def sequences_of(self, batch: int) -> list[SequenceState]:
        """The counters of a batch of ``batch`` rows (made by the first layer that sees it)."""
        if len(self.sequences) != batch:
            self.sequences = [SequenceState() for _ in range(batch)]
        return self.sequences

    def advance(self, layer_pass: int, columns: int) -> None:
        """A layer appends the columns of its pass number ``layer_pass``: the first one to do so
        counts them in every row."""
        if self.appended_pass < layer_pass:
            self.appended_pass = layer_pass
            for sequence in self.sequences:
                sequence.advance(columns)

    def begin_sequences(self, layer_pass: int) -> bool:
        """Whether the layer beginning its pass number ``layer_pass`` is the first to (it then
        takes the pass's padding and the rows' starts into the counters)."""
        if self.begun_pass < layer_pass:
            self.begun_pass = layer_pass
            return True
        return False

    def next_positions(self) -> torch.Tensor:
        """``[B, 1]``: the absolute position of each row's next token (the tokens it has seen)."""
        layer = self.eviction_layers[0]
        return torch.tensor([[row.seen] for row in layer.rows], device=layer.device)

    def layer_lengths(self, per: str = "longest") -> list[int] | list[float]:
        """Retained entries of each layer, over its KV heads and the rows of a batch.

        ``per="longest"`` (default): the most any one KV head of any row holds. Under a uniform
        policy every head holds that many; in a *ragged* layer (heads or rows that keep
        different numbers: AdaKV, HeadKV, ``global+``, KVzip's global budget, ``keep=`` over
        prompts of different lengths) it is the longest head alone and says nothing of the
        others. ``per="mean"``: the mean over KV heads and rows; ``per="total"``: their sum,
        what the layer's retained bytes follow. :meth:`kept` sums up the whole cache."""
        if per not in ("longest", "mean", "total"):
            raise ValueError(f"layer_lengths(per={per!r}): per is 'longest', 'mean' or 'total'")
        lengths = [layer.head_lengths() if layer.is_initialized else None for layer in self.layers]
        if per == "longest":
            return [0 if held is None else int(held.max()) for held in lengths]
        if per == "mean":
            return [0.0 if held is None else float(held.double().mean()) for held in lengths]
        return [0 if held is None else int(held.sum()) for held in lengths]

    def kept(self, row: int | None = None) -> KeptEntries:
        """What the cache retains against what a full cache would hold for the same tokens
        (every token each row has seen, in every KV head of every layer); ``row``: of that row alone."""
        rows = slice(None) if row is None else slice(row, row + 1)
        heads = [
            (layer.head_lengths()[rows], [info.seen for info in layer.rows[rows]])
            for layer in self.layers
            if layer.is_initialized
        ]
        return KeptEntries(
            entries=sum(int(held.sum()) for held, _ in heads),
            full=sum(sum(seen) * held.shape[1] for held, seen in heads),
            heads=sum(held.numel() for held, _ in heads),
            longest=max((int(held.max()) for held, _ in heads), default=0),
            shortest=min((int(held.min()) for held, _ in heads), default=0),
        )

    def row_memory(self, row: int) -> dict[str, Any]:
        """What one row of the batch holds, as the cache of that sequence alone reports it:
        ``kv_bytes`` (allocated), ``real_bytes``, ``layer_bytes`` (allocated, real) per layer,
        ``retained`` (entries of its longest layer and head), ``retained_mean`` (entries per KV
        head, mean over its layers and heads), ``kept_share`` (of the entries a full cache would
        hold for the tokens it has seen), ``decode_peak`` and ``peak`` (prefill included)."""
        layers = [layer.row_bytes()[row] for layer in self.layers]
        rows = [layer.rows[row] for layer in self.eviction_layers]
        kept = self.kept(row)
        return {
            "retained_mean": kept.mean,
            "kept_share": kept.share,
            "kv_bytes": sum(allocated for allocated, _ in layers),
            "real_bytes": sum(real for _, real in layers),
            "layer_bytes": layers,
            "retained": max((info.width for info in rows), default=0),
            "decode_peak": max((info.decode_peak for info in rows), default=0),
            "peak": max((info.peak for info in rows), default=0),
        }
