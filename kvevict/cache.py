"""Eviction-aware KV storage for transformers (DESIGN §1.1, §1.5).

:class:`EvictionLayer` is a cache *layer* in the style of transformers'
``DynamicSlidingWindowLayer``: keys/values ``[B, Hkv, n, d]`` physically shrink to the
budget; next to them live the absolute position of each entry ``[B, Hkv, n]`` and the
policy's per-token state ``{name: [B, Hkv, n, ...]}``, gathered with the entries on every
eviction so they never drift apart. Each KV head keeps its own set of tokens.

``get_seq_length()`` counts tokens *seen* (so new tokens get their absolute RoPE
positions) and ``get_mask_sizes()`` describes the *retained* entries as the most recent
``n`` positions before the query: every retained entry is in the past, so the standard
causal mask is exact and ``model.generate(..., past_key_values=cache)`` just works.

A sliding-window layer (Mistral, Gemma 2/3, gpt-oss, Qwen2 with ``use_sliding_window``) is
an :class:`EvictionLayer` with a ``window``: after every pass it first drops the entries no
later query can see (positions ``≤ seen − window``, as transformers'
``DynamicSlidingWindowLayer`` does, without telling the policy: they are not evicted, the
model would not see them either), then the policy evicts the rest to the budget as on a
full layer. It so never holds more than ``min(window, budget)`` + interval entries between
passes, and its mask is built from positions (:mod:`kvevict.attention`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

from kvevict import attention
from kvevict.budgets import Budget
from kvevict.hidden import HiddenStateRecorder
from kvevict.models import RotaryTable, check_policy_fits, check_supported
from kvevict.policies import Method, Policy, make_policy
from kvevict.signals import LogitSpec, Phase, Signals, compute_signals

SidePassObserver = Callable[["EvictionLayer", torch.Tensor, float, torch.nn.Module | None], None]
"""Receives ``(layer, query, scaling, attention module)`` of each layer during a scoring pass."""


class PrefillHook:
    """A forward hook on the model's decoder that ends a deferred prefill eviction once the
    prefill forward has run through every layer (:meth:`EvictionCache.finish_prefill`).

    Why a hook on the decoder: it is transformers' public extension point that fires after
    the last layer, whichever entry point ran the pass (``model.generate``, ``model(...)``,
    ``model.model(...)``), and it sees the pass's ``input_ids`` and ``past_key_values``, so
    only passes through its own cache act. The hook holds a weak reference to the cache."""

    def __init__(self, model: PreTrainedModel, cache: EvictionCache):
        decoder = model.get_decoder()
        ref = weakref.ref(cache)

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
            owner = ref()
            if owner is not None and kwargs.get("past_key_values") is owner:
                input_ids = kwargs.get("input_ids", args[0] if args else None)
                with torch.no_grad():
                    owner.finish_prefill(module, input_ids)

        handle = decoder.register_forward_hook(hook, with_kwargs=True)
        self._finalizer = weakref.finalize(cache, handle.remove)

    def close(self) -> None:
        self._finalizer()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        """A copy of the cache (made after its prefill) has no deferred eviction to finish."""
        return


class EvictionLayer(DynamicLayer):
    """One attention layer of an :class:`EvictionCache`: full attention, or a sliding
    window of ``window`` positions (a query at ``p`` sees keys at ``> p − window``)."""

    is_croppable = False

    def __init__(self, owner: EvictionCache, layer_idx: int, window: int | None = None):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.window = window
        self.is_sliding = window is not None  # transformers builds sliding masks from such layers
        self._clear()

    def _clear(self) -> None:
        self.seen = 0
        self.passes = 0
        self.prompt_length = 0
        self.budget: int | None = None
        self.interval = 1
        self.decode_peak = 0
        """Most entries held during a decode pass (after appending, before evicting)."""
        self.positions = torch.empty(0, dtype=torch.long)
        self.valid: torch.Tensor | None = None
        """``[B, Hkv, n]`` bool once heads hold different numbers of entries (head-wise
        budgets): each head is padded to the longest one and its padding is masked out of
        attention and selection. ``None`` while every entry is real."""
        self.state: dict[str, torch.Tensor] = {}
        self.memo: dict[str, object] = {}
        """Per-layer policy data that is not per token (e.g. recent queries)."""

    @property
    def policy(self) -> Policy:
        return self.owner.policy

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def length(self) -> int:
        """Retained entries per KV head (of the longest head when head-wise budgets differ)."""
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def head_lengths(self) -> torch.Tensor:
        """Real (unpadded) entries of each KV head, ``[B, Hkv]`` int64."""
        if self.valid is not None:
            return self.valid.sum(dim=-1)
        return torch.full(self.keys.shape[:2], self.length, dtype=torch.long, device=self.device)

    # -- transformers' layer API ------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h = key_states.shape[:2]
        if b != 1:
            raise ValueError(
                f"batch size {b} is not supported yet: kvevict evicts per sequence, so pass one prompt at a time "
                "(batch size 1)"
            )
        self.keys = key_states.new_empty(b, h, 0, key_states.shape[-1])
        self.values = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self.positions = torch.empty(b, h, 0, dtype=torch.long, device=self.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, num_new = key_states.shape[:3]
        new_positions = torch.arange(self.seen, self.seen + num_new, device=self.device).expand(b, h, num_new)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.positions = torch.cat([self.positions, new_positions], dim=-1)
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones(b, h, num_new)], dim=-1)
        self.seen += num_new
        self.passes += 1
        if self.passes == 1:
            self.prompt_length = num_new
            self.budget = self.owner.budget.resolve(num_new)
            if self.owner.budget.keep is not None:  # a token budget was checked up front
                self.policy.check_budget(self.budget)
            self.interval = self.owner.interval or (self.budget and self.policy.default_interval(self.budget)) or 1
        for name, value in self.policy.new_tokens(self, num_new).items():
            old = self.state.get(name)
            self.state[name] = value if old is None else torch.cat([old, value], dim=2)
        if self.passes > 1:
            self.decode_peak = max(self.decode_peak, self.length)
        attention.mark_pending(self, self.keys)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, self.seen - self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an EvictionCache cannot be cropped: evicted entries cannot be restored")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported with an EvictionCache (batch size 1 only)")

    batch_repeat_interleave = batch_select_indices = reorder_cache

    # -- eviction -----------------------------------------------------------------------
    def phase(self) -> Phase:
        return "prefill" if self.passes == 1 else "decode"

    def eviction_due(self, phase: Phase, num_new: int) -> bool:
        """Over budget (counting, on a sliding layer, only the entries still in the window
        after this pass), and (decode) the step counter crossed a multiple of ``interval``."""
        if self.budget is None or self.held_after_pass() <= self.budget or not self.policy.evicts_in(phase):
            return False
        if phase == "prefill":
            return True
        step = self.decode_step  # the first decode step is 1
        return step // self.interval > (step - num_new) // self.interval

    @property
    def decode_step(self) -> int:
        """Tokens processed after the prompt (``t`` of the decode-time methods)."""
        return self.seen - self.prompt_length

    def outside_window(self) -> torch.Tensor | None:
        """``[B, Hkv, n]``: entries no later query can see (positions ``≤ seen − window``);
        None on a full layer or when there are none."""
        if self.window is None or not self.is_initialized:
            return None
        outside = self.positions <= self.seen - self.window
        return outside if bool(outside.any()) else None

    def held_after_pass(self) -> int:
        """Entries the longest head holds once the entries that left the window are dropped."""
        outside = self.outside_window()
        if outside is None:
            return self.length
        held = ~outside if self.valid is None else self.valid & ~outside
        return int(held.sum(dim=-1).max())

    def after_attention(
        self, query: torch.Tensor, scaling: float | LogitSpec, module: torch.nn.Module | None = None
    ) -> None:
        """Called by the attention path once this pass attended: compute the signals the
        policy asked for (with the kernel's logit recipe ``scaling``, see
        :class:`~kvevict.signals.LogitSpec`), let it observe them, drop what left a sliding
        window, and evict down to the budget when due."""
        if self.owner.side_pass is not None:  # a scoring pass of the policy's own (KVzip's repeat)
            self.owner.side_pass(self, query, scaling, module)
            return
        phase, num_new = self.phase(), query.shape[-2]
        evicting = self.eviction_due(phase, num_new)
        requirements = self.policy.requirements(phase, evicting)
        signals = compute_signals(requirements, self, phase, query, scaling, module)
        self.policy.observe(self, signals)
        outside = self.outside_window()
        if outside is not None:  # no longer attended by the model itself: gone before the policy chooses
            self.valid = ~outside if self.valid is None else self.valid & ~outside
        if evicting and phase == "prefill" and self.policy.deferred_prefill:
            self.owner.deferred.append((self, signals))
        elif evicting:
            self.keep(self.policy.select(self, signals, self.budget))
        elif outside is not None:
            self._retain(self.valid)

    def keep(self, mask: torch.Tensor) -> None:
        """Retain the entries where ``mask`` ``[B, Hkv, n]`` is true, in order, and tell the
        policy which ones it evicted."""
        if self.valid is not None:
            mask = mask & self.valid
        self.policy.on_evict(self, ~mask if self.valid is None else self.valid & ~mask)
        self._retain(mask)

    def _retain(self, mask: torch.Tensor) -> None:
        """Retain the entries where ``mask`` is true. Heads that keep different numbers are
        padded to the longest and ``valid`` marks the real ones."""
        counts = mask.sum(dim=-1)
        width = int(counts.max())
        # stable sort puts each head's kept entries first, in their original order
        indices = mask.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :width]
        uniform = bool((counts == width).all())
        self.valid = None if uniform else torch.arange(width, device=self.device) < counts[..., None]
        self.keys = _gather(self.keys, indices)
        self.values = _gather(self.values, indices)
        self.positions = _gather(self.positions, indices)
        self.state = {name: _gather(value, indices) for name, value in self.state.items()}

    def snapshot(self) -> tuple[int, int, int, int]:
        """What :meth:`restore` needs to drop entries appended after this point."""
        return self.length, self.seen, self.passes, self.decode_peak

    def restore(self, snapshot: tuple[int, int, int, int]) -> None:
        """Drop every entry appended since :meth:`snapshot` (nothing was evicted in between),
        as if the passes since then never ran: a side pass leaves no trace."""
        length, self.seen, self.passes, self.decode_peak = snapshot
        self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
        self.positions = self.positions[..., :length]
        self.valid = None if self.valid is None else self.valid[..., :length]
        self.state = {name: value[:, :, :length] for name, value in self.state.items()}

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values (padding of head-wise budgets included)."""
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes

    def retained_bytes(self) -> int:
        """Bytes of the real entries: what a head-wise ragged layout would hold."""
        if not self.is_initialized:
            return 0
        per_entry = self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()
        return int(self.head_lengths().sum()) * per_entry


def _gather(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather entries along dim 2 of ``[B, H, n, ...]``."""
    index = indices.reshape(*indices.shape, *([1] * (x.dim() - 3))).expand(*indices.shape, *x.shape[3:])
    return x.gather(2, index)


class EvictionCache(Cache):
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
    ):
        check_supported(model)
        policy = make_policy(policy) if isinstance(policy, str) else policy
        if isinstance(policy, Method):
            policy = Policy(policy)
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a policy name or a kvevict Policy, got {type(policy).__name__}")
        self.budget = Budget(budget, keep)
        if not self.budget.given and policy.name != "full":
            raise ValueError(f"policy {policy.name!r} needs a budget: give budget= (tokens) or keep= (fraction)")
        if budget is not None:
            policy.check_budget(budget)
        check_policy_fits(model, policy.corrects_output, budget)
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f"interval must be an integer >= 1 (1 = evict every step), got {interval!r}")
        self.interval = interval
        attention.install(model)
        config = model.config.get_text_config(decoder=True)
        self.policy = policy.bound(config)
        """This cache's copy of the policy, bound to the model (the object passed is left as it is)."""
        self.shared: dict[str, object] = {}
        """Per-cache policy data shared across layers (e.g. ThinKV's per-token entropy)."""
        hidden_layers = self.policy.hidden_layers(config.num_hidden_layers)
        self.hidden = (
            HiddenStateRecorder(
                model, hidden_layers, self.policy.hidden_scores, context=self.policy.hidden_context, cache=self
            )
            if hidden_layers
            else None
        )
        """Hooks on the decoder layers the policy reads (:mod:`kvevict.hidden`); None if it reads none."""
        self.rotary = RotaryTable(model)
        """cos/sin of the model's RoPE at any position (ExpectedAttention's future rotations)."""
        self.side_pass: SidePassObserver | None = None
        """Set while a policy runs a scoring pass of its own through this cache (KVzip)."""
        self.deferred: list[tuple[EvictionLayer, Signals]] = []
        """Layers whose prefill eviction waits for the end of the prefill forward, with their signals."""
        self._prefill_hook = PrefillHook(model, self) if self.policy.deferred_prefill else None
        _, layer_kwargs = get_layer_types_and_kwargs(config)  # check_supported: full or sliding layers only
        layers = [EvictionLayer(self, i, kwargs.get("sliding_window")) for i, kwargs in enumerate(layer_kwargs)]
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        return f"EvictionCache(policy={self.policy!r}, {self.budget}, interval={self.interval})"

    def close(self) -> None:
        """Remove the hooks from the model (also done on garbage collection)."""
        if self.hidden is not None:
            self.hidden.close()
        if self._prefill_hook is not None:
            self._prefill_hook.close()

    # -- deferred prefill eviction --------------------------------------------------------
    def finish_prefill(self, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """Evict the layers that deferred their prefill eviction, all at once: the policy
        may first run passes of its own (KVzip's repeat pass), then allocate across layers
        (``global+``), then each layer keeps its selection. Called by the decoder's forward
        hook after the prefill forward returned; a no-op inside a side pass (re-entry)."""
        if self.side_pass is not None or not self.deferred:
            return
        deferred, self.deferred = self.deferred, []
        self.policy.method.rescore(self, decoder, input_ids)
        for layer, keep in zip([layer for layer, _ in deferred], self.policy.select_layers(deferred)):
            layer.keep(keep)

    @contextmanager
    def scoring_pass(self, observer: SidePassObserver) -> Iterator[None]:
        """Run a forward pass through this cache that only scores: each eviction layer hands
        the pass's queries to ``observer(layer, query, scaling, module)`` instead of its
        policy, and every entry the pass appended is dropped afterwards (``seen``, counters
        and positions as before it), so later tokens never see it."""
        snapshots = [(layer, layer.snapshot()) for layer in self.eviction_layers]
        self.side_pass = observer
        try:
            yield
        finally:
            self.side_pass = None
            for layer, snapshot in snapshots:
                layer.restore(snapshot)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def eviction_layers(self) -> list[EvictionLayer]:
        return [layer for layer in self.layers if isinstance(layer, EvictionLayer)]

    def kv_bytes(self) -> int:
        """Bytes allocated for the retained keys and values of every layer (any layer type)."""
        return sum(allocated for allocated, _ in self.layer_bytes())

    def layer_bytes(self) -> list[tuple[int, int]]:
        """Per layer (full-attention and sliding alike): (bytes allocated, bytes of real
        entries). They differ only where head-wise budgets pad heads to the longest one of
        their layer."""
        return [(layer.kv_bytes(), layer.retained_bytes()) for layer in self.layers]

    def decode_peak(self) -> int:
        """Most entries any KV head held while decoding (budget + interval for lagged eviction)."""
        return max((layer.decode_peak for layer in self.eviction_layers), default=0)

    def layer_lengths(self) -> list[int]:
        """Retained entries per KV head, per layer."""
        return [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in self.layers]
