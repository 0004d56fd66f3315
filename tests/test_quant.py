"""Quantized KV storage (kvevict.quant): the quantizer by hand, the quantized contract over
every policy (logits = attention over exactly the retained entries as dequantized), batch
invariance, chunked prefill, bytes by hand, saving and splicing, refused options."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import kvevict
from kvevict.quant import (
    CompactPositions,
    QuantConfig,
    dequantize_keys,
    dequantize_values,
    pack,
    quantize_groups,
    quantize_keys,
    quantize_values,
    quantized_columns,
    unpack_into,
)
from kvevict.quantcodes import PackedCodes, PackedTail, rectangle
from tests.conftest import (
    assert_next_logits_match_reference,
    build_policy,
    greedy,
    greedy_batch,
    left_padded,
    prompt,
    resident_storages,
    tiny_model,
)
from tests.policies.test_contract import BUDGET, POLICIES, PROMPT, rewrites_keys

QUANTIZABLE = [name for name in POLICIES if not rewrites_keys(name)]
"""Every policy of the contract suite but those that rewrite kept keys (refused over codes: test_rerotate.py, test_think.py)."""
QUANT = {"quant": "int4", "quant_group": 8, "residual": 8}
"""The tiny models' head dimension is 16: groups of 8 tokens (keys) and 8 channels (values)."""


# -- the quantizer, by hand ---------------------------------------------------------------------
def test_a_group_is_quantized_from_its_min_and_max() -> None:
    x = torch.tensor([0.0, 0.4, 0.6, 3.0])
    codes, scale, zero = quantize_groups(x, 0, bits=2)
    assert float(zero) == 0.0 and float(scale) == 1.0  # (3 − 0) / (2² − 1)
    assert codes.tolist() == [0, 0, 1, 3]
    restored = codes.float() * scale + zero
    assert restored.tolist() == [0.0, 0.0, 1.0, 3.0]  # each within scale / 2 = 0.5


def test_entries_not_held_take_no_part_in_their_group_and_an_empty_group_is_zero() -> None:
    x = torch.tensor([[1.0, 100.0, 2.0, 3.0], [5.0, 6.0, 7.0, 8.0]])
    held = torch.tensor([[True, False, True, True], [False] * 4])
    codes, scale, zero = quantize_groups(x, 1, bits=2, held=held)
    assert zero.tolist() == [[1.0], [0.0]] and scale.flatten().tolist() == pytest.approx([2 / 3, 0.0])
    assert codes[0, [0, 2, 3]].tolist() == [0, 2, 3]  # round(1.5) = 2 (half to even)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_every_element_dequantizes_within_half_a_step_of_its_group(bits: int) -> None:
    torch.manual_seed(0)
    keys, values = torch.randn(2, 3, 16, 8) * 3, torch.randn(2, 3, 16, 8)
    quantized = quantize_keys(keys, bits, 4, None)
    assert quantized.codes.shape == (2, 3, 16, 8 * bits // 8)  # packed along the channels
    assert quantized.scale.shape == (2, 3, 4, 1, 8)  # per channel, per group of 4 tokens
    step = quantized.scale.squeeze(3).repeat_interleave(4, dim=2)
    error = (dequantize_keys(quantized, bits, 4, torch.float32) - keys).abs()
    assert bool((error <= step / 2 + 1e-6).all())
    assert torch.equal(
        quantized.scale.squeeze(3),
        (keys.view(2, 3, 4, 4, 8).amax(3) - keys.view(2, 3, 4, 4, 8).amin(3)) / (2**bits - 1),
    )
    quantized = quantize_values(values, bits, 4)
    assert quantized.scale.shape == (2, 3, 16, 2, 1)  # per token, per group of 4 channels
    step = quantized.scale.squeeze(4).repeat_interleave(4, dim=3)
    error = (dequantize_values(quantized, bits, 4, torch.float32) - values).abs()
    assert bool((error <= step / 2 + 1e-6).all())


def test_codes_are_packed_in_planes_low_bits_first() -> None:
    """Byte ``j`` holds channels ``j, j + w, ...`` (``w`` bytes a row), the first plane in the low bits."""
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 3, 3]], dtype=torch.uint8)
    packed = pack(codes, 2)
    assert packed.tolist() == [[1 + (3 << 2) + (3 << 4) + (3 << 6), 2 + (0 << 2) + (3 << 4) + (3 << 6)]]
    assert torch.equal(unpack_into(packed, 2, torch.empty(1, 8)), codes.float())
    four = torch.tensor([[15, 1]], dtype=torch.uint8)
    assert pack(four, 4).tolist() == [[15 + (1 << 4)]]
    assert torch.equal(unpack_into(pack(four, 4), 4, torch.empty(1, 2, dtype=torch.uint8)), four)
    assert torch.equal(pack(four, 8), four) and torch.equal(unpack_into(four, 8, torch.empty(1, 2)), four.float())


def test_the_residual_is_flushed_whole_in_groups_as_kivi_and_quanto_do() -> None:
    """``width mod F`` entries at full precision, ``F = group · max(1, ⌊residual / group⌋)``."""
    widths = (0, 7, 8, 15, 16, 23, 24, 100)
    config = QuantConfig(bits=4, group=8, residual=8)  # F = 8: 0 .. 7 entries at full precision
    assert [quantized_columns(width, config) for width in widths] == [0, 0, 8, 8, 16, 16, 24, 96]
    config = QuantConfig(bits=4, group=8, residual=20)  # F = 16: 0 .. 15, never more than the residual
    assert [quantized_columns(width, config) for width in widths] == [0, 0, 0, 0, 16, 16, 16, 96]
    config = QuantConfig(bits=4, group=8, residual=3)  # below a group: a key group still needs 8 tokens
    assert [quantized_columns(width, config) for width in widths] == [0, 0, 8, 8, 16, 16, 24, 96]
    for residual in (8, 20, 32):
        config = QuantConfig(bits=4, group=8, residual=residual)
        assert all(width - quantized_columns(width, config) < residual for width in range(200))


def test_positions_are_held_in_the_fewest_bytes_that_hold_them_exactly() -> None:
    consecutive = torch.arange(-3, 9).view(1, 1, 12).repeat(2, 3, 1) + torch.tensor([0, 5]).view(2, 1, 1)
    small = consecutive.clone()
    small[1, 2, 4] = 30_000
    large = small.clone()
    large[0, 0, 0] = -(2**20)
    huge = small.clone()
    huge[1, 1, 1] = 2**40
    for positions, table in zip((consecutive, small, large, huge), (None, torch.int16, torch.int32, torch.int64)):
        compact = CompactPositions.of(positions)
        assert (compact.first is None) == (table is not None)
        assert (compact.table.dtype if compact.table is not None else None) == table
        restored = compact.restore(15)
        assert restored.dtype == torch.long and torch.equal(restored[:, :, :12], positions)
        assert restored.is_contiguous()  # written in place by the pass
    assert CompactPositions.of(consecutive).first == [-3, 2] and CompactPositions.of(consecutive).tensors() == []


# -- the quantized contract ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", QUANTIZABLE)
def test_quantized_eviction_matches_attention_over_the_dequantized_entries(policy: str) -> None:
    model = tiny_model()
    budget = None if policy == "full" else BUDGET
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget, **QUANT)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=7)
    assert all(layer.storage.quantized is not None for layer in cache.eviction_layers)  # codes between passes
    assert_next_logits_match_reference(model, cache, sequences[:, -1:])  # the reference reads layer.keys: dequantized


@pytest.mark.parametrize("quant", ["int8", "int2"])
@pytest.mark.parametrize("policy", ["snapkv", "tova", "kvzip", "lazyeviction", "adakv+snapkv"])
def test_every_width_keeps_the_quantized_contract(policy: str, quant: str) -> None:
    model = tiny_model(attn="eager")
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, quant=quant, quant_group=16, residual=4)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=5)
    assert_next_logits_match_reference(model, cache, sequences[:, -1:])


def test_attention_reads_the_keys_as_dequantized_and_int8_stays_close_to_full_precision() -> None:
    model = tiny_model()
    ids = prompt(PROMPT)
    _, exact = greedy(model, ids, kvevict.EvictionCache(model, "snapkv", budget=BUDGET), new_tokens=5)
    errors = {}
    for quant in ("int8", "int4", "int2"):
        cache = kvevict.EvictionCache(model, "snapkv", budget=BUDGET, quant=quant, quant_group=8, residual=8)
        _, logits = greedy(model, ids, cache, new_tokens=5)
        errors[quant] = float((logits - exact).abs().max())
    assert errors["int8"] < errors["int4"] < errors["int2"]
    assert errors["int8"] < 1e-2


@pytest.mark.parametrize("policy", QUANTIZABLE)
def test_a_quantized_left_padded_batch_gives_each_row_what_it_gets_alone(policy: str) -> None:
    model = tiny_model()
    prompts = [prompt(length, seed=seed) for seed, length in enumerate((BUDGET + 8, BUDGET + 24, BUDGET + 15))]
    ids, mask = left_padded(prompts)
    budget = None if policy == "full" else BUDGET
    batch = kvevict.EvictionCache(model, build_policy(policy), budget=budget, **QUANT)
    batch_tokens, batch_logits = greedy_batch(model, ids, mask, batch, 7)
    for layer in batch.eviction_layers:  # each row keeps its own tail at full precision, fewer than 8 entries
        assert rectangle(layer.storage.quantized.residual_keys).shape[2] < QUANT["residual"]
    for row, ids_alone in enumerate(prompts):
        alone = kvevict.EvictionCache(model, build_policy(policy), budget=budget, **QUANT)
        tokens, logits = greedy(model, ids_alone, alone, new_tokens=7)
        assert torch.equal(batch_tokens[row], tokens[0, ids_alone.shape[1] :])
        # a row is grouped and quantized exactly as alone; the model's own batch-vs-alone rounding
        # (~1e-7 in a key) may still tip one code over a rounding boundary: one step of that code
        torch.testing.assert_close(batch_logits[row], logits[0], rtol=0, atol=1e-3)


@pytest.mark.parametrize("policy", ["full", "snapkv", "h2o", "streamingllm", "tova"])
def test_chunked_prefill_keeps_the_quantized_contract(policy: str) -> None:
    model = tiny_model()
    budget = None if policy == "full" else BUDGET
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget, prompt_length=PROMPT, **QUANT)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=5, chunk=32)
    if budget is not None:
        assert cache.peak_entries() <= BUDGET + 32
    assert_next_logits_match_reference(model, cache, sequences[:, -1:])


@pytest.mark.parametrize("policy", ["full", "snapkv", "tova", "adakv+snapkv"])
def test_a_quantized_cache_filled_in_one_grad_mode_goes_on_in_the_other(policy: str) -> None:
    model = tiny_model()
    budget = None if policy == "full" else BUDGET
    results = []
    for fill, go_on in [(torch.no_grad, torch.no_grad), (torch.inference_mode, torch.no_grad)]:
        cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget, **QUANT)
        with fill():
            token = model(input_ids=prompt(PROMPT), past_key_values=cache).logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(5):
            with go_on():
                logits = model(input_ids=token, past_key_values=cache).logits[:, -1].clone()
            steps.append(logits)
            token = logits.argmax(-1, keepdim=True)
        results.append(torch.stack(steps))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["full", "tova", "kvzip"])
def test_entries_within_the_residual_stay_exact(policy: str) -> None:
    """Rows of fewer than ``residual`` entries quantize nothing: the same logits as unquantized
    (bit for bit where both attend alike; kvzip's unquantized layers, ragged, decode packed
    (:mod:`kvevict.packed`), whose products sum in another order)."""
    model = tiny_model()
    ids = prompt(24)
    _, expected = greedy(model, ids, kvevict.EvictionCache(model, build_policy(policy), keep=0.5), new_tokens=4)
    cache = kvevict.EvictionCache(model, build_policy(policy), keep=0.5, quant="int2", residual=32)
    _, logits = greedy(model, ids, cache, new_tokens=4)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 if policy == "kvzip" else 0)
    assert all(layer.storage.quantized.counts == [0] for layer in cache.eviction_layers)


def test_without_quant_nothing_is_quantized() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "snapkv", budget=BUDGET)
    greedy(model, prompt(PROMPT), cache, new_tokens=3)
    assert cache.quant is None and all(layer.storage.quantized is None for layer in cache.eviction_layers)


# -- bytes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant,bits", [("int8", 8), ("int4", 4), ("int2", 2)])
def test_kv_bytes_are_the_codes_scales_residual_and_positions(quant: str, bits: int) -> None:
    """The tiny llama: 2 layers, 2 KV heads of 16 dims, fp32. ``full`` over 75 tokens, groups of 8,
    residual 8: 72 entries quantized (9 key groups), 75 mod 8 = 3 at full precision; the
    positions 0 .. 74 of every head are the row's first (an int, no tensor)."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "full", quant=quant, quant_group=8, residual=8)
    with torch.no_grad():
        model(input_ids=prompt(75), past_key_values=cache)
    heads, d, q, n = 2, 16, 72, 75
    codes = 2 * heads * q * d * bits // 8  # keys and values
    key_scales = 2 * heads * (q // 8) * d * 4  # scale and zero point per channel per group of 8 tokens
    value_scales = 2 * heads * q * (d // 8) * 4  # scale and zero point per token per group of 8 channels
    residual = 2 * heads * (n - q) * d * 4
    for layer in cache.eviction_layers:
        assert layer.storage.state == {} and layer.storage.valid is None
        assert layer.kv_bytes() == codes + key_scales + value_scales + residual
    assert cache.kv_bytes() == sum(resident_storages(cache).values())  # and that is what a walk finds


def test_an_evicting_layer_holds_its_positions_as_int16() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "tova", budget=BUDGET, quant="int4", quant_group=8, residual=8)
    greedy(model, prompt(PROMPT), cache, new_tokens=3)
    for layer in cache.eviction_layers:
        compact = layer.storage.quantized.positions
        assert compact.first is None and compact.table.dtype == torch.int16
        assert compact.table.shape == (1, 2, layer.n)  # the entries held, not the storage's capacity
        assert torch.equal(layer.positions, compact.table.long())


@pytest.mark.parametrize("policy", ["snapkv", "kvzip", "tova", "lazyeviction"])
def test_quantized_storage_really_shrinks(policy: str) -> None:
    model = tiny_model()
    ids = prompt(PROMPT)
    sizes = {}
    for quant in (None, "int8", "int4", "int2"):
        cache = kvevict.EvictionCache(
            model, build_policy(policy), budget=BUDGET, quant=quant, quant_group=8, residual=8
        )
        greedy(model, ids, cache, new_tokens=4)
        walked = sum(resident_storages(cache).values())
        assert walked >= cache.kv_bytes() and walked - cache.kv_bytes() <= 4096  # the policy's own bookkeeping
        sizes[quant] = cache.kv_bytes()
    assert sizes[None] > sizes["int8"] > sizes["int4"] > sizes["int2"]


# -- eviction and quantization cooperate ----------------------------------------------------------------
@pytest.mark.parametrize("policy", ["snapkv", "tova", "kvzip"])
def test_a_saved_quantized_cache_answers_as_the_original(policy: str, tmp_path) -> None:
    """The file holds the codes, scales and zero points as held (not the entries dequantized), and
    loading gives them back bit for bit."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, **QUANT)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=4)
    path = cache.save(tmp_path / "cache.safetensors")
    loaded = kvevict.EvictionCache.load(path, model)
    assert loaded.quant == cache.quant
    for mine, theirs in zip(loaded.eviction_layers, cache.eviction_layers):
        assert mine.storage.quantized is not None
        for saved, held in zip(mine.storage.quantized.tensors(), theirs.storage.quantized.tensors(), strict=True):
            assert torch.equal(saved, held)
    with safe_open(path, "pt") as saved:
        names = list(saved.keys())
        assert not any(name.endswith((".keys", ".values")) for name in names)  # not dequantized
        assert any(saved.get_tensor(name).dtype == torch.uint8 for name in names)  # the packed codes
    token = sequences[:, -1:]
    with torch.no_grad():
        expected = model(input_ids=token, past_key_values=cache).logits
        logits = model(input_ids=token, past_key_values=loaded).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy", ["snapkv", "tova"])
def test_a_spliced_quantized_row_goes_on_as_alone(policy: str) -> None:
    model = tiny_model()
    prompts = [prompt(PROMPT, seed=1), prompt(PROMPT - 20, seed=2)]
    caches = []
    for ids in prompts:
        cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, **QUANT)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
        cache.end_prompt()
        caches.append(cache)
    alone = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, **QUANT)
    with torch.no_grad():
        model(input_ids=prompts[1], past_key_values=alone)
    caches[0].splice(1, caches[1])
    assert all(layer.storage.quantized is not None for layer in caches[0].eviction_layers)
    token = torch.tensor([[5], [7]])
    with torch.no_grad():
        batch = model(input_ids=token, position_ids=caches[0].next_positions(), past_key_values=caches[0]).logits
        expected = model(input_ids=token[1:], past_key_values=alone).logits
    torch.testing.assert_close(batch[1:], expected, rtol=0, atol=1e-4)
    caches[0].remove_rows([0])
    assert all(layer.storage.quantized is not None for layer in caches[0].eviction_layers)


# -- refused options --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,message",
    [
        ({"quant": "int3"}, "quant must be one of 'int8', 'int4', 'int2' or None, got 'int3'"),
        ({"quant": "int4", "quant_group": 6}, "quant_group must be a positive integer dividing the head dimension 16"),
        ({"quant": "int4", "quant_group": 0}, "quant_group must be a positive integer"),
        ({"quant": "int4", "quant_group": 8, "residual": -1}, "residual must be an integer >= 0"),
    ],
)
def test_bad_quant_options_are_refused_in_one_line(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        kvevict.EvictionCache(tiny_model(), "snapkv", budget=BUDGET, **options)
    assert "\n" not in str(error.value)


def test_quant_with_an_attention_kvevict_does_not_wrap_is_refused() -> None:
    model = tiny_model()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attention implementation 'flex_attention' is not supported"):
        kvevict.EvictionCache(model, "snapkv", budget=BUDGET, **QUANT)


def test_a_quantized_layer_holds_codes_for_its_real_entries_not_for_its_longest_head() -> None:
    """Head-wise budgets leave a layer's heads with different lengths: the codes, scales and
    full-precision tail of the shorter heads are not padded to the longest (DESIGN §1.5)."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "adakv+snapkv", budget=BUDGET, quant="int4", quant_group=8, residual=8)
    with torch.no_grad():
        model(input_ids=prompt(PROMPT), past_key_values=cache)
    packed = 0
    for layer in cache.eviction_layers:
        quantized, valid = layer.storage.quantized, layer.storage.valid
        region = quantized.counts[0]
        real, tail = valid[..., :region], valid[..., region : quantized.n]
        assert len(set(layer.head_lengths().flatten().tolist())) > 1  # AdaKV: heads of different lengths
        if not bool(real.all()):
            packed += 1
            assert isinstance(quantized.keys, PackedCodes) and torch.equal(quantized.keys.held, real)
            assert quantized.keys.codes.shape[0] == quantized.values.codes.shape[0] == int(real.sum())
            assert quantized.keys.codes.numel() < rectangle(quantized.keys).codes.numel()
        if not bool(tail.all()):
            assert isinstance(quantized.residual_keys, PackedTail) and quantized.residual_keys.rows.shape[0] == int(
                tail.sum()
            )
    assert packed  # some head's real entries end before the layer's quantized columns do
