import copy

import pytest
import torch

import kvevict
from kvevict.bench.ruler import TASKS
from kvevict.generation import split_prompt


@pytest.mark.slow
def test_split_prompt_puts_the_context_before_the_rest(smollm2) -> None:
    _, tokenizer = smollm2
    head, tail = split_prompt(tokenizer, "The sky is green today.", "What color is the sky?", "The sky is")
    assert tokenizer.decode(head[0]).endswith("The sky is green today.")
    assert tokenizer.decode(head[0]).startswith("<|im_start|>")
    rest = tokenizer.decode(tail[0])
    assert "What color is the sky?" in rest and rest.endswith("assistant\nThe sky is")


@pytest.mark.slow
@pytest.mark.parametrize(("query_aware", "compressed"), [(False, "context"), (True, "everything")])
def test_answer_compresses_the_context_or_the_whole_prompt(smollm2, query_aware: bool, compressed: str) -> None:
    model, tokenizer = smollm2
    sample = TASKS["niah_single_2"].samples(tokenizer, length=400, count=1, seed=3)[0]
    head, tail = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    cache = kvevict.EvictionCache(model, "snapkv", budget=128)
    text = kvevict.answer(
        model,
        tokenizer,
        sample.context,
        sample.question,
        answer_prefix=sample.answer_prefix,
        query_aware=query_aware,
        max_new_tokens=4,
        cache=cache,
    )
    assert text
    layer = cache.layers[0]
    assert layer.prompt_length == head.shape[-1] + (tail.shape[-1] - 1 if compressed == "everything" else 0)
    retained_after_prefill = 128 + (1 if query_aware else tail.shape[-1])
    assert layer.length == retained_after_prefill + 3  # then grows while decoding (prefill policy)


@pytest.mark.slow
def test_full_cache_finds_the_needle(smollm2) -> None:
    model, tokenizer = smollm2
    sample = TASKS["niah_single_2"].samples(tokenizer, length=600, count=1, seed=1)[0]
    text = kvevict.answer(
        model, tokenizer, sample.context, sample.question, answer_prefix=sample.answer_prefix, max_new_tokens=12
    )
    assert sample.answers[0] in text


@pytest.mark.slow
def test_decode_time_policy_holds_the_budget_while_answering(smollm2) -> None:
    model, tokenizer = smollm2
    sample = TASKS["niah_single_2"].samples(tokenizer, length=600, count=1, seed=1)[0]
    cache = kvevict.EvictionCache(model, "h2o", budget=96)
    kvevict.answer(
        model,
        tokenizer,
        sample.context,
        sample.question,
        answer_prefix=sample.answer_prefix,
        max_new_tokens=6,
        cache=cache,
    )
    assert set(cache.layer_lengths()) == {96}
    # layers × (K, V) × KV heads × budget × head_dim × fp32
    assert cache.retained_bytes() == 30 * 2 * 3 * 96 * 64 * 4
    capacities = [layer.storage.capacity for layer in cache.eviction_layers]
    assert all(96 <= capacity <= 97 for capacity in capacities)  # the budget and one column of room
    assert cache.kv_bytes() == sum(capacities) * 3 * (2 * 64 * 4 + 8 + 4)  # + int64 position, H2O's fp32 state
    assert torch.isfinite(cache.layers[0].keys).all()


def test_cache_and_policy_arguments_are_exclusive() -> None:
    from tests.conftest import tiny_model

    model = tiny_model()
    with pytest.raises(ValueError, match="either cache= or policy="):
        kvevict.answer(model, None, "context", cache=kvevict.EvictionCache(model, "h2o", budget=64), budget=32)


def test_a_bare_prompt_without_chat_template_is_compressed_once(tokenizer) -> None:
    """A base model's tokenizer has no chat template: the prompt is the context alone, so all
    but its last token is compressed and that token starts decoding (never fed twice)."""
    from tests.conftest import tiny_model

    base = copy.copy(tokenizer)
    base.chat_template = None
    model = tiny_model(vocab=len(tokenizer))
    text = "The quick brown fox jumps over the lazy dog. " * 8
    length = base(text, return_tensors="pt").input_ids.shape[-1]
    cache = kvevict.EvictionCache(model, "snapkv", budget=40)
    kvevict.answer(model, base, text, cache=cache, max_new_tokens=3)
    assert cache.get_seq_length() == length + 2
    assert cache.layers[0].prompt_length == length - 1 and cache.layer_lengths() == [40 + 3, 40 + 3]


@pytest.mark.parametrize("query_aware", [False, True])
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "streamingllm"])
def test_lists_are_answered_as_one_batch_each_as_alone(tokenizer, policy: str, query_aware: bool) -> None:
    from tests.conftest import tiny_model

    model = tiny_model(vocab=len(tokenizer))
    contexts = [
        "The quick brown fox jumps over the lazy dog. " * 9,
        "Rain fell on the old town all night long. " * 5,
        "Seven ships sailed north past the lighthouse. " * 7,
    ]
    questions = ["Who jumps?", "What fell on the town during the long night?", "Where?"]
    options = {"policy": policy, "budget": 48, "query_aware": query_aware, "max_new_tokens": 5}
    cache = kvevict.EvictionCache(model, policy, budget=48)
    options_cache = {key: value for key, value in options.items() if key not in ("policy", "budget")}
    replies = kvevict.answer(model, tokenizer, contexts, questions, cache=cache, **options_cache)
    assert cache.layers[0].batch_size == 3  # one batch
    assert replies == [kvevict.answer(model, tokenizer, c, q, **options) for c, q in zip(contexts, questions)]
    one_question = kvevict.answer(model, tokenizer, contexts, questions[0], **options)
    assert one_question == [kvevict.answer(model, tokenizer, c, questions[0], **options) for c in contexts]


def test_lists_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="as many contexts as questions.*got 2 and 3"):
        kvevict.answer(None, None, ["a", "b"], ["x", "y", "z"])


def test_answer_builds_quantized_storage_with_its_group_and_residual(tokenizer) -> None:
    from tests.conftest import tiny_model

    model = tiny_model(vocab=len(tokenizer))
    context = "The quick brown fox jumps over the lazy dog. " * 9
    options = {"policy": "snapkv", "budget": 40, "quant": "int4", "quant_group": 8, "residual": 16}
    cache = kvevict.EvictionCache(model, "snapkv", budget=40, quant="int4", quant_group=8, residual=16)
    reply = kvevict.answer(model, tokenizer, context, "Who jumps?", cache=cache, max_new_tokens=4)
    assert kvevict.answer(model, tokenizer, context, "Who jumps?", max_new_tokens=4, **options) == reply
    with pytest.raises(ValueError, match="either cache= or .*residual="):
        kvevict.answer(model, tokenizer, context, "Who?", cache=cache, residual=16)
