import json

import torch

import kvevict
from kvevict.headroles import MIXED, Recipe, _Training, passkey_sample, save_gates, streaming_mask, train_gates
from tests.conftest import prompt, tiny_model


def test_the_streaming_mask_keeps_the_sinks_and_the_recent_window() -> None:
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert streaming_mask(causal, sinks=1, recent=2).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 1, 1, 0],
        [1, 0, 0, 1, 1],
    ]
    # two queries after three cached keys: the last rows of the same pattern
    assert torch.equal(streaming_mask(causal[3:], 1, 2), streaming_mask(causal, 1, 2)[3:])


def hidden_states(model, ids: torch.Tensor, attention: str) -> torch.Tensor:
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        with torch.no_grad():
            return model.model(input_ids=ids).last_hidden_state
    finally:
        model.set_attn_implementation(previous)


def test_gates_at_one_give_full_attention_and_at_zero_streaming_attention() -> None:
    model, ids = tiny_model(), prompt(48)
    _Training.sinks, _Training.recent = 4, 8
    try:
        _Training.gates = torch.ones(2, 2)
        torch.testing.assert_close(
            hidden_states(model, ids, MIXED), hidden_states(model, ids, "sdpa"), rtol=0, atol=1e-5
        )
        _Training.gates = torch.zeros(2, 2)
        streaming = hidden_states(model, ids, MIXED)
    finally:
        _Training.gates = None
    # streaming attention: the model run with the streaming pattern as its attention mask
    pattern = streaming_mask(torch.ones(48, 48, dtype=torch.bool).tril(), 4, 8)
    with torch.no_grad():
        expected = model.model(input_ids=ids, attention_mask=pattern[None, None]).last_hidden_state
    torch.testing.assert_close(streaming, expected, rtol=0, atol=1e-5)


def test_a_passkey_context_has_the_recipe_s_length_and_ends_with_its_answer(tokenizer) -> None:
    import random

    recipe = Recipe(length=200, passkeys=2, passkey_words=3)
    haystack = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False)
    ids, answer = passkey_sample(tokenizer, haystack, ["alpha", "bravo", "charlie"], recipe, random.Random(0))
    assert len(ids) == 200
    text = tokenizer.decode(ids[-answer:])
    assert text.startswith("Passkey 1 is:") and "Passkey 2 is:" in text
    first = text.split("Passkey 1 is: ")[1].split(".")[0]
    assert f"Passkey 1 is: {first}. Remember it." in tokenizer.decode(ids[:-answer])


def test_training_is_deterministic_and_the_penalty_closes_gates(tokenizer, tmp_path) -> None:
    torch.set_num_threads(1)
    model = tiny_model(vocab=len(tokenizer))
    recipe = Recipe(sinks=2, recent=8, length=64, passkeys=1, passkey_words=2, steps=4, lr=0.1, penalty=1.0)
    text = "A haystack of plain words, repeated to fill the contexts, about nothing much at all. " * 40
    gates = train_gates(model, tokenizer, text, recipe)
    assert torch.equal(gates, train_gates(model, tokenizer, text, recipe))
    assert gates.shape == (2, 2) and float(gates.max()) < 1 and float(gates.min()) >= 0
    assert model.config._attn_implementation == "sdpa" and not any(p.requires_grad for p in model.parameters())
    path = tmp_path / "roles.json"
    save_gates(path, model.config, gates, recipe, "a repeated sentence")
    assert json.loads(path.read_text())["recipe"]["recent"] == 8
    cache = kvevict.EvictionCache(model, f"duoattention[roles={path},sinks=2]", budget=10)
    with torch.no_grad():
        model(input_ids=prompt(30), past_key_values=cache)
    assert sorted(
        cache.eviction_layers[0].head_lengths()[0].tolist() + cache.eviction_layers[1].head_lengths()[0].tolist()
    ) == [10, 10, 30, 30]
