"""The hidden-state signal of the EpiKV family (seed 000, Eq. 1; DESIGN §3).

``g_l(t) = ‖h_l(t) − h_l(t−1)‖₂`` where ``h_l(t)`` is the output of decoder layer ``l`` for
token ``t`` (``hidden_states[l + 1]`` of transformers; for the last layer, before the final
norm). The first token of a sequence has no predecessor: ``g_l(0) = 0``.

:class:`HiddenStateRecorder` reads it with forward hooks on only the decoder layers a policy
asks for (DESIGN §1.4: no monkey-patching), for the passes that run through its cache:

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


class HiddenStateRecorder:
    """Records ``g_l`` of every token on the hooked ``layers`` and freezes per-token scores.

    Args:
        model: the causal LM whose decoder layers are hooked.
        layers: decoder layer indices to hook (only these).
        scorer: the policy's score of ``m`` consecutive tokens from their changes; the score of
            a token may depend on the ``context`` tokens before it and on nothing after it
            (None: record the changes only).
        context: how many earlier tokens a score depends on (e.g. 63 for a 64-token window).
        cache: record only the passes whose ``past_key_values`` is this object (None: all).
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
        self.layers = wanted
        self.scorer = scorer
        self.context = context
        self._cache = None if cache is None else weakref.ref(cache)
        self.reset()
        self._modules = {i: modules[i] for i in wanted}
        self._install()

    def reset(self) -> None:
        """Forget every token recorded: the next pass starts a new sequence at position 0
        (what ``EvictionCache.reset()`` needs); the hooks stay."""
        self.changes: dict[int, torch.Tensor] = {i: torch.empty(0) for i in self.layers}
        """``g_l`` of every token seen, ``{layer: [B, T_l]}`` fp32, by absolute position."""
        self._table = torch.empty(0)
        """Frozen per-token scores ``[B, capacity]`` of the first :attr:`scored` positions, then
        ``+inf`` (at least one column): a lookup is one gather, whatever it asks for."""
        self._scored = 0
        self._last: dict[int, torch.Tensor] = {}

    def _install(self) -> None:
        me = weakref.ref(self)
        handles = [module.register_forward_hook(_hook(me, i), with_kwargs=True) for i, module in self._modules.items()]
        self._finalizer = weakref.finalize(self, _remove, handles)

    def __deepcopy__(self, memo: dict[int, Any]) -> HiddenStateRecorder:
        """A copy with its own hooks, recording for the copy of its cache (``copy.deepcopy`` of an
        ``EvictionCache`` maps the cache to its copy in ``memo``) and sharing the model."""
        twin = copy.copy(self)
        twin.changes = {i: t.clone() for i, t in self.changes.items()}
        twin._table = self._table.clone()
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

    @property
    def scored(self) -> int:
        """Positions ``0 .. scored - 1`` have a frozen score."""
        return self._scored

    @property
    def scores(self) -> torch.Tensor:
        """Frozen per-token scores ``[B, T]`` of the first ``T`` = :attr:`scored` positions."""
        return self._table[:, : self._scored] if self._scored else self._table

    def _append_scores(self, new: torch.Tensor) -> None:
        """Freeze ``new`` ``[B, m]``, the scores of the next ``m`` positions (grown geometrically,
        so each step's append is O(1) amortised and a column of ``+inf`` always follows)."""
        start, end = self._scored, self._scored + new.shape[1]
        if self._table.dim() != 2 or self._table.shape[1] <= end:
            table = new.new_full((new.shape[0], max(64, 2 * end)), float("inf"))
            if start:
                table[:, :start] = self._table[:, :start]
            self._table = table
        self._table[:, start:end] = new
        self._scored = end

    @property
    def offsets(self) -> list[int]:
        """Left padding of each row of the cache's batch (the first pass's padding columns)."""
        cache = None if self._cache is None else self._cache()
        return getattr(cache, "row_offsets", None) or [0]

    def record(self, layer: int, hidden: torch.Tensor) -> None:
        """Append the changes of the tokens of one pass ``[B, n, D]`` through ``layer``."""
        changes = hidden_changes(hidden, self._last.get(layer))
        if layer not in self._last:  # a row's first real token has no predecessor, padding or not
            for row, pad in enumerate(self.offsets):
                if pad:
                    changes[row, pad] = 0.0
        self._last[layer] = hidden[:, -1].float()
        old = self.changes[layer]
        self.changes[layer] = changes if old.numel() == 0 else torch.cat([old, changes], dim=1)
        self._score_new_tokens()

    def _score_new_tokens(self) -> None:
        if self.scorer is None:
            return
        ready = min(_length(self.changes[i]) for i in self.layers)
        start = self.scored
        if ready <= start:
            return
        offsets = self.offsets
        if not any(offsets):
            begin = max(0, start - self.context)
            window = {i: self.changes[i][:, begin:ready] for i in self.layers}
            new = self.scorer(window)[:, start - begin :].float()
        else:  # score each row on its own tokens, as alone (padding is neither scored nor context)
            rows = []
            for row, pad in enumerate(offsets):
                first = max(start, pad)
                begin = max(pad, first - self.context)
                window = {i: self.changes[i][row : row + 1, begin:ready] for i in self.layers}
                scored = self.scorer(window)[:, first - begin :].float()
                rows.append(torch.nn.functional.pad(scored, (first - start, 0), value=float("inf")))
            new = torch.cat(rows)
        self._append_scores(new)

    def lookup(self, positions: torch.Tensor, row: int | None = None, end: int | None = None) -> torch.Tensor:
        """Frozen scores of the entries at ``positions`` ``[B, H, n]`` (fp32); ``+inf`` for
        positions not scored yet (their pass has not reached every hooked layer). Positions
        count the columns of the passes (a row's left padding included); ``row``: look up
        that row of the batch only (``positions`` then ``[1, H, n]``); ``end``: every position
        is below it (the table, ``+inf`` past the scored ones, then needs no clamp when it
        reaches that far: a decode step's usual case)."""
        if self._scored == 0:
            return torch.full(positions.shape, float("inf"), dtype=torch.float32, device=positions.device)
        table = self._table.to(positions.device)
        if end is None or end > table.shape[-1]:
            positions = positions.clamp(max=table.shape[-1] - 1)  # past the table: +inf, as its last column
        rows = table[:, None, :] if row is None else table[row : row + 1, None, :]
        return rows.expand(positions.shape[0], positions.shape[1], -1).gather(2, positions)  # (faster than take)

    def wants(self, past_key_values: Any) -> bool:
        return self._cache is None or past_key_values is self._cache()


def _length(series: torch.Tensor) -> int:
    """Tokens in a ``[B, T]`` series (the initial placeholder is empty)."""
    return series.shape[-1] if series.dim() == 2 else 0


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
