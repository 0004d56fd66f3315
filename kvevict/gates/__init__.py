"""Fast KVzip's gates (Kim, Han, Yun 2026, "Fast KVzip", arXiv 2601.17668; DESIGN §3).

One gate per decoder layer reads the layer's input hidden states ``h`` (as its attention
reads them: the residual stream after the layer's input norm, what the reference code hooks)
and predicts, for every token and KV head, a keep score in ``[0, 1]``:

    x       = P h                                (a rank-r projection, shared by q and k)
    q_{h,g} = RMSNorm(W_q x + b_q)_{h,g}        (per KV head h and query group g, dim d')
    k_h     = RMSNorm(W_k x)_h
    l_{h,g} = k_h·q_{h,g} / √d' + b_{h,g}
    s_{h,g} = 1 / (1 + Σ_s exp(k_{s,h}·q_{h,g} / √d' − l_{h,g}))    (S learned sink keys k_{s,h})
    score_h = mean_g s_{h,g}

(``s = σ(l − logsumexp_s(k_s·q/√d'))``, which is how it is computed.) The paper's projections
``W_q h``, ``W_k h`` are full ``D``-wide matrices; here they share one rank-``r`` factor ``P``
(``r = 8``), so a 30-layer model's gates weigh hundreds of KB (stored in fp16), not 13 MB.
The gates are trained by
distilling KVzip's scores with the LLM frozen (:mod:`kvevict.gates.train`) and stored as one
safetensors file per model; the ones trained here for the embedded models ship in this
folder (:func:`packaged_path`).
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from kvevict.compat import pass_cache
from kvevict.hidden import decoder_layers

FOLDER = Path(__file__).parent
EPSILON = 1e-6
PARTS = ("down", "q_proj", "q_bias", "k_proj", "q_norm", "k_norm", "sinks", "bias")
"""The tensors of one layer's gate (their names in a gates file are ``<layer>.<part>``)."""
TRAIN_COMMAND = "kvevict train-gates --model {model} --out DIR, then give fastkvzip[gates=DIR/{key}.safetensors]"


@dataclass(frozen=True)
class GateShape:
    """The sizes of one model's gates."""

    layers: int
    hidden: int
    kv_heads: int
    group: int
    """Query heads per KV head."""
    dim: int = 16
    """``d'``, the gate's query and key dimension."""
    sinks: int = 16
    """Learned sink keys per KV head."""
    rank: int = 8
    """``r``, the rank of the input projection ``P``."""


def model_key(config: Any) -> str:
    """The name a model's gates are stored under, from its (text) config: the architecture
    and the sizes the gates depend on, e.g. ``llama-L30-D576-H9-KV3``."""
    return (
        f"{config.model_type}-L{config.num_hidden_layers}-D{config.hidden_size}"
        f"-H{config.num_attention_heads}-KV{config.num_key_value_heads}"
    )


def shape_of(config: Any, dim: int = 16, sinks: int = 16, rank: int = 8) -> GateShape:
    """The gates' sizes for a model config."""
    return GateShape(
        config.num_hidden_layers,
        config.hidden_size,
        config.num_key_value_heads,
        config.num_attention_heads // config.num_key_value_heads,
        dim,
        sinks,
        rank,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPSILON) -> torch.Tensor:
    """RMSNorm over the last dimension, fp32: ``x / √(mean(x²) + eps) · weight``."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * weight


def gate_scores(hidden: torch.Tensor, gate: dict[str, torch.Tensor]) -> torch.Tensor:
    """One layer's keep scores ``[B, Hkv, n]`` (fp32, in ``[0, 1]``) of ``n`` tokens from their
    input hidden states ``[B, n, D]`` (module docstring). ``gate`` holds the layer's tensors:
    ``down`` ``[r, D]``, ``q_proj`` ``[Hkv·G·d', r]``, ``q_bias`` ``[Hkv·G·d']``, ``k_proj`` ``[Hkv·d', r]``,
    ``q_norm``/``k_norm`` ``[d']``, ``sinks`` ``[Hkv, S, d']``, ``bias`` ``[Hkv, G]``."""
    heads, _, dim = gate["sinks"].shape
    group = gate["bias"].shape[1]
    b, n, _ = hidden.shape
    x = hidden.to(gate["down"].dtype) @ gate["down"].T
    q = rms_norm((x @ gate["q_proj"].T + gate["q_bias"]).view(b, n, heads, group, dim), gate["q_norm"])
    k = rms_norm((x @ gate["k_proj"].T).view(b, n, heads, dim), gate["k_norm"])
    scale = 1.0 / math.sqrt(dim)
    logit = torch.einsum("bnhd,bnhgd->bnhg", k, q) * scale + gate["bias"]
    sink_logits = torch.einsum("hsd,bnhgd->bnhgs", gate["sinks"].float(), q) * scale
    score = torch.sigmoid(logit - sink_logits.logsumexp(dim=-1))
    return score.mean(dim=-1).transpose(1, 2)  # [B, Hkv, n]


def initial_gates(shape: GateShape, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Untrained gates, seeded: each projection uniform in ``±1/√fan_in`` (PyTorch's ``Linear``),
    norms 1, sinks and biases 0 (every score 1/(1+S) at first)."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(*size: int) -> torch.Tensor:
        return (torch.rand(*size, generator=generator) * 2 - 1) / math.sqrt(size[-1])

    queries = shape.kv_heads * shape.group * shape.dim
    return [
        {
            "down": uniform(shape.rank, shape.hidden),
            "q_proj": uniform(queries, shape.rank),
            "q_bias": uniform(queries, shape.rank)[:, 0].contiguous(),
            "k_proj": uniform(shape.kv_heads * shape.dim, shape.rank),
            "q_norm": torch.ones(shape.dim),
            "k_norm": torch.ones(shape.dim),
            "sinks": torch.zeros(shape.kv_heads, shape.sinks, shape.dim),
            "bias": torch.zeros(shape.kv_heads, shape.group),
        }
        for _ in range(shape.layers)
    ]


def save_gates(path: str | Path, gates: list[dict[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """Write gates as one safetensors file (``<layer>.<part>`` tensors in fp16: :func:`load_gates`
    gives back exactly what :func:`stored` rounds the gates to). The same gates and metadata give
    the same bytes: safetensors writes the metadata in a hash map's order, which changes from one
    process to the next, so the header is written again with the metadata sorted (same length)."""
    tensors = {
        f"{layer}.{part}": gate[part].detach().half().contiguous() for layer, gate in enumerate(gates) for part in PARTS
    }
    data = save(tensors, metadata=metadata)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode().ljust(size)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data[:8] + text + data[8 + size :])


def load_gates(path: str | Path) -> list[dict[str, torch.Tensor]]:
    """The gates of a file written by :func:`save_gates` (fp32)."""
    tensors = load_file(str(path))
    layers = 1 + max(int(name.split(".")[0]) for name in tensors)
    return [{part: tensors[f"{layer}.{part}"].float() for part in PARTS} for layer in range(layers)]


def stored(gates: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """``gates`` as a gates file holds them (rounded to fp16, as fp32)."""
    return [{part: value.detach().half().float() for part, value in gate.items()} for gate in gates]


def packaged_path(config: Any) -> Path:
    """Where the packaged gates of a model would be (``kvevict/gates/<model key>.safetensors``)."""
    return FOLDER / f"{model_key(config)}.safetensors"


def check_fits(gates: list[dict[str, torch.Tensor]], config: Any, source: str) -> None:
    """Refuse gates made for another model (``ValueError`` saying which sizes differ)."""
    want = shape_of(config)
    got = (len(gates), gates[0]["down"].shape[1], gates[0]["sinks"].shape[0], gates[0]["bias"].shape[1])
    if got != (want.layers, want.hidden, want.kv_heads, want.group):
        raise ValueError(
            f"fastkvzip: the gates in {source} are for (layers, hidden, KV heads, group) = {got}, this model has "
            f"{(want.layers, want.hidden, want.kv_heads, want.group)}; train gates for it: "
            + TRAIN_COMMAND.format(model="MODEL", key=model_key(config))
        )


AttentionInput = Callable[[int, torch.Tensor, Any], None]
"""Receives ``(layer index, the attention's input hidden states [B, q, D], the pass's cache)``."""


def hook_attention_inputs(model: torch.nn.Module, receive: AttentionInput) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward pre-hooks on every decoder layer's attention module handing its input hidden
    states (the layer's input after its input norm) to ``receive``; returns the handles."""
    handles = []
    for index, layer in enumerate(decoder_layers(model)):

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, index: int = index) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            receive(index, hidden.detach(), pass_cache(kwargs))

        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


class GateHooks:
    """Fast KVzip's gates run on a model, for one cache: at every pass through the cache each
    layer's gate scores the pass's tokens before the layer attends (:attr:`latest`, read when
    the layer stores the new entries). Hooks hold a weak reference to this object and go when
    :meth:`close` is called or it is garbage-collected."""

    def __init__(self, model: torch.nn.Module, gates: list[dict[str, torch.Tensor]], cache: object):
        self.model, self.gates = model, gates
        self._cache = weakref.ref(cache)
        self.latest: dict[int, torch.Tensor | None] = {}
        """Each layer's gate scores ``[B, Hkv, q]`` of the last pass through it (None: not computed,
        for a decode step whose entries the policy never evicts)."""
        me = weakref.ref(self)

        def receive(index: int, hidden: torch.Tensor, cache: Any) -> None:
            hooks = me()
            if hooks is not None and cache is not None and cache is hooks._cache():
                if not (cache.policy.evicts_in("decode") or cache.layers[index].continues_prompt(hidden.shape[1])):
                    hooks.latest[index] = None  # a decode step under a prefill-time policy: no score is ever read
                    return
                with torch.no_grad():
                    gate = {part: value.to(hidden.device) for part, value in hooks.gates[index].items()}
                    hooks.latest[index] = gate_scores(hidden, gate)

        self._finalizer = weakref.finalize(self, _remove, hook_attention_inputs(model, receive))

    def scores(self, layer_idx: int, rows: slice, num_new: int, device: torch.device) -> torch.Tensor:
        """The gate scores ``[b, Hkv, num_new]`` of the last ``num_new`` tokens of the pass, of ``rows``
        (on ``device``, the layer's, where the pass computed none)."""
        scores = self.latest[layer_idx]
        if scores is None:  # (never read: zeros, as the state of entries nothing scored)
            heads = self.gates[layer_idx]["sinks"].shape[0]
            return torch.zeros(rows.stop - rows.start, heads, num_new, device=device)
        return scores[rows, :, -num_new:]

    def close(self) -> None:
        self._finalizer()

    def __deepcopy__(self, memo: dict[int, Any]) -> GateHooks:
        """Hooks of its own for the copy of its cache (``copy.deepcopy`` of the cache maps it in ``memo``)."""
        cache = self._cache()
        twin = GateHooks(self.model, self.gates, memo.get(id(cache), cache))
        twin.latest = {index: None if scores is None else scores.clone() for index, scores in self.latest.items()}
        return twin


def _remove(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
