"""Fast KVzip (Kim, Han, Yun 2026, "Fast KVzip: Efficient and Accurate LLM Inference with
Gated KV Eviction", arXiv 2601.17668; DESIGN §3).

KVzip's quality at a plain prefill's cost: a small gate per layer (:mod:`kvevict.gates`) reads the
layer's input hidden states and predicts every token's KVzip score per KV head, with no attention
matrix and no repeat pass. (Both embedded models' shipped gates predict a variant of that score:
KVzip+'s, with the repeat replaced by answers to needle questions in 198 phrasings, which keeps more
needles at keep 0.10 in phrasings the gates never saw; docs/fastkvzip.md, rounds 25–26.) Each entry's
score is computed once, when its token passes the layer (prefill, every chunk of a chunked prefill,
every decode step), kept as the entry's per-token state, and read at every eviction. The sinks (4) and
a recent window (32 tokens) are kept. As KVzip, the prompt is compressed at prefill by default, with
one budget pooled over every layer and head (``global`` with no per-head floor); a prompt fed in
chunks is pooled after each chunk, the retained and new entries of every layer re-ranked by their gate
scores. Until its last chunk (where the cache knows the prompt's length: ``prompt_length=``, as
:func:`kvevict.generation.prefill` tells it) every head also holds the prompt's last 512 tokens
(``prompt_window``) on top of what the pool selects, so a chunk's tokens see that much of their past
even in the heads the pool leaves at sinks and window: their hidden states, and so the gates' scores
and the entries kept, drift less from one pass's (docs/fastkvzip.md, round 13); the last chunk's
eviction ranks them with the rest and keeps the budget with the 32-token window. Each chunk's pass
over a ragged layer stays packed on a CPU (each head costs its own entries: no cap), and where it
cannot (a GPU) the pool gives a head at most ``4·budget`` entries (the prompt window on top), so a
pass never holds more than that plus the chunk per layer however long the prompt (docs/fastkvzip.md,
rounds 8 and 9). ``per_layer=true`` gives each head its budget, and another allocator (``adakv+``,
``pyramidkv+``, ``global+`` with its floor) may be named over it. ``regime=decode|both`` evicts while
decoding too (each head keeping its budget): every generated token is scored as it passes, and the
cache is evicted back to its budget every ``interval`` tokens (the paper's 128, ``min(128, budget //
2)`` for small budgets), so a decode step pays for an eviction once per interval.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvevict.budgets import capped_share
from kvevict.gates import (
    TRAIN_COMMAND,
    GateHooks,
    check_fits,
    initial_gates,
    load_gates,
    model_key,
    packaged_path,
    shape_of,
)
from kvevict.policies.allocation import GlobalBudget
from kvevict.policies.base import Method, SinksAndWindow, Stages
from kvevict.policies.params import Param, declare, flag, integer
from kvevict.signals import Signals

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.views import CacheSide, EntryView

SCORE = "score"
"""Per-token state key (this stage's namespace): the gate's score ``[B, Hkv, n]`` fp32."""
INITIAL = "initial"
"""``gates=initial``: untrained, seeded gates (tests, and an untrained baseline)."""


def _gates_source(value: object) -> bool:
    return value is None or (isinstance(value, str) and bool(value))


class FastKVzip(Method):
    """Fast KVzip: keep the entries trained gates predict KVzip would keep (module docstring).

    Args:
        gates: the gates file (``kvevict train-gates`` writes one); None: the gates packaged
            for the model (SmolLM2-135M-Instruct, Gemma-3-270M); ``"initial"``: untrained gates.
        sinks: first tokens always kept (4).
        window: recent tokens always kept (32).
        prompt_window: recent tokens kept on top of the budget's selection after each chunk of a
            prompt fed in chunks but the last (512; 0: the budget alone after every chunk).
        per_layer: each head keeps its own budget instead of one pool over every layer and head.
        interval: decode-time eviction every ``interval`` tokens (``regime=decode|both``; default
            ``min(128, budget // 2)``, the paper's 128); the cache's own ``interval=`` overrides it.
    """

    name = "fastkvzip"
    summary = "keep what trained gates on each layer's input predict KVzip keeps (no repeat pass; prefill)"
    regimes = ("prefill", "decode", "both")
    comparable_scores = True  # they estimate KVzip's attention probabilities
    batched = True
    PARAMS = declare(
        gates=Param(None, "a gates file (.safetensors) or 'initial'", _gates_source, "the packaged gates"),
        sinks=integer(4),
        window=integer(32),
        prompt_window=integer(512),
        per_layer=flag(False),
        interval=integer(None, low=1, unset="min(128, budget // 2)"),
    )

    def stages(self) -> Stages:
        pooled = self.regime == "prefill" and not self.per_layer
        return Stages(
            scorer=self,
            protector=SinksAndWindow(self.sinks, self.window, prompt_window=self.prompt_window),
            allocator=GlobalBudget(safeguard=0.0) if pooled else None,
            replaceable=frozenset({"allocator"}),
        )

    def default_interval(self, budget: int) -> int | None:
        """Every ``interval`` tokens while decoding; None (every step: no room reserved past the
        budget) when only the prompt is compressed."""
        if self.regime == "prefill":
            return None
        return max(1, capped_share(budget, divisor=2)) if self.interval is None else self.interval

    def bind(self, config: PretrainedConfig) -> None:
        """Load the gates for ``config`` (refused, saying how to train them, when there are none)."""
        super().bind(config)
        if self.gates == INITIAL:
            self._weights = initial_gates(shape_of(config))
            return
        path = packaged_path(config) if self.gates is None else Path(self.gates)
        if not path.is_file():
            where = f"no gates file {path}" if self.gates is not None else f"no gates for model {model_key(config)}"
            raise ValueError(
                f"fastkvzip: {where}; train them with: " + TRAIN_COMMAND.format(model="MODEL", key=model_key(config))
            )
        self._weights = load_gates(path)
        check_fits(self._weights, config, str(path))

    def attach(self, model: torch.nn.Module, cache: CacheSide) -> GateHooks:
        if not hasattr(self, "_weights"):
            raise ValueError("fastkvzip: bind the policy to the model's config before attaching its gates")
        return GateHooks(model, self._weights, cache)

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        hooks = layer.layer.owner.hooks
        return {SCORE: hooks.scores(layer.layer_idx, layer.rows, num_new, layer.device)}

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return self.state(layer)[SCORE]
