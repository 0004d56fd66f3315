"""Saving and loading a cache: a compressed document kept on disk, answered later.

Owns: the file format of :meth:`~kvevict.cache.EvictionCache.save` and
:meth:`~kvevict.cache.EvictionCache.load`. One safetensors file holds every layer's retained
entries (keys, values, positions, validity, per-token policy state), the hidden-state
recorder's series, and, in its metadata, what the cache needs to go on decoding exactly: the
model's identity (architecture, layers, KV heads, head dimension, dtype and a fingerprint of
its weights), the policy (name and parameters), the budget, each layer's and each row's
counters and the policy's per-layer and per-row data. A file that does not fit the model it
is loaded into, is truncated or corrupted, or has another format version is refused with a
one-line ``ValueError`` (an unreadable path: ``OSError``); nothing is silently mis-loaded.

Must not touch: how the cache evicts. It reads and writes the state the other modules own,
through the objects it is handed (it imports neither the cache nor the layer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as write_safetensors
from transformers import PreTrainedModel

from kvevict.rows import RowState, SequenceState

FORMAT = "kvevict-cache"
VERSION = 2
"""2: MomentKV's statistics hold the centred ``S̃`` (``MomentStats.centered``) instead of ``S``."""
LAYER_FIELDS = ("tokens", "passes", "prompt_pass", "prompt_open", "compacted", "_num_new")
ROW_FIELDS = ("start", "width", "peak", "decode_peak")


def model_identity(model: PreTrainedModel) -> dict[str, object]:
    """What a cache's entries are only valid for: the architecture, its shape, its dtype and a
    fingerprint of its weights (each parameter's name, shape, sum and a strided sample)."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            flat = parameter.detach().flatten()
            sample = flat[:: max(1, flat.numel() // 1024)].double().cpu()
            digest.update(f"{name}{tuple(parameter.shape)}{float(flat.double().sum()):.10e}".encode())
            digest.update(sample.numpy().tobytes())
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "kv_heads": heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "dtype": str(model.dtype).removeprefix("torch."),
        "weights": digest.hexdigest()[:32],
    }


class _Encoder:
    """Policy data (memo, shared) as JSON, with its tensors set aside under names."""

    def __init__(self, prefix: str, tensors: dict[str, torch.Tensor]):
        self.prefix, self.tensors = prefix, tensors

    def _tensor(self, x: torch.Tensor) -> str:
        name = f"{self.prefix}{len(self.tensors)}"
        self.tensors[name] = x.detach().cpu().contiguous().clone()
        return name

    def encode(self, value: Any) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, torch.Tensor):
            return {"tensor": self._tensor(value), "device": str(value.device)}
        if isinstance(value, torch.device):
            return {"torch_device": str(value)}
        if isinstance(value, list | tuple):
            return {"list" if isinstance(value, list) else "tuple": [self.encode(x) for x in value]}
        if isinstance(value, dict):
            return {"dict": [[self.encode(key), self.encode(item)] for key, item in value.items()]}
        if dataclasses.is_dataclass(value) and type(value).__module__.startswith("kvevict."):
            fields = {field.name: self.encode(getattr(value, field.name)) for field in dataclasses.fields(value)}
            return {"dataclass": f"{type(value).__module__}:{type(value).__qualname__}", "fields": fields}
        raise ValueError(
            f"cannot save policy data of type {type(value).__name__}: kvevict does not know how to store it"
        )


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        return tensors[value["tensor"]].to(value["device"])
    if "torch_device" in value:
        return torch.device(value["torch_device"])
    if "list" in value:
        return [_decode(x, tensors) for x in value["list"]]
    if "tuple" in value:
        return tuple(_decode(x, tensors) for x in value["tuple"])
    if "dict" in value:
        return {_decode(key, tensors): _decode(item, tensors) for key, item in value["dict"]}
    module, _, qualname = value["dataclass"].partition(":")
    if not module.startswith("kvevict."):
        raise ValueError(f"refusing to load policy data of type {value['dataclass']!r}: not kvevict's")
    kind = importlib.import_module(module)
    for part in qualname.split("."):
        kind = getattr(kind, part)
    return kind(**{name: _decode(field, tensors) for name, field in value["fields"].items()})


def save_file(cache: Any, path: str | Path, model: PreTrainedModel) -> Path:
    """Write ``cache`` (its prompt done, no pass under way) to ``path`` (see the module docstring)."""
    layers = cache.eviction_layers
    if not layers or not all(layer.is_initialized for layer in layers):
        raise ValueError("cannot save an empty cache: prefill a sequence into it first")
    if cache.deferred or any(layer.pending_pass or layer.pending_eviction for layer in layers):
        raise ValueError("cannot save a cache in the middle of a pass: save it between passes")
    tensors: dict[str, torch.Tensor] = {}
    encoder = _Encoder("data.", tensors)
    layer_meta = []
    for i, layer in enumerate(layers):
        n, packed, quantized = layer.n, layer.storage.packed, layer.storage.quantized
        if packed is not None and layer.storage.pruned is None:  # heads or rows of different lengths: the real
            entries = {"valid": packed.held}  # entries only, as held (keys with pruned channels: padded, below)
            entries.update({_entry_name(name, layer.state): x for name, x in packed.real().items()})
        elif quantized is not None:  # codes, scales and zero points as held (encoded below), the rest dense
            entries = {f"state.{name}": value for name, value in layer.state.items()}
            if layer.valid is not None:
                entries["valid"] = layer.valid
            entries = {name: x.narrow(2, 0, n) for name, x in entries.items()}
        else:
            entries = {"keys": layer.keys, "values": layer.values, "positions": layer.positions}
            entries.update({f"state.{name}": value for name, value in layer.state.items()})
            if layer.valid is not None:
                entries["valid"] = layer.valid
            entries = {name: x.narrow(2, 0, n) for name, x in entries.items()}
        for name, x in entries.items():
            tensors[f"layer.{i}.{name}"] = x.detach().cpu().contiguous().clone()
        layer_meta.append(
            {
                **{field: getattr(layer, field) for field in LAYER_FIELDS},
                "n": n,
                "packed": packed is not None and layer.storage.pruned is None,
                "quantized": None if quantized is None else encoder.encode(quantized),
                "state": list(layer.state),
                "rows": [
                    {
                        **{field: getattr(row, field) for field in ROW_FIELDS},
                        "memo": encoder.encode(row.memo),
                        "channels": encoder.encode(row.channels),
                        "pruned_at": row.pruned_at,
                    }
                    for row in layer.rows
                ],
            }
        )
    hidden = cache.hidden
    if hidden is not None:
        tensors.update(hidden.state_tensors())
    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "model": json.dumps(model_identity(model)),
        "source": json.dumps(cache.source),
        "policy": json.dumps({"name": cache.policy.name, "params": cache.policy.params()}),
        "budget": json.dumps(
            {
                "budget": cache.budget.tokens,
                "keep": cache.budget.keep,
                "interval": cache.interval,
                "prompt_length": cache.prompt_length,
                "quant": {} if cache.quant is None else cache.quant.options(),
            }
        ),
        "cache": json.dumps(
            {
                "sequences": [
                    {name: getattr(sequence, name) for name in SequenceState.__slots__} for sequence in cache.sequences
                ],
                "appended_pass": cache.appended_pass,
                "begun_pass": cache.begun_pass,
                "row_offsets": cache.row_offsets,
                "shared": encoder.encode({row: cache.row_shared(row) for row in range(len(cache.sequences))}),
                "hidden": None if hidden is None else hidden.state_lengths(),
            }
        ),
        "layers": json.dumps(layer_meta),
    }
    path = Path(path)
    write_safetensors(tensors, str(path), metadata=metadata)
    return path


def read_file(path: str | Path, tensors: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors (none unless ``tensors``) of a saved cache, checked for format and version."""
    path = Path(path)
    if not path.is_file():
        raise OSError(f"cannot read a saved cache at {str(path)!r}: no such file")
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            names = file.keys() if tensors else []
            held = {name: file.get_tensor(name) for name in names}
    except (SafetensorError, RuntimeError, ValueError) as error:
        raise ValueError(f"{path} is not a readable kvevict cache (truncated or corrupted): {error}") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a kvevict cache (format {metadata.get('format')!r})")
    if metadata.get("version") != str(VERSION):
        raise ValueError(
            f"{path} has kvevict cache format version {metadata.get('version')!r}; this kvevict reads version {VERSION}"
        )
    return metadata, held


def check_model(metadata: dict[str, str], model: PreTrainedModel, path: str | Path) -> None:
    """Refuse a file saved from another model (its identity names what differs)."""
    saved, mine = json.loads(metadata["model"]), model_identity(model)
    differ = [
        f"{key} {saved.get(key)!r} in the file, {value!r} here"
        for key, value in mine.items()
        if saved.get(key) != value
    ]
    if differ:
        raise ValueError(f"{path} was saved from another model: {'; '.join(differ)}")


def restore(
    cache: Any, metadata: dict[str, str], tensors: dict[str, torch.Tensor], path: str | Path, device: torch.device
) -> None:
    """Fill ``cache`` (built for the file's model and policy) with what the file holds, on ``device``."""
    try:
        _restore(cache, metadata, tensors, device)
    except (KeyError, IndexError, TypeError, RuntimeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is inconsistent (corrupted?): {type(error).__name__}: {error}") from None


def _restore(cache: Any, metadata: dict[str, str], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    state, layer_meta = json.loads(metadata["cache"]), json.loads(metadata["layers"])
    layers = cache.eviction_layers
    if len(layer_meta) != len(layers):
        raise IndexError(f"{len(layer_meta)} layers saved, the model has {len(layers)}")
    cache.sequences = []
    for saved in state["sequences"]:
        sequence = SequenceState()
        for name, value in saved.items():
            setattr(sequence, name, value)
        cache.sequences.append(sequence)
    cache.appended_pass, cache.begun_pass = state["appended_pass"], state["begun_pass"]
    cache.row_offsets = state["row_offsets"]
    for i, (layer, meta) in enumerate(zip(layers, layer_meta)):
        if meta.get("packed"):
            _spread_packed(tensors, f"layer.{i}.", meta["state"])
        n, quantized = meta["n"], _decode(meta.get("quantized"), tensors)
        if quantized is not None:  # the codes as saved: the layer's pass end keeps them (storage.previous below)
            for name, x in zip(
                ("keys", "values", "positions"), (*quantized.restore(n), quantized.positions.restore(n))
            ):
                tensors[f"layer.{i}.{name}"] = x
        keys = tensors[f"layer.{i}.keys"].to(device)
        layer.lazy_initialization(keys, tensors[f"layer.{i}.values"].to(device))
        if keys.shape[2] != n or keys.shape[0] != len(cache.sequences):
            raise IndexError(f"layer {i} holds keys of shape {tuple(keys.shape)}, its record says {n} entries")
        room = n + max(sequence.interval for sequence in cache.sequences)
        storage = layer.storage
        storage.reserve(0, room)
        storage.keys[:, :, :n] = keys
        storage.values[:, :, :n] = tensors[f"layer.{i}.values"].to(device)
        storage.positions[:, :, :n] = tensors[f"layer.{i}.positions"].to(device)
        for name in meta["state"]:
            value = tensors[f"layer.{i}.state.{name}"].to(device)
            storage.add_state(name, value)[:, :, :n] = value
        if f"layer.{i}.valid" in tensors:
            storage.set_valid(tensors[f"layer.{i}.valid"].to(device))
        for field in LAYER_FIELDS:
            setattr(layer, field, meta[field])
        layer.rows = []
        for sequence, saved in zip(cache.sequences, meta["rows"], strict=True):
            row = RowState(sequence)
            for field in ROW_FIELDS:
                setattr(row, field, saved[field])
            row.memo = _decode(saved["memo"], tensors)
            row.channels = _decode(saved.get("channels"), tensors)  # (ThinK: the layer's pass end prunes them again)
            row.pruned_at = saved.get("pruned_at", 0)
            layer.rows.append(row)
        layer.refresh(n)
        if quantized is not None:
            storage.previous = quantized.reusable(None if storage.valid is None else storage.valid.narrow(2, 0, n))
        layer.end_pass()  # as at the end of a pass
    shared = _decode(state["shared"], tensors)
    for row, data in shared.items():
        cache.row_shared(row).update(data)
    if cache.hidden is not None:
        if state["hidden"] is None:
            raise KeyError("hidden-state statistics (the policy reads them, the file has none)")
        cache.hidden.load_state(state["hidden"], tensors, device)


def _entry_name(name: str, state: dict[str, torch.Tensor]) -> str:
    return f"state.{name}" if name in state else name


def _spread_packed(tensors: dict[str, torch.Tensor], prefix: str, state: list[str]) -> None:
    """A packed layer's entries (the real ones, listed in storage order) back in the padded
    layout ``[B, Hkv, n, ...]`` the file's other layers use; free slots hold zeros at position -1
    (masked out by ``valid``, given their past positions when the layer is next unpacked)."""
    held = tensors[f"{prefix}valid"]
    for name in ("keys", "values", "positions", *(f"state.{entry}" for entry in state)):
        real = tensors[f"{prefix}{name}"]
        dense = real.new_full((*held.shape, *real.shape[1:]), -1 if name == "positions" else 0)
        dense[held] = real
        tensors[f"{prefix}{name}"] = dense


def policy_of(metadata: dict[str, str]) -> tuple[str, dict[str, object], dict[str, object]]:
    """The saved policy's name and parameters, and the budget arguments of the cache."""
    policy, budget = json.loads(metadata["policy"]), json.loads(metadata["budget"])
    return policy["name"], policy["params"], budget


def source_of(metadata: dict[str, str]) -> str | None:
    """What the saved cache's model was loaded from (``kvevict.load_model``'s argument), if known."""
    return json.loads(metadata.get("source", "null"))
