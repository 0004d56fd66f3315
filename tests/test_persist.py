"""Saved caches: a loaded cache answers bit-identically to the one saved; bad files are refused."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.generation import prefill
from tests.conftest import left_padded, padded_positions, prompt, tiny_model


def decode(model, cache: kvevict.EvictionCache, first: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits of ``steps`` greedy steps after the logits ``first`` ``[B, V]``, each row at its own position."""
    logits = [first]
    with torch.no_grad():
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            out = model(input_ids=token, position_ids=cache.next_positions(), past_key_values=cache)
            logits.append(out.logits[:, -1])
    return torch.stack(logits[1:])


@pytest.mark.parametrize(
    ("policy", "budget", "decoded"),
    [
        ("snapkv", 40, 0),  # a prefill policy, saved after its prompt
        ("h2o", 40, 5),  # a decode-time policy, saved in the middle of decoding
        ("adakv+snapkv", 40, 0),  # head-wise budgets: ragged heads
        ("epikv", 24, 9),  # hidden-state statistics
        ("moment-nc+h2o", 40, 3),  # moment statistics in the layers' policy data
        ("lazyeviction", 40, 6),  # per-token state, lagged interval
        ("random", 40, 0),  # a random generator in the shared data
        ("kvzip", 40, 0),  # the scoring pass's policy
        ("thinkv[segment=16]", 24, 9),  # per-row tensors and a dataclass of them in the shared data
    ],
)
def test_a_loaded_cache_answers_bit_identically(tmp_path, policy: str, budget: int, decoded: int) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, policy, budget=budget)
    first = prefill(model, prompt(90), cache)
    before = decode(model, cache, first, decoded)[-1] if decoded else first
    path = cache.save(tmp_path / "doc.kv")
    loaded = kvevict.EvictionCache.load(path, model)
    assert loaded.layer_lengths() == cache.layer_lengths()
    assert [s.seen for s in loaded.sequences] == [s.seen for s in cache.sequences]
    assert torch.equal(decode(model, loaded, before, 8), decode(model, cache, before, 8))


@pytest.mark.parametrize("policy", ["adakv+snapkv", "kvzip"])
def test_a_file_holds_the_real_entries_of_ragged_heads_only(tmp_path, policy: str) -> None:
    """Heads that keep different numbers of entries are saved as they are held (packed): the
    file is about the cache's resident bytes, not every head padded to its layer's longest."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, policy, keep=0.3)
    prefill(model, prompt(200), cache)
    padded = sum(layer.n * layer.column_bytes() for layer in cache.eviction_layers)
    assert cache.kv_bytes() < padded  # ragged
    size = cache.save(tmp_path / "doc.kv").stat().st_size
    assert size < cache.kv_bytes() + 64 * 1024  # + the metadata_row_goes_on_as_it_would_have(tmp_path) -> None:
    model = tiny_model()
    ids, mask = left_padded([prompt(70), prompt(52, seed=1)])
    cache = kvevict.EvictionCache(model, "h2o", budget=32)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask), past_key_values=cache)
    cache.end_prompt()
    first = out.logits[:, -1]
    loaded = kvevict.EvictionCache.load(cache.save(tmp_path / "batch.kv"), model)
    assert torch.equal(decode(model, loaded, first, 6), decode(model, cache, first, 6))


def test_bad_files_are_refused_with_one_line(tmp_path) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "snapkv", budget=40)
    prefill(model, prompt(90), cache)
    path = cache.save(tmp_path / "doc.kv")
    with pytest.raises(ValueError, match="saved from another model: weights"):
        kvevict.EvictionCache.load(path, tiny_model(seed=1))
    with pytest.raises(ValueError, match="saved from another model: model_type 'llama' in the file, 'qwen2' here"):
        kvevict.EvictionCache.load(path, tiny_model("qwen2"))
    data = path.read_bytes()
    truncated = tmp_path / "truncated.kv"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable kvevict cache"):
        kvevict.EvictionCache.load(truncated, model)
    corrupted = tmp_path / "corrupted.kv"
    corrupted.write_bytes(b"\xff" * 16 + data[16:])
    with pytest.raises(ValueError, match="not a readable kvevict cache"):
        kvevict.EvictionCache.load(corrupted, model)
    newer = tmp_path / "newer.kv"
    newer.write_bytes(data.replace(b'"version":"2"', b'"version":"9"', 1))
    with pytest.raises(ValueError, match="format version '9'; this kvevict reads version 2"):
        kvevict.EvictionCache.load(newer, model)
    with pytest.raises(OSError, match="no such file"):
        kvevict.EvictionCache.load(tmp_path / "missing.kv", model)
    with pytest.raises(ValueError, match="cannot save an empty cache"):
        kvevict.EvictionCache(model, "snapkv", budget=40).save(tmp_path / "empty.kv")
