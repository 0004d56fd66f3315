"""One request's entries in one layer of vLLM's paged KV cache, as kvevict's policies see a
layer (:class:`~kvevict.views.EntryView`), and the eviction that keeps what the policy selects.

vLLM's CPU attention cache of a layer is ``[num_blocks, Hkv, block_size, 2·d]``, laid out within
a block as its kernels choose (:class:`BlockLayout`); a request's entries lie in its blocks (its
row of the block table) in the order they were written. :class:`RequestEntries` keeps, per layer, what kvevict's
own cache keeps beside its entries: each entry's absolute position per KV head, the policy's
per-token state and per-layer memo. :func:`evict` runs the policy's own stages on a
:class:`PagedEntries` view (the selection kvevict's cache makes, ties broken by the same layout)
and lays the kept entries out as kvevict's cache does (:func:`kvevict.driver.refill_sources`:
kept entries stay in their slots, the dropped slots below the budget are refilled in order), in
the request's first blocks.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from kvevict.driver import refill_sources
from kvevict.rows import uniform
from kvevict.signals import compute_signals
from kvevict.stacked import StackedRows
from kvevict.vllm.schedule import EvictionSchedule


@dataclass
class CacheSide:
    """What a policy reads of the cache behind a view (:class:`~kvevict.views.CacheSide`): the
    policy, the request's data shared across layers and, for a policy that reads hidden states,
    the request's :class:`~kvevict.hidden.HiddenSeries`. Rotary tables are not offered (the
    plug-in refuses policies that read them)."""

    policy: Any
    shared: dict[str, object] = field(default_factory=dict)
    hidden: Any = None
    rotary: Any = None
    eviction_layers: tuple = ()


@dataclass(frozen=True)
class StackedHidden:
    """The hidden-state series of requests in lockstep, looked up as one batch (each row in its own)."""

    series: list[Any]

    def lookup(self, positions: torch.Tensor, row: int | None = None, end: int | None = None) -> torch.Tensor:
        if row is not None:
            return self.series[row].lookup(positions, end=end)
        return torch.cat([one.lookup(positions[b : b + 1], end=end) for b, one in enumerate(self.series)])


@dataclass
class PagedEntries:
    """The held entries of one layer (plus the pass's new ones) of one request, or of requests in
    lockstep as one batch (:func:`lockstep`), ``[B, Hkv, n, ...]``: an
    :class:`~kvevict.views.EntryView`. Its keys and values are gathered from the paged cache when
    the policy first reads them, each side on its own (most decode steps of most policies read
    neither, and TOVA's evictions only the keys). Counters that
    differ between the requests (``seen``, ``prompt_length``) are ``[B, 1, 1]`` tensors."""

    blocks: Callable[[], torch.Tensor]
    """Copies the requests' blocks from the paged cache (:meth:`BlockLayout.blocks_of`)."""
    in_order: Callable[[torch.Tensor, str], torch.Tensor]
    """Puts one side of the copied blocks in order, ``[B, Hkv, n, d]`` (:meth:`BlockLayout.in_order`)."""
    positions: torch.Tensor
    state: dict[str, torch.Tensor]
    seen: int | torch.Tensor
    prompt_length: int | torch.Tensor
    decode_step: int
    budget: int | None
    num_new: int
    passes: int
    layer_idx: int
    memo: MutableMapping[str, object]
    owner: CacheSide
    valid: torch.Tensor | None = None
    new_columns: torch.Tensor | None = None
    prompt_continues: bool = False
    window: int | None = None

    @cached_property
    def _blocks(self) -> torch.Tensor:
        return self.blocks()

    @cached_property
    def keys(self) -> torch.Tensor:
        return self.in_order(self._blocks, "keys")

    @cached_property
    def values(self) -> torch.Tensor:
        return self.in_order(self._blocks, "values")

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def policy(self) -> Any:
        return self.owner.policy

    @property
    def num_kv_heads(self) -> int:
        return self.positions.shape[1]

    @property
    def length(self) -> int:
        return self.positions.shape[2]

    def phase(self) -> str:
        return "prefill" if self.passes == 1 else "decode"

    def head_lengths(self) -> torch.Tensor:
        return torch.full(self.positions.shape[:2], self.length, dtype=torch.long, device=self.device)

    def write_back(self) -> None:
        """Policies may replace a state tensor rather than write it in place: nothing to copy, the
        request's state is the view's."""


@dataclass
class LayerEntries:
    """What one layer holds of a request beside the keys and values: the positions ``[1, Hkv, n]``
    (int64) it held after ``recorded`` processed tokens (every later token is held too, in order:
    :meth:`positions_at`), the policy's per-token state ``[1, Hkv, n, ...]`` and per-layer memo."""

    positions: torch.Tensor
    recorded: int = 0
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    memo: dict[str, object] = field(default_factory=dict)

    def positions_at(self, tokens: int) -> torch.Tensor:
        """The positions held once ``tokens`` tokens are processed, if nothing was evicted since
        :attr:`recorded`: those recorded, then the later tokens'."""
        later = torch.arange(self.recorded, tokens, device=self.positions.device)
        return torch.cat([self.positions, later.expand(1, self.positions.shape[1], -1)], dim=-1)


class RequestEntries:
    """A request's eviction state on a worker: its schedule, passes, and per layer what
    :class:`LayerEntries` holds. Layers are created on the request's first pass."""

    def __init__(self, schedule: EvictionSchedule, policy: Any, most_tokens: int, hidden: Any = None):
        self.schedule = schedule
        self.owner = CacheSide(policy, hidden=hidden)
        """The policy, the request's shared data and its hidden-state series (``hidden``, a
        :class:`~kvevict.hidden.HiddenSeries`, for a policy that reads hidden states)."""
        self.layers: dict[int, LayerEntries] = {}
        self.passes = 0
        """Passes that were planned for this request (its first one is its prompt)."""
        self.tokens = 0
        """Tokens it has processed, once the pass under way is done."""
        self.evicts = schedule.evicts_within(most_tokens)
        """Whether it ever evicts, over at most ``most_tokens`` processed tokens (its prompt and
        the most it may generate): if not, the policy has nothing to do for it, ever, and its
        passes are vLLM's alone."""
        self.every_pass = policy.observes or policy.keeps_token_state
        """Whether the policy reads every pass's attention layers; if not, only the passes that evict."""

    def kept_positions(self, layers: int, heads: int) -> list[list[list[int]]]:
        """The absolute positions each of ``layers`` layers and ``heads`` KV heads holds, ascending."""
        if not self.evicts or not self.layers:  # nothing evicted: every token held
            return [[list(range(self.tokens)) for _ in range(heads)] for _ in range(layers)]
        return [
            [sorted(head.tolist()) for head in self.layers[index].positions_at(self.tokens)[0]]
            for index in sorted(self.layers)
        ]


@dataclass(frozen=True)
class RowPass:
    """One request's part of a forward pass: its row of the batch, its tokens in the pass
    (``start`` in the pass's flat token order, ``num_new``), the entries it held before the pass
    (``held``, where the new ones are written), the tokens it has processed after it, and the
    entries it keeps after it (``keep``, the schedule's count; fewer than it then holds: the pass
    evicts)."""

    entries: RequestEntries
    row: int
    start: int
    num_new: int
    held: int
    tokens: int
    passes: int
    keep: int

    @property
    def decode_step(self) -> int:
        """Tokens the request has generated once the pass is done (its prompt's pass: 0)."""
        return self.tokens - self.entries.schedule.prompt_length

    @property
    def reads_attention(self) -> bool:
        """Whether the policy reads the pass at the attention layers: it evicts, or reads every pass."""
        return self.evicts or self.entries.every_pass

    @property
    def evicts(self) -> bool:
        """Whether the pass ends with an eviction: on the schedule's steps, and on the pass that
        computes a preempted request again from nothing, if it then holds more than the schedule's count."""
        return self.held + self.num_new > self.keep


@dataclass(frozen=True)
class BlockLayout:
    """Where each key and value element of a block lies in the block's memory: ``keys`` and
    ``values``, ``[Hkv, block_size, d]`` int64 offsets into one block of a layer's paged cache
    flattened. vLLM's CPU attention kernels choose the layout per instruction set (keys are
    stored transposed, ``[d, block_size]`` per head, by the ``vec`` kernels), so it is found by
    writing a probe through the layer's own cache update (:meth:`probe`), not assumed."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def probe(cls, write: Callable[..., None], kv_cache: torch.Tensor) -> BlockLayout:
        """The layout of ``kv_cache``'s blocks, as ``write(key, value, cache, slot_mapping)`` (the
        layer's cache update, ``key``/``value`` ``[tokens, Hkv, d]``) lays a block out: three probes
        code each element's token, head and channel (small integers, exact in bf16 too)."""
        _, heads, block_size, width = kv_cache.shape
        head_dim = width // 2
        shape = (block_size, heads, head_dim)
        codes = [
            torch.arange(1, block_size + 1)[:, None, None].expand(shape),
            torch.arange(1, heads + 1)[None, :, None].expand(shape),
            torch.arange(1, head_dim + 1)[None, None, :].expand(shape),
        ]
        found = []
        for code in codes:
            scratch = torch.zeros(1, *kv_cache.shape[1:], dtype=kv_cache.dtype, device=kv_cache.device)
            value = code.to(kv_cache.dtype).to(kv_cache.device)
            write(value, -value, scratch, torch.arange(block_size, device=kv_cache.device))
            found.append(scratch.reshape(-1).float())
        flat = torch.stack(found)  # [3, block memory]: the token, head, channel written at each element (+1)
        offsets = {}
        for name, sign in (("keys", 1), ("values", -1)):
            where = (flat[0] * sign > 0).nonzero().flatten()
            token, head, channel = ((flat[:, where] * sign).round().long() - 1).unbind(0)
            index = torch.empty(heads, block_size, head_dim, dtype=torch.long, device=kv_cache.device)
            index[head, token, channel] = where
            offsets[name] = index
        return cls(offsets["keys"], offsets["values"])

    @cached_property
    def both(self) -> torch.Tensor:
        """``[Hkv, block_size, 2·d]``: the keys' offsets, then the values' (one index for a move)."""
        return torch.cat([self.keys, self.values], dim=-1)

    @cached_property
    def strides(self) -> dict[str, tuple[int, int, int, int] | None]:
        """Per side, ``(offset, head, token, channel)`` strides when its offsets are affine in head,
        token and channel (every layout vLLM's CPU kernels use: natural or transposed), so a
        strided view reads a side without an index; None where they are not."""
        found = {}
        for name, offsets in (("keys", self.keys), ("values", self.values)):
            base = int(offsets[0, 0, 0])
            steps = [int(offsets.select(axis, 1)[0, 0] - base) if offsets.shape[axis] > 1 else 0 for axis in range(3)]
            heads, tokens, channels = (torch.arange(size, device=offsets.device) for size in offsets.shape)
            affine = base + heads[:, None, None] * steps[0] + tokens[None, :, None] * steps[1] + channels * steps[2]
            found[name] = (base, *steps) if min(steps) >= 0 and torch.equal(affine, offsets) else None
        return found

    def blocks_of(self, kv_cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, blocks needed, block memory]``: the blocks holding requests' first ``length``
        entries (``blocks``: their block-table rows, ``[B, blocks per request]``), copied whole."""
        needed = -(-length // kv_cache.shape[2])
        rows = blocks.shape[0]
        return kv_cache.index_select(0, blocks[:, :needed].reshape(-1).long()).view(rows, needed, -1)

    def in_order(self, raw: torch.Tensor, side: str, length: int) -> torch.Tensor:
        """One side (``"keys"`` or ``"values"``) of the entries in ``raw`` (:meth:`blocks_of`),
        ``[B, Hkv, length, d]``, each block's elements put in order."""
        offsets = getattr(self, side)
        heads, block_size, head_dim = offsets.shape
        rows, needed, memory = raw.shape
        strides = self.strides[side]
        if strides is not None:
            base, head, token, channel = strides
            held = raw.as_strided(
                (rows, heads, needed, block_size, head_dim),
                (needed * memory, head, memory, token, channel),
                raw.storage_offset() + base,
            )
        else:
            held = raw.index_select(2, offsets.view(-1)).view(rows, needed, heads, block_size, head_dim).transpose(1, 2)
        return held.reshape(rows, heads, -1, head_dim)[:, :, :length]

    def move(
        self,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        rows: torch.Tensor,
        heads: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        """Copy the entry at index ``src[i]`` of KV head ``heads[i]`` of request ``rows[i]`` (whose
        blocks are ``blocks[rows[i]]``) over the one at ``dst[i]`` (keys and values), for every ``i`` at once."""
        flat = kv_cache.view(-1)
        flat[self._where(kv_cache, blocks, rows, heads, dst)] = flat[self._where(kv_cache, blocks, rows, heads, src)]

    def _where(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """``[k, 2·d]``: where the key and value of entry ``index[i]`` of KV head ``heads[i]`` of
        request ``rows[i]`` lie in the flattened ``kv_cache``."""
        _, _, block_size, width = kv_cache.shape
        block_start = blocks.long()[rows, index // block_size] * (kv_cache.shape[1] * block_size * width)
        return self.both[heads, index % block_size] + block_start[:, None]


def lockstep(steps: list[RowPass], layer_idx: int) -> list[list[RowPass]]:
    """The requests of a pass in groups that run through the policy's hooks at once, as
    :meth:`kvevict.layer.EvictionLayer.views` batches rows in lockstep: a
    :attr:`~kvevict.policies.Policy.batched` policy (its stages treat rows independently) and
    requests that hold as many entries, add as many, keep as many, under the same budget, at the
    same pass and decode step, with the same policy data (``memo`` and ``shared`` keys, read
    stacked). Prompt lengths (so ``seen``) may differ. Each request gets what it gets alone."""
    groups: dict[tuple, list[RowPass]] = {}
    for step in steps:
        entries = step.entries
        if not entries.owner.policy.batched:
            groups[(id(step),)] = [step]
            continue
        layer = entries.layers.get(layer_idx)
        key = (
            step.held,
            step.num_new,
            step.keep,
            step.passes,
            step.decode_step,
            entries.schedule.budget,
            tuple(layer.memo) if layer is not None else None,
            tuple(entries.owner.shared),
        )
        groups.setdefault(key, []).append(step)
    return list(groups.values())


def observe_and_evict(
    group: list[RowPass],
    layer_idx: int,
    kv_cache: torch.Tensor,
    layout: BlockLayout,
    blocks: torch.Tensor,
    query: torch.Tensor,
    scale: float,
) -> None:
    """Run one layer's part of a pass for requests in lockstep (:func:`lockstep`: one request, or
    several as one batch), as :meth:`kvevict.driver.PolicyDriver.after_attention` runs it in
    kvevict's cache: record the new entries' positions and initial state, hand the policy the
    signals it asks for (``query`` ``[B, Hq, num_new, d]``, the pass's queries after RoPE), and,
    when the schedule says the pass evicts, keep the policy's selection, compacted into each
    request's first blocks (``blocks``, ``[B, blocks per request]``: the requests' block-table rows)."""
    first = group[0]
    policy = first.entries.owner.policy
    length = first.held + first.num_new
    layers = []
    for step in group:
        layer = step.entries.layers.get(layer_idx)
        if layer is None:
            empty = torch.empty(1, kv_cache.shape[1], 0, dtype=torch.long, device=kv_cache.device)
            layer = step.entries.layers[layer_idx] = LayerEntries(empty)
        layers.append(layer)
    alone = len(group) == 1
    state = (
        layers[0].state if alone else {name: torch.cat([la.state[name] for la in layers]) for name in layers[0].state}
    )
    view = PagedEntries(
        blocks=lambda: layout.blocks_of(kv_cache, blocks, length),
        in_order=lambda raw, side: layout.in_order(raw, side, length),
        positions=held_positions(layers, [step.tokens for step in group]),
        state=state,
        seen=uniform([step.tokens for step in group], kv_cache.device),
        prompt_length=uniform([step.entries.schedule.prompt_length for step in group], kv_cache.device),
        decode_step=first.decode_step,
        budget=first.entries.schedule.budget,
        num_new=first.num_new,
        passes=first.passes,
        layer_idx=layer_idx,
        memo=layers[0].memo if alone else StackedRows([la.memo for la in layers]),
        owner=first.entries.owner if alone else stacked_owner(policy, group),
    )
    for name, value in policy.new_tokens(view, first.num_new).items():  # the view reads the same dict
        state[name] = torch.cat([state[name][:, :, : first.held], value], dim=2) if name in state else value
    phase = view.phase()
    requirements = policy.requirements(phase, first.evicts)
    signals = compute_signals(requirements, view, phase, query, scale)
    policy.observe(view, signals)
    if first.evicts:
        positions, state = _evict(view, signals, first.keep, kv_cache, layout, blocks)
        for row, (step, layer) in enumerate(zip(group, layers)):
            layer.positions, layer.recorded = positions[row : row + 1], step.tokens
    if not alone or first.evicts:  # (a pass that evicts nothing holds every new token: positions are implied)
        for row, layer in enumerate(layers):
            layer.state = {name: value[row : row + 1] for name, value in state.items()}


def stacked_owner(policy: Any, group: list[RowPass]) -> CacheSide:
    """What the policy reads of the cache for requests in lockstep: their shared data stacked,
    their hidden-state series (if the policy reads them) looked up row by row."""
    owners = [step.entries.owner for step in group]
    hidden = None if owners[0].hidden is None else StackedHidden([owner.hidden for owner in owners])
    return CacheSide(policy, StackedRows([owner.shared for owner in owners]), hidden)


def held_positions(layers: list[LayerEntries], tokens: list[int]) -> torch.Tensor:
    """``[B, Hkv, n]``: the positions each request's layer holds once it processed ``tokens[b]``
    tokens (:meth:`LayerEntries.positions_at`), with two concatenations for the whole batch when
    the requests recorded as many entries and hold as many later tokens (in lockstep, they do)."""
    first = layers[0]
    later = {count - layer.recorded for layer, count in zip(layers, tokens)}
    if len(layers) == 1 or len(later) > 1 or any(la.positions.shape != first.positions.shape for la in layers):
        return torch.cat([layer.positions_at(count) for layer, count in zip(layers, tokens)])
    device = first.positions.device
    recorded = torch.tensor([layer.recorded for layer in layers], device=device)[:, None, None]
    tail = (recorded + torch.arange(later.pop(), device=device)).expand(-1, first.positions.shape[1], -1)
    return torch.cat([torch.cat([layer.positions for layer in layers]), tail], dim=-1)


def _evict(
    view: PagedEntries, signals: Any, budget: int, kv_cache: torch.Tensor, layout: BlockLayout, blocks: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Keep the policy's selection of ``budget`` entries per head in ``view``'s requests, laid out
    as kvevict's cache lays them out; the kept entries' positions and state."""
    policy, length = view.policy, view.length
    slots = policy.drop_lowest(view, signals, budget)
    if slots is not None:
        keep = torch.ones_like(view.positions, dtype=torch.bool)
        keep.scatter_(-1, slots[..., None], False)
    else:
        keep = policy.select(view, signals, budget)
    counts = keep.sum(dim=-1)
    if not bool((counts == budget).all()):
        raise RuntimeError(f"{policy.name} kept {counts.tolist()} entries per head, not the budget {budget}")
    index = torch.arange(length, device=kv_cache.device)
    prefix = index < counts[..., None]
    holes, movers = (prefix & ~keep).nonzero(), (~prefix & keep).nonzero()
    # kvevict's layout: kept entries stay in their slots, the dropped ones below the budget are
    # refilled in order by the kept ones above it, so only those move
    layout.move(kv_cache, blocks, holes[:, 0], holes[:, 1], movers[:, 2], holes[:, 2])
    source = refill_sources(length, counts, holes, movers)[..., :budget]  # [B, Hkv, budget]
    state = {}
    for name, value in view.state.items():
        index_shape = (*source.shape, *value.shape[3:])
        state[name] = value.gather(2, source.reshape(*source.shape, *([1] * (value.dim() - 3))).expand(index_shape))
    return view.positions.gather(-1, source), state
