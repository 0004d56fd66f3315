import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

import kvevict
from kvevict.models import resolve_dtype, smollm2_gguf
from tests.conftest import CONFIGS, greedy, prompt, reference_logits, tiny_model


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "tova"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_every_supported_family_is_exact_and_matches_the_reference(arch: str, policy: str, attn: str) -> None:
    model = tiny_model(arch, attn=attn)
    ids = prompt(96)
    expected, expected_logits = greedy(model, ids, DynamicCache())
    sequences, logits = greedy(model, ids, kvevict.EvictionCache(model, policy, budget=200))
    assert torch.equal(sequences, expected) and torch.equal(logits, expected_logits)

    cache = kvevict.EvictionCache(model, policy, budget=40)
    sequences, _ = greedy(model, ids, cache, new_tokens=5)
    token = sequences[:, -1:]
    expected_next = reference_logits(model, cache, token)
    with torch.no_grad():
        next_logits = model(input_ids=token, past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(next_logits, expected_next, rtol=0, atol=1e-5)


def test_unsupported_architecture_is_refused_by_name() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(
        ValueError, match=r"unsupported model architecture 'gpt2' .*supports: llama, mistral, qwen2, qwen3"
    ):
        kvevict.EvictionCache(model, "h2o", budget=32)


def test_unknown_attention_kernel_is_refused() -> None:
    model = tiny_model()
    model.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(
        ValueError, match="attention implementation 'flex_attention' is not supported; kvevict wraps: sdpa"
    ):
        kvevict.EvictionCache(model, "h2o", budget=32)


@pytest.mark.parametrize(
    ("given", "expected"), [(None, torch.float32), ("bf16", torch.bfloat16), ("float16", torch.float16)]
)
def test_dtype_names(given, expected) -> None:
    assert resolve_dtype(given) is expected


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")


def test_embedded_smollm2_ships_in_the_wheel() -> None:
    assert smollm2_gguf().stat().st_size > 50_000_000


@pytest.mark.slow
def test_load_embedded_smollm2(smollm2) -> None:
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and tokenizer.chat_template
