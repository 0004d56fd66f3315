from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import repeat_kv

import kvevict
from kvevict import driver as driver_module
from kvevict import signals
from kvevict.attention import attend
from kvevict.signals import NOTHING, Requirements, attention_rows, column_sums, compute_signals
from tests.conftest import prompt, tiny_model


def full_attention(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Brute force: the whole causal attention matrix, queries at the end of the keys."""
    keys = repeat_kv(keys, query.shape[1] // keys.shape[1])
    q, n = query.shape[-2], keys.shape[-2]
    logits = query @ keys.transpose(-1, -2) * scaling
    future = torch.arange(n)[None, :] > torch.arange(n - q, n)[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1)


@pytest.fixture
def qk() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 10, 8, generator=generator)
    keys = torch.randn(1, 2, 25, 8, generator=generator)
    return query, keys


def test_attention_rows_equal_the_causal_attention_matrix_rows(qk) -> None:
    query, keys = qk
    expected = full_attention(query, keys, 0.3)
    torch.testing.assert_close(attention_rows(query[:, :, -4:], keys, 0.3), expected[:, :, -4:])
    torch.testing.assert_close(attention_rows(query, keys, 0.3), expected)


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_column_sums_in_chunks_equal_the_matrix_columns(qk, chunk: int) -> None:
    query, keys = qk
    expected = full_attention(query, keys, 0.3).sum(dim=2)
    torch.testing.assert_close(column_sums(query, keys, 0.3, chunk=chunk), expected)


def test_only_requested_signals_are_computed(qk) -> None:
    query, keys = qk
    layer = SimpleNamespace(keys=keys, values=keys, valid=None)
    nothing = compute_signals(NOTHING, layer, "prefill", query, 0.3)
    assert nothing.last_query_attention is None and nothing.window_attention is None and nothing.column_sums is None
    some = compute_signals(Requirements(window=4), layer, "prefill", query, 0.3)
    assert some.window_attention.shape == (1, 4, 4, 25) and some.column_sums is None


@pytest.mark.parametrize(
    ("policy", "calls"), [("full", 0), ("streamingllm", 0), ("knorm", 0), ("snapkv", 2), ("tova", 2)]
)
def test_attention_work_is_limited_to_what_the_policy_asks(monkeypatch, policy: str, calls: int) -> None:
    """Signals are computed only for a policy that reads them (2 layers; snapkv and tova at the
    prompt: their decode steps read the row the layer attends by, see the next test)."""
    seen = []
    original = signals.attention_rows
    monkeypatch.setattr(signals, "attention_rows", lambda query, *args: seen.append(1) or original(query, *args))
    model = tiny_model()
    cache = kvevict.EvictionCache(model, policy, budget=None if policy == "full" else 40)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
        for token in range(3):
            model(input_ids=torch.tensor([[token + 5]]), past_key_values=cache)
    assert len(seen) == calls


def test_attending_by_given_probabilities_equals_the_sdpa_kernel(qk) -> None:
    query, keys = qk
    values = torch.randn_like(keys)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, -1:], keys, values, scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    output = attend(attention_rows(query[:, :, -1:], keys, 0.3), values)
    assert output.shape == expected.shape == (1, 1, 4, 8)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy", ["tova", "h2o", "streamingllm", "snapkv"])
def test_a_decode_step_after_the_first_eviction_attends_by_its_row_on_a_cpu(monkeypatch, policy: str) -> None:
    """After the first eviction, a decode step on a CPU attends by the new query's row (the
    row the policy reads, when it reads one), in place of the model's kernel, which runs
    otherwise (the prompt, and every pass before an eviction)."""
    calls, rows = [], []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    counted = lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", counted)
    original = driver_module.softmax_rows  # the decode row's probabilities, from its logits
    monkeypatch.setattr(driver_module, "softmax_rows", lambda logits, *args: rows.append(1) or original(logits, *args))
    model = tiny_model()
    for budget, expected in ((40, 2), (10_000, 2 * 4)):  # no eviction: always the kernel
        calls.clear()
        rows.clear()
        cache = kvevict.EvictionCache(model, policy, budget=budget)
        with torch.no_grad():
            model(input_ids=prompt(96), past_key_values=cache)
            for token in range(3):
                model(input_ids=torch.tensor([[token + 5]]), past_key_values=cache)
        assert len(calls) == expected and len(calls) + len(rows) == 2 * 4  # each layer attends once a pass


def test_column_sums_never_build_an_n_by_n_matrix(monkeypatch) -> None:
    rows = []
    original = signals.attention_rows
    monkeypatch.setattr(signals, "attention_rows", lambda q, *args: rows.append(q.shape[-2]) or original(q, *args))
    model = tiny_model()
    with torch.no_grad():
        model(input_ids=prompt(700), past_key_values=kvevict.EvictionCache(model, "h2o", budget=64))
    assert max(rows) <= signals.COLUMN_SUM_CHUNK < 700


def test_wrapper_is_a_pure_pass_through_without_an_eviction_cache(attn: str) -> None:
    plain, wrapped = tiny_model(attn=attn), tiny_model(attn=attn)
    kvevict.EvictionCache(wrapped, "snapkv", budget=40)  # installs the wrapper
    assert wrapped.config._attn_implementation == f"kvevict_{attn}"
    ids = prompt(50)
    with torch.no_grad():
        assert torch.equal(wrapped(input_ids=ids).logits, plain(input_ids=ids).logits)
        mine = wrapped(input_ids=ids, past_key_values=DynamicCache()).logits
        assert torch.equal(mine, plain(input_ids=ids, past_key_values=DynamicCache()).logits)
    out_plain = plain.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    out_wrapped = wrapped.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out_plain, out_wrapped)


def test_layers_of_different_lengths_get_their_own_mask(attn: str) -> None:
    """A multi-token pass over layers that retained different numbers of entries."""
    model = tiny_model(attn=attn)
    cache = kvevict.EvictionCache(model, "streamingllm", budget=40)
    ids = prompt(96)
    with torch.no_grad():
        model(input_ids=ids[:, :80], past_key_values=cache)
    cache.layers[1].keep(torch.arange(40).expand(1, 2, 40) < 30)  # layer 1 now holds 30, layer 0 40
    reference = DynamicCache()
    for idx, layer in enumerate(cache.layers):
        reference.update(layer.keys.clone(), layer.values.clone(), idx)
    chunk = ids[:, 80:]
    positions = torch.arange(80, 96)[None]
    with torch.no_grad():
        logits = model(input_ids=chunk, past_key_values=cache).logits
        # reference: per-layer mask built by hand for a plain cache, through the model's own eager kernel
        expected = manual_forward(model, chunk, positions, reference)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def manual_forward(model, ids, positions, past: DynamicCache) -> torch.Tensor:
    """The decoder written out with hooks-free module calls and an explicit per-layer mask."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner = model.model
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    q_len = ids.shape[1]
    for idx, block in enumerate(inner.layers):
        attn = block.self_attn
        residual, x = hidden, block.input_layernorm(hidden)
        shape = (1, q_len, -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys = torch.cat([past.layers[idx].keys, k], dim=2)
        values = torch.cat([past.layers[idx].values, v], dim=2)
        weights = full_attention(q, keys, attn.scaling)
        out = (weights @ repeat_kv(values, attn.num_key_value_groups)).transpose(1, 2).reshape(1, q_len, -1)
        hidden = residual + attn.o_proj(out)
        hidden = hidden + block.mlp(block.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))


def test_keys_altered_between_the_cache_and_the_kernel_raise() -> None:
    """Something between ``layer.update`` and kvevict's kernel wrapper copies the keys (here an
    attention function registered around kvevict's): the layer can no longer tell what was
    attended, so the attention path raises instead of silently not evicting."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def copying(module, query, key, value, attention_mask, **kwargs):
        return ALL_ATTENTION_FUNCTIONS["kvevict_sdpa"](module, query, key.clone(), value, attention_mask, **kwargs)

    AttentionInterface.register("test_copying", copying)
    AttentionMaskInterface.register("test_copying", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=40)
    model.set_attn_implementation("test_copying")
    altered = pytest.raises(RuntimeError, match="keys of eviction layer 0 reached the attention kernel altered")
    with altered, torch.no_grad():
        model(input_ids=prompt(20), past_key_values=cache)


def test_signals_is_a_leaf_module() -> None:
    """``kvevict.signals`` imports neither the cache, the attention path nor the policies
    (cache → attention → signals ← policies): loaded alone in a fresh interpreter, it brings
    in no other kvevict module."""
    import subprocess
    import sys

    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('kvevict_signals_alone', {signals.__file__!r}); "
        "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "print(sorted(name for name in sys.modules if name.startswith('kvevict')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['kvevict_signals_alone']"


def test_sliding_window_mask_is_built_from_positions() -> None:
    """Retained positions 9, 0, 6, 5 (slots refilled out of order) then queries at 10, 11 with a
    window of 4: a query at p sees keys at p - 3 .. p (transformers' rule), whatever their index."""
    from kvevict.attention import _layer_mask

    layer = SimpleNamespace(
        positions=torch.tensor([[[9, 0, 6, 5, 10, 11]]]),
        valid=None,
        length=6,
        compacted=True,
        window=4,
        padded=False,
        query_positions=lambda q: torch.arange(12 - q, 12)[None, None, :, None],
    )
    query = torch.zeros(1, 2, 2, 8)
    mask = _layer_mask("sdpa", None, query, layer)
    assert mask.shape == (1, 2, 2, 6)
    assert mask[0, 0].tolist() == [[True, False, False, False, True, False], [True, False, False, False, True, True]]
    with pytest.raises(ValueError, match="sliding-window layer that evicted needs a mask built from"):
        _layer_mask("flash_attention_2", None, query, layer)
