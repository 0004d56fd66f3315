"""KVzip: hand-computed reconstruction scores, the repeat pass against the model's own
attention, and a repeat pass that leaves no trace in the cache."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import kvevict
from kvevict.policies.kvzip import (
    attend_and_score,
    causal_attention,
    reconstruction_scores,
    repeat_chunks,
    sentence_ends,
    shuffled_sentences,
)
from kvevict.signals import causal_mask
from tests.conftest import (
    assert_next_logits_match_reference,
    greedy,
    kept_positions,
    left_padded,
    padded_positions,
    prompt,
    tiny_model,
)


def test_score_is_the_max_over_repeat_queries_and_the_group_of_the_probability() -> None:
    # context k0 = [0, 0], k1 = [1, 0]; two repeat entries at [0, 0]; scaling 1
    keys = torch.tensor([[[[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]]])
    # head 0: row 0 q = [ln 3, 0] sees k0..k2 → [1/5, 3/5, 1/5]; row 1 q = 0 → 1/4 each
    # head 1: row 0 q = 0 → 1/3 each; row 1 → 1/4 each
    query = torch.tensor([[[[math.log(3.0), 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]]])
    scores = reconstruction_scores(query, keys, 1.0, context=2)
    torch.testing.assert_close(scores, torch.tensor([[[1 / 3, 3 / 5]]]))
    one_at_a_time = reconstruction_scores(query, keys, 1.0, context=2, chunk=1)
    torch.testing.assert_close(one_at_a_time, scores)
    # KVzip+: weights per (query head, entry) and per repeat query multiply before the max
    weighted = reconstruction_scores(
        query,
        keys,
        1.0,
        context=2,
        value_weights=torch.tensor([[[1.0, 1.0], [3.0, 1.0]]]),
        query_weights=torch.tensor([[1.0, 2.0]]),
    )
    # entry 0: max(1/5, 2/4, 3/3, 3·2/4) = 1.5; entry 1: max(3/5, 2/4, 1/3, 2/4) = 0.6
    torch.testing.assert_close(weighted, torch.tensor([[[1.5, 0.6]]]))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk", [256, 5])
def test_one_pass_attends_as_the_kernel_and_scores_as_reconstruction_scores(weighted: bool, chunk: int) -> None:
    # 6 query heads over 2 KV heads, 11 context entries then 13 repeat entries (causal among themselves)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 13, 8, generator=generator) * 2
    keys, values = torch.randn(2, 1, 2, 24, 8, generator=generator)
    weights = {}
    if weighted:
        weights = {"value_weights": torch.rand(1, 6, 11, generator=generator), "query_weights": torch.rand(1, 13)}
    output, scores = attend_and_score(query, keys, values, 0.3, 11, chunk=chunk, **weights)
    mask = causal_mask(13, 24, query.device)
    kernel = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(output, kernel.transpose(1, 2))
    torch.testing.assert_close(scores, reconstruction_scores(query, keys, 0.3, 11, **weights))


def test_bf16_products_round_the_logits_as_a_bf16_product_and_score_in_fp32() -> None:
    """precision=bf16: each logit is the bf16 product of the bf16 query and key (the exact fp32 sum of
    their products, rounded once to bf16); the softmax and the max over queries are fp32. Both scoring
    paths agree, and the scores are not fp32's."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 6, 13, 8, generator=generator) * 2
    keys, values = torch.randn(2, 1, 2, 24, 8, generator=generator)
    scaling = 0.25  # a power of two: scaling the query or the logits rounds alike
    bf16 = torch.bfloat16
    exact = query.to(bf16).double() @ keys.to(bf16).double().repeat_interleave(3, 1).transpose(-1, -2)
    logits = (exact.to(bf16).float() * scaling).masked_fill(~causal_mask(13, 24, query.device), float("-inf"))
    expected = logits.softmax(dim=-1)[..., :11].amax(dim=2).view(1, 2, 3, 11).amax(dim=2)
    scores = reconstruction_scores(query, keys, scaling, 11, products=bf16)
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-7)
    output, fused = attend_and_score(query, keys, values, scaling, 11, products=bf16)
    torch.testing.assert_close(fused, scores, rtol=2e-2, atol=1e-4)  # the causal block: the kernel's bf16 path
    assert output.dtype == torch.float32
    assert not torch.allclose(scores, reconstruction_scores(query, keys, scaling, 11), rtol=1e-4, atol=0)


def test_precision_bf16_repeats_in_bf16_and_keeps_the_prefill_entries_as_they_were() -> None:
    """The repeat pass's projections run in bf16 (autocast), the prefill's in fp32; what the cache
    keeps are the prefill's fp32 entries, and the next token attends over exactly them."""
    model = tiny_model()
    seen: list[torch.dtype] = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    cache = kvevict.EvictionCache(model, kvevict.make_policy("kvzip", precision="bf16"), budget=40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer for the tiny model
        sequences, _ = greedy(model, prompt(96), cache, new_tokens=3)
    hook.remove()
    assert seen[:2] == [torch.float32, torch.bfloat16]  # the prefill, then the repeat
    assert set(seen[2:]) == {torch.float32}  # decoding is the model's own
    full = kvevict.EvictionCache(model, "full")
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=full)
    for kept, whole in zip(cache.eviction_layers, full.eviction_layers):
        held = kept.positions < 96  # the prompt's entries (the decoded ones follow)
        if kept.valid is not None:
            held &= kept.valid
        slots = kept.positions.clamp(max=95).long()[..., None].expand(*kept.positions.shape, kept.keys.shape[-1])
        assert torch.equal(kept.keys[held], whole.keys.gather(2, slots)[held])  # fp32, as prefilled
        assert int(held.sum()) < 2 * 96
    assert_next_logits_match_reference(model, cache, sequences[:, -1:])


def test_precision_bf16_warns_where_bf16_is_not_multiplied_in_hardware(monkeypatch) -> None:
    monkeypatch.setattr("kvevict.policies.kvzip.multiplies_bf16_natively", lambda device: False)
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("kvzip", precision="bf16"), budget=40)
    with pytest.warns(UserWarning, match="does not multiply bf16 in hardware"), torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)


@pytest.mark.parametrize("native", [True, False])
def test_precision_auto_is_bf16_where_bf16_is_multiplied_in_hardware_and_fp32_elsewhere(monkeypatch, native) -> None:
    monkeypatch.setattr("kvevict.policies.kvzip.multiplies_bf16_natively", lambda device: native)
    policy = kvevict.make_policy("kvzip")
    assert policy.method.precision == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto never warns: it picks fp32 where bf16 would be slow
        assert policy.method.products(torch.device("cpu")) == (torch.bfloat16 if native else None)
    assert kvevict.make_policy("kvzip", precision="fp32").method.products(torch.device("cpu")) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid"])
def test_a_bf16_batch_scores_each_row_as_its_prompt_alone_and_leaves_no_hooks_behind(arch: str) -> None:
    """Each row of a left-padded batch is prefilled again alone and repeated in a cache of its own:
    its scores are bit for bit the lone prompt's, so it keeps exactly the lone prompt's entries (repeated
    as one padded batch instead, rows 0 and 1 keep other near-tied entries here). With sliding layers
    (qwen2 hybrid) the row's own cache holds what left the window until the eviction, as alone."""
    model = tiny_model(arch)
    prompts = [prompt(length, seed=seed) for seed, length in enumerate((60, 90, 75))]
    ids, mask = left_padded(prompts)
    hooks = len(model.model._forward_hooks), len(model.model._forward_pre_hooks)
    batch = kvevict.EvictionCache(model, kvevict.make_policy("kvzip", precision="bf16"), budget=24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer for the tiny model
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=padded_positions(mask), past_key_values=batch)
        for row, alone_ids in enumerate(prompts):
            alone = kvevict.EvictionCache(model, kvevict.make_policy("kvzip", precision="bf16"), budget=24)
            with torch.no_grad():
                model(input_ids=alone_ids, past_key_values=alone)
            assert kept_positions(batch, row) == kept_positions(alone)
            alone.close()
    batch.close()
    assert (len(model.model._forward_hooks), len(model.model._forward_pre_hooks)) == hooks


def test_causal_attention_returns_each_querys_log_sum_exp() -> None:
    generator = torch.Generator().manual_seed(1)
    query, keys, values = torch.randn(3, 1, 4, 7, 8, generator=generator)
    output, lse = causal_attention(query, keys[:, :2], values[:, :2], 0.5)
    expanded = keys[:, :2].repeat_interleave(2, 1), values[:, :2].repeat_interleave(2, 1)
    logits = (query @ expanded[0].transpose(-1, -2) * 0.5).masked_fill(~causal_mask(7, 7, query.device), -math.inf)
    torch.testing.assert_close(lse, logits.logsumexp(-1))
    torch.testing.assert_close(output, logits.softmax(-1) @ expanded[1])


def test_repeat_chunks_restart_from_the_end_of_the_previous_chunk() -> None:
    context = torch.tensor([[10, 11, 12, 13, 14]])
    first, later, suffix = torch.tensor([[1]]), torch.tensor([[2]]), torch.tensor([[3]])
    chunks = repeat_chunks(context, first, later, suffix, chunk=2, overlap=1)
    assert [c.tolist()[0] for c in chunks] == [[1, 3, 10, 11], [2, 11, 3, 12, 13], [2, 13, 3, 14]]


def kept_by_reconstruction(probs: torch.Tensor, budget: int) -> torch.Tensor:
    """The positions ``[1, 2, budget]`` (sorted) each KV head of a tiny model keeps under a per-head budget, from
    its repeat queries' probabilities over the context ``[1, 4, r, n]``: the 4 sinks, then the top of the max over
    the queries and the GQA group of 2."""
    scores = probs.amax(dim=2).reshape(1, 2, 2, probs.shape[-1]).amax(dim=2)
    scores[..., :4] = float("inf")  # sinks
    return scores.topk(budget, dim=-1).indices.sort(dim=-1).values


@pytest.mark.parametrize("plus", [False, True])
def test_scores_match_the_models_attention_while_it_repeats_the_context(plus: bool) -> None:
    """Per-layer budgets: each head keeps its sinks and the top reconstruction scores, taken
    here from the eager attention weights of one plain forward over context + repeat."""
    model = tiny_model(attn="eager")
    ids, budget, n = prompt(48), 20, 48
    cache = kvevict.EvictionCache(model, kvevict.make_policy("kvzip", per_layer=True, plus=plus), budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer for the tiny model: the bare context is repeated
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
    inputs = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, k, i=i: inputs.update({i: a[0]}), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        out = model(input_ids=torch.cat([ids, ids], dim=-1), output_attentions=True)
    for hook in hooks:
        hook.remove()
    for idx, layer in enumerate(cache.eviction_layers):
        probs = out.attentions[idx][:, :, n:, :n].float()  # repeat queries over context entries
        if plus:
            full = kvevict.EvictionCache(model, "full")
            with torch.no_grad():
                model(input_ids=ids, past_key_values=full)
            values = full.layers[idx].values.repeat_interleave(2, dim=1)  # [1, Hq, n, d]
            o_proj = model.model.layers[idx].self_attn.o_proj.weight
            norms = torch.stack([values[:, h] @ o_proj[:, h * 16 : (h + 1) * 16].T for h in range(4)], 1).norm(dim=-1)
            probs = probs * norms[:, :, None, :] / inputs[idx][:, n:].norm(dim=-1)[:, None, :, None]
        expected = kept_by_reconstruction(probs, budget)
        assert torch.equal(layer.positions.sort(dim=-1).values, expected)  # slots are not in position order


def test_a_sliding_layer_scores_what_its_repeat_queries_see_through_the_window() -> None:
    """A sliding layer's repeat queries see only the entries inside their window, so an entry's score is
    the max of the probabilities the model gives it there (taken from the eager attention of one plain
    forward over context + repeat), not of probabilities over every entry the layer holds."""
    model = tiny_model("gemma3", attn="eager")  # a sliding layer of window 48, then a full layer
    n, budget = 40, 12  # every context entry is inside the window of the first few repeat queries
    ids = prompt(n)
    policy = kvevict.make_policy("kvzip", per_layer=True, precision="fp32")  # bf16 would round the probabilities
    cache = kvevict.EvictionCache(model, policy, budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer for the tiny model: the bare context is repeated
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
            out = model(input_ids=torch.cat([ids, ids], dim=-1), output_attentions=True)
    for idx, layer in enumerate(cache.eviction_layers):
        probs = out.attentions[idx][:, :, n:, :n].float()  # repeat queries over context entries
        expected = kept_by_reconstruction(probs, budget)
        assert torch.equal(layer.positions.sort(dim=-1).values, expected), f"layer {idx}"


def test_a_layer_the_repeat_pass_grew_but_kvzip_does_not_evict_gives_the_room_back() -> None:
    model = tiny_model("gemma3")  # a sliding layer of window 48, then a full layer
    cache = kvevict.EvictionCache(model, kvevict.make_policy("kvzip", per_layer=True), budget=56)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(prompt(160), past_key_values=cache, use_cache=True)
    assert cache.layer_lengths() == [47, 56]  # the sliding layer holds its window, within the budget: not evicted
    for allocated, real in cache.layer_bytes():
        assert allocated < 1.25 * real  # not the repeat's 160 + instruction entries (4.8x before)


def test_the_repeat_pass_leaves_no_trace() -> None:
    model = tiny_model()
    ids = prompt(96)
    cache = kvevict.EvictionCache(model, "kvzip", keep=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sequences, _ = greedy(model, ids, cache, new_tokens=5)
    assert cache.get_seq_length() == 96 + 4  # the context and the generated tokens only
    held = 0
    for layer in cache.eviction_layers:
        assert layer.passes == 5 and layer.prompt_length == 96
        real = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        assert layer.positions[real].max() == 99  # the decode tokens came right after the context
        assert int((real & (layer.positions >= 96)).sum()) == 2 * 4  # each head: its 4 decode tokens
        held += int((real & (layer.positions < 96)).sum())
    assert held == 2 * 2 * 24  # one global pool of context entries: L·H·B
    token = sequences[:, -1:]
    assert_next_logits_match_reference(model, cache, token)


def test_long_contexts_are_repeated_in_chunks_with_the_same_result_when_one_chunk_covers_them() -> None:
    model = tiny_model()
    ids = prompt(96)
    kept = []
    for chunk in (2048, 40):
        cache = kvevict.EvictionCache(model, kvevict.make_policy("kvzip", chunk=chunk, overlap=4), budget=30)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache)
        assert cache.get_seq_length() == 96
        kept.append([layer.positions.clone() for layer in cache.eviction_layers])
    # three chunks score differently (fewer repeat queries per entry) but still keep the sinks
    assert all(bool((positions[..., :4] == torch.arange(4)).all()) for positions in kept[1])


def test_pass_hooks_are_removed_on_close_and_copies_do_not_rescore() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "kvzip", budget=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            model(input_ids=prompt(96), past_key_values=cache)
    twin = copy.deepcopy(cache)
    assert twin.layer_lengths() == cache.layer_lengths()
    rescored = []
    twin.policy.method.rescore = lambda *args: rescored.append(args)
    with torch.no_grad():
        model(input_ids=prompt(1), past_key_values=twin)  # the copy's own hook ends its pass
    assert not rescored and twin.layer_lengths() == [n + 1 for n in cache.layer_lengths()]  # prefill-only
    assert len(model.model._forward_hooks) == 2
    cache.close()
    twin.close()
    assert not model.model._forward_hooks


def test_kvzip_uses_the_tokenizer_loaded_with_the_model(tokenizer) -> None:
    from kvevict.policies.kvzip import KVzip

    policy = KVzip(tokenizer=tokenizer)
    model = tiny_model(vocab=len(tokenizer))
    context = tokenizer.apply_chat_template([{"role": "user", "content": "alpha beta"}], tokenize=False)
    head = context[: context.index("alpha beta") + len("alpha beta")]
    ids = tokenizer(head, add_special_tokens=False, return_tensors="pt").input_ids
    (repeat,) = policy.repeat_inputs(model.model, ids)
    text = tokenizer.decode(repeat[0])
    assert text.startswith("\n\nRepeat the previous context exactly.")
    assert text.endswith("assistant\nalpha beta")  # the template's prefix is not repeated


def test_shuffled_sentences_keep_each_sentence_whole_in_a_seeded_order() -> None:
    context = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    ends = [False, True, False, False, True, False, False, False]  # [10 11] [12 13 14] [15 16 17]: the last unended
    order = torch.randperm(3, generator=torch.Generator().manual_seed(0)).tolist()
    sentences = [[10, 11], [12, 13, 14], [15, 16, 17]]
    expected = [token for index in order for token in sentences[index]]
    assert shuffled_sentences(context, ends).tolist() == [expected]
    assert sorted(expected) == context[0].tolist() and expected != context[0].tolist()
    assert shuffled_sentences(context, ends, seed=1).tolist() != [expected]  # another seed, another order
    assert shuffled_sentences(context, [False] * 8).tolist() == context.tolist()  # one sentence: as it was


def test_a_shuffled_repeat_feeds_the_contexts_sentences_out_of_order(tokenizer) -> None:
    from kvevict.policies.kvzip import KVzip

    sentences = ["Alpha beta.", " Gamma delta!", " Epsilon zeta?\n", "Eta theta.", " Iota kappa.", " Lambda mu."]
    text = "".join(sentences)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert sum(sentence_ends(tokenizer, ids[0].tolist())) == 6
    model = tiny_model(vocab=len(tokenizer))
    (plain,) = KVzip(tokenizer=tokenizer).repeat_inputs(model.model, ids)
    (shuffled,) = KVzip(tokenizer=tokenizer, repeat="shuffled").repeat_inputs(model.model, ids)
    lead = plain.shape[-1] - ids.shape[-1]
    assert torch.equal(shuffled[:, :lead], plain[:, :lead])  # the same instruction, then the context reordered
    assert sorted(shuffled[0, lead:].tolist()) == sorted(ids[0].tolist()) and not torch.equal(shuffled[:, lead:], ids)
    repeated = tokenizer.decode(shuffled[0, lead:])
    assert all(sentence.strip() in repeated for sentence in sentences) and repeated != text
    with pytest.raises(ValueError, match=r"repeat=shuffled\] needs a tokenizer"):
        KVzip(repeat="shuffled").repeat_inputs(tiny_model().model, ids[:, :4] % 64)


def test_bad_parameters_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="chunk"):
        kvevict.make_policy("kvzip", chunk=0)
    with pytest.raises(ValueError, match="sinks"):
        kvevict.make_policy("kvzip", sinks=0)
    kvevict.make_policy("kvzip", sinks=0, per_layer=True)
    with pytest.raises(ValueError, match="precision.*one of 'auto', 'fp32', 'bf16'"):
        kvevict.make_policy("kvzip", precision="fp16")
    with pytest.raises(ValueError, match="repeat.*one of 'context', 'shuffled'"):
        kvevict.make_policy("kvzip", repeat="reversed")


def test_a_prompt_in_chunks_is_repeated_and_evicted_chunk_by_chunk() -> None:
    """kvzip[per_layer=true] takes chunked prefill: after each chunk each head is back at its
    budget, every entry keeps the best score of the repeats it saw, and the next token is
    attention over the retained entries. A pooled budget still refuses chunks."""
    model = tiny_model()
    ids = prompt(96)
    cache = kvevict.EvictionCache(model, "kvzip[per_layer=true]", budget=24)
    before: dict[int, dict[int, float]] = {}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for start in range(0, 96, 32):
            model(input_ids=ids[:, start : start + 32], past_key_values=cache)
            assert cache.layer_lengths() == [24, 24]
            layer = cache.eviction_layers[0]
            best = dict(zip(layer.positions[0, 0].tolist(), layer.state["kvzip/best"][0, 0].tolist()))
            assert all(best[p] >= score for p, score in before.get(0, {}).items() if p in best)  # a running max
            before[0] = best
            assert max(layer.positions[0, 0].tolist()) <= start + 31
    assert cache.get_seq_length() == 96  # positions go on from the whole prompt
    assert_next_logits_match_reference(model, cache, ids[:, -1:])
    pooled = kvevict.EvictionCache(model, "kvzip", budget=24)
    with pytest.raises(ValueError, match="cannot compress a prompt chunk by chunk"), torch.no_grad():
        for start in range(0, 64, 32):
            model(input_ids=ids[:, start : start + 32], past_key_values=pooled)
