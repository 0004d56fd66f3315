"""The hidden-state signal of the EpiKV family (seed 000, Eq. 1; DESIGN §3).

``g_l(t) = ‖h_l(t) − h_l(t−1)‖₂`` where ``h_l(t)`` is the output of decoder layer ``l`` for
token ``t`` (``hidden_states[l + 1]`` of transformers; for the last layer, before the final
norm). The first token of a sequence has no predecessor: ``g_l(0) = 0``.

:class:`HiddenStateRecorder` reads it with forward hooks on only the decoder layers a policy
asks for (DESIGN §1.4: no monkey-patching), for the passes that run through its cache, into a
:class:`HiddenSeries` (the vLLM plug-in keeps one per request, fed by hooks of its own):

* a pass of ``n`` tokens (the prompt, or one decode token) yields ``g_l`` of those ``n``
  tokens at once, stored in fp32 by absolute position; nothing is ever recomputed;
* once every hooked layer has seen a token, the policy's per-token score of that token is
  computed from the trailing ``hidden_context`` values and frozen (:attr:`scores`);
* ordering: :meth:`lookup` reports every position not scored yet as ``+inf`` (kept). A
  prefill eviction at layer ``i`` runs inside that layer's attention, so the tokens of the
  pass in flight have a score only at layers past every hooked one; a decode step's eviction
  runs when the pass ends (:mod:`kvevict.cache`), when every hook has seen the new token, so
  its score counts at every layer (it is inside the recent window anyway, unless the window
  is 0).

Hooks are removed by :meth:`close` (also what ``EvictionCache.close()`` and leaving a
``with EvictionCache(...)`` block do) and when the recorder is garbage-collected together
with its cache: the hooks hold only a weak reference to the recorder.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from kvevict.compat import pass_cache

ScoreFunction = Callable[[dict[int, torch.Tensor]], torch.Tensor]
"""Per-token scores ``[B, m]`` from the changes ``{layer: [B, m]}`` of ``m`` consecutive tokens."""


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The model's list of decoder layers (``model.get_decoder().layers``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"cannot find the decoder layers of {type(model).__name__}: kvevict hooks `model.get_decoder().layers` "
            "(Llama-style decoders: llama, mistral, qwen2, qwen3)"
        )
    return layers


def hidden_changes(hidden: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
    """``g(t) = ‖h(t) − h(t−1)‖₂`` for the tokens of ``hidden`` ``[B, n, D]`` → ``[B, n]`` fp32.

    ``previous`` ``[B, D]`` is the hidden state of the token before the first one; without
    it the first token's change is 0 (it has no predecessor).
    """
    hidden = hidden.float()
    if previous is None:
        return torch.nn.functional.pad(torch.linalg.vector_norm(hidden[:, 1:] - hidden[:, :-1], dim=-1), (1, 0))
    previous = previous.float()[:, None]
    # a decode step's one token needs no cat
    before = previous if hidden.shape[1] == 1 else torch.cat([previous, hidden[:, :-1]], dim=1)
    return torch.linalg.vector_norm(hidden - before, dim=-1)


class HiddenSeries:
    """``g_l`` of every token on ``layers``, recorded pass by pass, and the per-token scores frozen
    from them: the data half of :class:`HiddenStateRecorder`, with no model attached (the vLLM
    plug-in keeps one per request and records from its own hooks, :mod:`kvevict.vllm.worker`).

    Each row of the batch keeps its own series, by the absolute position of its own tokens
    (a row's left padding is not recorded): rows may have seen different numbers of tokens,
    so a row can join a running batch (:meth:`splice`) or leave it (:meth:`remove_rows`) with
    its statistics. Series and score table grow geometrically, and a step scores only its new
    tokens from the trailing ``context`` changes: O(1) amortised work per decode step.

    Args:
        layers: decoder layer indices recorded (only these).
        scorer: the policy's score of ``m`` consecutive tokens from their changes; the score of
            a token may depend on the ``context`` tokens before it and on nothing after it
            (None: record the changes only).
        context: how many earlier tokens a score depends on (e.g. 63 for a 64-token window).
    """

    def __init__(self, layers: Sequence[int], scorer: ScoreFunction | None = None, *, context: int = 0):
        self.layers = tuple(sorted(set(layers)))
        self.scorer = scorer
        self.context = context
        self.reset()

    def reset(self) -> None:
        """Forget every token recorded: the next pass starts new sequences at position 0
        (what ``EvictionCache.reset()`` needs)."""
        self._series = {i: _Series() for i in self.layers}
        """``g_l`` of every row's tokens, by absolute position, per recorded layer."""
        self._table = _Series(fill=float("inf"))
        """Frozen per-token scores of each row's first ``scored`` positions, then ``+inf`` (at
        least one column): a lookup is one gather, whatever it asks for."""
        self._last: dict[int, torch.Tensor] = {}
        """The hidden state ``[B, D]`` of each row's last token, per recorded layer."""

    @property
    def changes(self) -> dict[int, torch.Tensor]:
        """``g_l`` of every token seen, ``{layer: [B, T]}`` fp32 by absolute position (``T``: the
        longest row's tokens; a shorter row's later columns are 0)."""
        return {i: series.view() for i, series in self._series.items()}

    @property
    def scored(self) -> int:
        """Positions ``0 .. scored - 1`` of the longest-scored row have a frozen score."""
        return max(self._table.lengths, default=0)

    @property
    def scores(self) -> torch.Tensor:
        """Frozen per-token scores ``[B, T]`` of the first ``T`` = :attr:`scored` positions (``+inf``
        past a row's own scored ones)."""
        return self._table.view()

    def _real_tokens(self, batch: int, columns: int) -> list[int]:
        """How many of a pass's last ``columns`` are each row's real tokens (here: all of them)."""
        return [columns] * batch

    def record(self, layer: int, hidden: torch.Tensor) -> None:
        """Append the changes of the tokens of one pass ``[B, n, D]`` through ``layer`` (each row's
        real tokens are the last ones of the pass; the first one of a row has no predecessor)."""
        series, n = self._series[layer], hidden.shape[1]
        real = self._real_tokens(hidden.shape[0], n)
        last = self._last.get(layer)
        lengths = series.rows_or(len(real))
        if real.count(n) == len(real) and (last is None) == (lengths.count(0) == len(real)):
            changes = hidden_changes(hidden, last)  # every row: n real tokens, all with or all without history
            series.append(changes)
        else:
            for row, count in enumerate(real):
                if count:
                    previous = None if last is None or not series.lengths[row] else last[row : row + 1]
                    series.append_row(row, hidden_changes(hidden[row : row + 1, n - count :], previous)[0])
        newest = hidden[:, -1].to(torch.float32, copy=True)  # not a view: it would keep the whole pass alive
        if last is not None and real.count(0):  # a row without real tokens keeps its last one
            newest = torch.where(torch.tensor([c > 0 for c in real], device=newest.device)[:, None], newest, last)
        self._last[layer] = newest
        self._score_new_tokens()

    def _score_new_tokens(self) -> None:
        if self.scorer is None:
            return
        batch = max(len(series.lengths) for series in self._series.values())
        ready = [min(row) for row in zip(*(series.rows_or(batch) for series in self._series.values()))]
        starts = self._table.rows_or(len(ready))
        if ready.count(ready[0]) == len(ready) and starts.count(starts[0]) == len(starts):
            spans = [(slice(None), starts[0], ready[0])]  # every row at once (the usual case)
        else:
            spans = [(slice(row, row + 1), start, end) for row, (start, end) in enumerate(zip(starts, ready))]
        for rows, start, end in spans:
            if end <= start:
                continue
            begin = max(0, start - self.context)
            window = {i: series.view()[rows, begin:end] for i, series in self._series.items()}
            new = self.scorer(window)[:, start - begin :].float()
            if isinstance(rows, slice) and rows.start is None:
                self._table.append(new)
            else:
                self._table.append_row(rows.start, new[0])

    def lookup(self, positions: torch.Tensor, row: int | None = None, end: int | None = None) -> torch.Tensor:
        """Frozen scores of the entries at ``positions`` ``[B, H, n]`` (fp32); ``+inf`` for
        positions not scored yet (their pass has not reached every hooked layer). ``row``: look
        up that row of the batch only (``positions`` then ``[1, H, n]``); ``end``: every position
        is below it (the table, ``+inf`` past the scored ones, then needs no clamp when it
        reaches that far: a decode step's usual case)."""
        table = self._table.buffer
        if table.dim() != 2 or not self.scored:
            return torch.full(positions.shape, float("inf"), dtype=torch.float32, device=positions.device)
        table = table.to(positions.device)
        if end is None or end > table.shape[-1]:
            positions = positions.clamp(0, table.shape[-1] - 1)  # past the table: +inf, as its last column
        elif bool(positions.min() < 0):  # free slots of unpacked storage (masked by the caller's `valid`)
            positions = positions.clamp(min=0)
        rows = table[:, None, :] if row is None else table[row : row + 1, None, :]
        return rows.expand(positions.shape[0], positions.shape[1], -1).gather(2, positions)  # (faster than take)

    # -- saving and loading (kvevict.persist) ----------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every row's series, scores and last hidden states, by name (what :meth:`load_state` reads)."""
        held = {f"hidden.series.{i}": series.view() for i, series in self._series.items()}
        held["hidden.table"] = self._table.view()
        held.update({f"hidden.last.{i}": last for i, last in self._last.items()})
        return {name: x.detach().cpu().contiguous().clone() for name, x in held.items()}

    def state_lengths(self) -> dict[str, list[int]]:
        """Each row's length of every series (what :meth:`load_state` reads with the tensors)."""
        return {"table": self._table.lengths, **{str(i): series.lengths for i, series in self._series.items()}}

    def load_state(self, lengths: dict[str, list[int]], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Take the rows' statistics :meth:`state_tensors` and :meth:`state_lengths` wrote."""
        self.reset()
        for i, series in self._series.items():
            series.load(tensors[f"hidden.series.{i}"].to(device), lengths[str(i)])
        self._table.load(tensors["hidden.table"].to(device), lengths["table"])
        self._last = {i: tensors[f"hidden.last.{i}"].to(device) for i in self.layers if f"hidden.last.{i}" in tensors}

    # -- rows of a batch that runs on -------------------------------------------------------
    def splice(self, row: int, source: HiddenSeries, source_row: int = 0) -> None:
        """Row ``row`` (the batch size: a new last row) takes row ``source_row`` of ``source`` (a
        series of the same layers): its changes, scores and last hidden states."""
        for i, series in self._series.items():
            series.put_row(row, source._series[i], source_row)
        self._table.put_row(row, source._table, source_row)
        for i, last in source._last.items():
            last = last[source_row : source_row + 1]
            mine = self._last.get(i)
            if mine is None:
                mine = last.new_zeros(len(self._table.lengths), last.shape[-1])
            if row == mine.shape[0]:
                mine = torch.cat([mine, last])
            else:
                mine = mine.clone()
                mine[row] = last[0]
            self._last[i] = mine

    def remove_rows(self, kept: Sequence[int]) -> None:
        """Keep only batch rows ``kept``, in that order."""
        for series in (*self._series.values(), self._table):
            series.select_rows(kept)
        index = torch.tensor(list(kept), dtype=torch.long)
        self._last = {i: last[index.to(last.device)] for i, last in self._last.items()}


class HiddenStateRecorder(HiddenSeries):
    """A :class:`HiddenSeries` fed by forward hooks on the model's decoder layers it records.

    Args:
        model: the causal LM whose decoder layers are hooked.
        layers: decoder layer indices to hook (only these).
        scorer: as :class:`HiddenSeries`'s.
        context: as :class:`HiddenSeries`'s.
        cache: record only the passes whose ``past_key_values`` is this object (None: all).
            Its ``pass_tokens()`` says how many of a pass's last columns are each row's real
            tokens (the rest is left padding); without a cache every column is real.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layers: Sequence[int],
        scorer: ScoreFunction | None = None,
        *,
        context: int = 0,
        cache: object | None = None,
    ):
        modules = decoder_layers(model)
        wanted = tuple(sorted(set(layers)))
        bad = [i for i in wanted if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(modules)]
        if not wanted or bad:
            raise ValueError(
                f"hidden-state layers must be decoder layer indices in 0..{len(modules) - 1}, got {list(layers)}"
            )
        super().__init__(wanted, scorer, context=context)
        self._cache = None if cache is None else weakref.ref(cache)
        self._modules = {i: modules[i] for i in wanted}
        self._install()

    def _install(self) -> None:
        me = weakref.ref(self)
        handles = [module.register_forward_hook(_hook(me, i), with_kwargs=True) for i, module in self._modules.items()]
        self._finalizer = weakref.finalize(self, _remove, handles)

    def __deepcopy__(self, memo: dict[int, Any]) -> HiddenStateRecorder:
        """A copy with its own hooks, recording for the copy of its cache (``copy.deepcopy`` of an
        ``EvictionCache`` maps the cache to its copy in ``memo``) and sharing the model."""
        twin = copy.copy(self)
        twin._series = {i: series.copy() for i, series in self._series.items()}
        twin._table = self._table.copy()
        twin._last = {i: t.clone() for i, t in self._last.items()}
        if self._cache is not None:
            cache = self._cache()
            twin._cache = weakref.ref(memo.get(id(cache), cache))
        twin._install()
        return twin

    @property
    def active(self) -> bool:
        """Whether the hooks are still installed."""
        return self._finalizer.alive

    def close(self) -> None:
        """Remove the hooks (idempotent); the recorded values stay readable."""
        self._finalizer()

    def _real_tokens(self, batch: int, columns: int) -> list[int]:
        """How many of a pass's last ``columns`` are each row's real tokens (the cache's count)."""
        cache = None if self._cache is None else self._cache()
        counts = getattr(cache, "pass_tokens", None)
        return [columns] * batch if counts is None else counts()

    def wants(self, past_key_values: Any) -> bool:
        return self._cache is None or past_key_values is self._cache()


class _Series:
    """Per-row series ``[B, capacity]`` fp32, row ``b`` holding ``lengths[b]`` values (then
    ``fill``), grown geometrically so that appending is O(1) amortised."""

    def __init__(self, fill: float = 0.0):
        self.fill = fill
        self.buffer = torch.empty(0)
        self.lengths: list[int] = []

    def copy(self) -> _Series:
        twin = _Series(self.fill)
        twin.buffer, twin.lengths = self.buffer.clone(), list(self.lengths)
        return twin

    def rows_or(self, batch: int) -> list[int]:
        """The rows' lengths (zeros for a batch not seen yet)."""
        return self.lengths or [0] * batch

    def view(self) -> torch.Tensor:
        """``[B, longest]``: every row's values (a shorter row's later columns hold ``fill``)."""
        return self.buffer[:, : max(self.lengths, default=0)] if self.buffer.dim() == 2 else self.buffer

    def _room(self, batch: int, needed: int, like: torch.Tensor) -> None:
        """Rows for ``batch`` and columns for ``needed`` values, copying the old ones once."""
        if self.buffer.dim() == 2 and self.buffer.shape[0] == batch and self.buffer.shape[1] > needed:
            if self.buffer.is_inference() and not torch.is_inference_mode_enabled():
                self.buffer = self.buffer.clone()  # written in place later, outside inference_mode
            return
        old = self.buffer
        capacity = max(64, 2 * needed)
        self.buffer = like.new_full((batch, capacity), self.fill)
        if old.dim() == 2 and old.numel():
            rows, columns = min(batch, old.shape[0]), min(capacity, old.shape[1])
            self.buffer[:rows, :columns] = old[:rows, :columns]
        self.lengths += [0] * (batch - len(self.lengths))

    def append(self, values: torch.Tensor) -> None:
        """The next values ``[B, m]`` of every row, each after its own last one."""
        batch, m = values.shape
        lengths = self.lengths or [0] * batch
        self._room(batch, max(lengths) + m, values)
        if lengths.count(lengths[0]) == batch:  # rows of one length: one slice
            self.buffer[:, lengths[0] : lengths[0] + m] = values
        elif m == 1:  # a decode step of rows at different positions: one scatter
            rows = torch.arange(batch, device=values.device)
            self.buffer[rows, torch.tensor(lengths, device=values.device)] = values[:, 0]
        else:
            for row, start in enumerate(lengths):
                self.buffer[row, start : start + m] = values[row]
        self.lengths = [length + m for length in lengths]

    def append_row(self, row: int, values: torch.Tensor) -> None:
        """The next values ``[m]`` of row ``row`` (of a batch at least ``row + 1`` rows)."""
        batch = max(row + 1, len(self.lengths), self.buffer.shape[0] if self.buffer.dim() == 2 else 0)
        self.lengths += [0] * (batch - len(self.lengths))
        start = self.lengths[row]
        end = start + values.shape[0]
        self._room(batch, max(end, max(self.lengths)), values)
        self.buffer[row, start:end] = values
        self.lengths[row] = end

    def put_row(self, row: int, source: _Series, source_row: int = 0) -> None:
        """Row ``row`` (or a new last row) holds row ``source_row`` of ``source``."""
        length = source.lengths[source_row] if source.lengths else 0
        batch = max(row + 1, len(self.lengths))
        self._room(batch, max([length, *self.lengths]), source.buffer if source.buffer.dim() == 2 else self.buffer)
        self.buffer[row] = self.fill
        if length:
            self.buffer[row, :length] = source.buffer[source_row, :length]
        self.lengths[row] = length

    def load(self, values: torch.Tensor, lengths: list[int]) -> None:
        """Hold ``values`` ``[B, T]`` (row ``b``'s first ``lengths[b]`` are its series)."""
        self.lengths = []
        if values.dim() == 2 and values.shape[0]:
            self._room(values.shape[0], values.shape[1], values)
            self.buffer[:, : values.shape[1]] = values
        self.lengths = list(lengths)

    def select_rows(self, kept: Sequence[int]) -> None:
        if self.buffer.dim() == 2:
            self.buffer = self.buffer[torch.tensor(list(kept), dtype=torch.long, device=self.buffer.device)]
        self.lengths = [self.lengths[i] for i in kept] if self.lengths else []


def _hook(recorder: weakref.ref[HiddenStateRecorder], layer: int) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        me = recorder()
        if me is None or not me.wants(pass_cache(kwargs)):
            return
        hidden = output[0] if isinstance(output, tuple) else output
        with torch.no_grad():
            me.record(layer, hidden.detach())

    return hook


def _remove(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
