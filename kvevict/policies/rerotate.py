"""Key re-rotation (``rerotate+<policy>``): after an eviction, the kept keys are rotated to
contiguous positions, as StreamingLLM's "positions within the cache" (Xiao et al., 2024, §3.2)
assigns them: a query then sees the kept keys at distances 1, 2, 3, … as if nothing between them
had been evicted, instead of at their original distances with gaps."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from kvevict.models import rotate_half
from kvevict.policies.base import Observer
from kvevict.signals import kept_after

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.policies.base import Assembly
    from kvevict.views import EntryView

ROTATIONS = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose angle grows linearly with the position (one fixed frequency per pair of
channels), so a rotation by ``δ`` moves a key from position ``p`` to ``p + δ`` exactly. ``dynamic``
and ``longrope`` change their frequencies with the sequence's length, and are refused."""


def shifts(positions: torch.Tensor, evicted: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
    """How far each kept entry moves, ``[B, H, n]`` int64: the number of evicted entries of its
    head at a later position. Keys held contiguously (every key after the first eviction is, and
    every one before) end contiguous, the last kept one where it was."""
    real = evicted if held is None else evicted & held
    order = positions.masked_fill(~held, -1).argsort(dim=-1) if held is not None else positions.argsort(dim=-1)
    in_order = real.gather(-1, order).long()
    later = in_order.flip(-1).cumsum(-1).flip(-1) - in_order  # evicted after each entry, in position order
    return torch.empty_like(later).scatter_(-1, order, later)


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``k·cos + rotate_half(k)·sin``, the rotation transformers' RoPE applies (fp32 math)."""
    k = keys.float()
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)


class Rerotate(Observer):
    """Rotates the kept keys to contiguous positions after every eviction (``rerotate+<policy>``).

    A kept key moves forward by the number of entries of its head evicted after it, ``δ``: its
    post-RoPE key is rotated by ``R(δ·θ)``, the model's own rotary frequencies for its layer (Gemma
    3's local and global layers have their own), normalised to a pure rotation (a scaled variant's
    attention factor stays as the model applied it). Queries keep their true positions, so after
    an eviction at ``seen`` tokens the ``m`` kept keys sit at ``seen − m … seen − 1``, and later
    keys follow at their true positions: distances are counted within the cache. Supported RoPE
    variants: :data:`ROTATIONS`; a model without RoPE, another variant, or a quantized cache (the
    keys would have to be re-quantized) is refused when the cache is built.
    """

    name = "rerotate"
    summary = "rotate the kept keys to contiguous positions after each eviction (StreamingLLM's cache positions)"
    batched = True
    rewrites_keys: ClassVar[bool] = True

    def check(self, policy: Assembly) -> None:
        if policy.method.deferred_prefill:
            raise ValueError(
                f"rerotate rotates keys as each layer evicts, and {policy.method.name} scores every layer's prompt "
                "after the prefill forward; put rerotate over a policy that evicts layer by layer"
            )

    def bind(self, config: PretrainedConfig) -> None:
        super().bind(config)
        parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        variants = {parameters.get("rope_type", "default")} if "rope_type" in parameters else set()
        variants |= {
            value.get("rope_type", "default") for value in parameters.values() if isinstance(value, dict)
        }  # per layer type (Gemma 3)
        unsupported = sorted(variants - set(ROTATIONS))
        if unsupported:
            raise ValueError(
                f"rerotate needs a RoPE whose angle grows linearly with the position ({', '.join(ROTATIONS)}); "
                f"this model's is {', '.join(unsupported)}"
            )
        if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rerotate rotates whole keys, and this model rotates only part of each head")

    def on_evict(self, layer: EntryView, evicted: torch.Tensor) -> None:
        kept = kept_after(evicted, layer.valid)
        moved = shifts(layer.positions, evicted, layer.valid).masked_fill(~kept, 0)
        where = moved.nonzero(as_tuple=True)  # only the keys before an evicted one move (a decode step: the sinks)
        if not where[0].numel():
            return
        steps, index = torch.unique(moved[where], return_inverse=True)
        cos, sin = layer.owner.rotary(steps, layer.layer_idx)
        scale = (cos * cos + sin * sin).sqrt()  # a scaled variant's attention factor: keep it out of δ's rotation
        keys = layer.keys
        cos, sin = (cos / scale)[index].to(keys.device), (sin / scale)[index].to(keys.device)
        keys[where] = rotate(keys[where], cos, sin)  # in place: the layer's own keys

    def on_evict_one(self, layer: EntryView, slots: torch.Tensor) -> None:
        evicted = torch.zeros_like(layer.positions, dtype=torch.bool)
        evicted.scatter_(-1, slots[..., None], True)
        self.on_evict(layer, evicted)
