"""Tiny randomly initialised decoders built from configs: fast, offline."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.models.llama.modeling_llama import repeat_kv

VOCAB = 96
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: 2 query heads per KV head
    "max_position_embeddings": 1024,
}
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=False),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),  # q/k norms
}


def tiny_model(
    arch: str = "llama", attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = VOCAB
) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    config.vocab_size = vocab
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()
    # Random init keeps attention nearly uniform; sharper logits make eviction matter.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def tiny_head_profile(seed: int = 0) -> dict[str, list[float]]:
    """A HeadKV profile for the tiny models: mild random importance per (layer, query head)."""
    generator = torch.Generator().manual_seed(seed)
    layers, heads = COMMON["num_hidden_layers"], COMMON["num_attention_heads"]
    scores = 0.5 + 0.5 * torch.rand(layers, heads, generator=generator)
    return {f"{layer}-{head}": [float(scores[layer, head])] for layer in range(layers) for head in range(heads)}


def build_policy(name: str, **params):
    """A registered policy by name, with what the tiny models need (HeadKV: a profile)."""
    import kvevict

    if "headkv" in name:
        params.setdefault("headkv", {"profile": tiny_head_profile()})
    return kvevict.make_policy(name, **params)


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator)


def greedy(model: PreTrainedModel, ids: torch.Tensor, cache=None, new_tokens: int = 8):
    """Greedy generation returning (sequences, per-step logits)."""
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


def reference_logits(model: PreTrainedModel, cache, token: torch.Tensor) -> torch.Tensor:
    """Next-token logits recomputed by the model over exactly the entries ``cache`` retained,
    held in a plain transformers DynamicCache, at the token's absolute position. Attention is
    written out by hand (plain softmax, the *masked reference*): each layer attends to its
    own entries, and where heads hold different numbers (``layer.valid``) each head's
    padding is masked."""
    reference = DynamicCache()
    for idx, layer in enumerate(cache.layers):
        reference.update(layer.keys.clone(), layer.values.clone(), idx)
    position = torch.tensor([[cache.get_seq_length()]])
    valid = {idx: getattr(layer, "valid", None) for idx, layer in enumerate(cache.layers)}
    original = model.config._attn_implementation
    _REFERENCE_VALID.clear()
    _REFERENCE_VALID.update(valid)
    model.set_attn_implementation(MASKED_REFERENCE)
    try:
        with torch.no_grad():
            return model(input_ids=token, position_ids=position, past_key_values=reference).logits[:, -1]
    finally:
        model.set_attn_implementation(original)


MASKED_REFERENCE = "kvevict_test_masked_reference"
_REFERENCE_VALID: dict[int, torch.Tensor | None] = {}


def _masked_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain softmax attention; the cached entries a head does not hold are masked out."""
    q, n, group = query.shape[-2], key.shape[-2], query.shape[1] // key.shape[1]
    logits = (query @ repeat_kv(key, group).transpose(-1, -2)).float() * scaling
    allowed = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
    valid = _REFERENCE_VALID.get(module.layer_idx)
    if valid is not None:
        held = torch.cat([valid, valid.new_ones(*valid.shape[:2], n - valid.shape[-1])], dim=-1)
        allowed = allowed & held.repeat_interleave(group, dim=1)[:, :, None, :]
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1).to(query.dtype)
    return (weights @ repeat_kv(value, group)).transpose(1, 2).contiguous(), weights


AttentionInterface.register(MASKED_REFERENCE, _masked_reference_attention)
AttentionMaskInterface.register(MASKED_REFERENCE, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@pytest.fixture(params=["sdpa", "eager"])
def attn(request) -> str:
    return request.param


def capture_passes(layer) -> list[dict]:
    """Record the query, scaling and (pre-eviction) keys of each pass through ``layer``."""
    passes: list[dict] = []
    original = layer.after_attention

    def spy(query, scaling, module=None):
        passes.append(
            {"query": query, "scaling": scaling, "keys": layer.keys.clone(), "positions": layer.positions.clone()}
        )
        original(query, scaling, module)

    layer.after_attention = spy
    return passes


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (loaded once per test session, offline)."""
    import kvevict

    return kvevict.load_model("smollm2")


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2 tokenizer alone (a few seconds, offline)."""
    from transformers import AutoTokenizer

    from kvevict.models import smollm2_gguf

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
