from types import SimpleNamespace

import pytest
import torch

import kvevict
from kvevict.policies.epikv import rolling_mean
from kvevict.policies.kvvar import (
    SCORE,
    RollingKVStatistic,
    empty_ranges,
    head_variance,
    lag_normalize,
    lagkv_chunk_scores,
)
from kvevict.rows import RowView
from kvevict.stacked import stack_rows
from tests.conftest import greedy, greedy_batch, head_positions, kept_indices, left_padded, prompt, tiny_model

EPS = 1e-6


def test_lag_normalisation_uses_the_previous_chunk_and_streams() -> None:
    x = torch.tensor([[[[0.0, 0.0], [2.0, 4.0], [1.0, 2.0], [3.0, 0.0], [2.0, 2.0]]]])
    head, ranges = lag_normalize(x[:, :, :3], 0, 2)
    out = torch.cat([head, lag_normalize(x[:, :, 3:], 3, 2, ranges)[0]], dim=2)
    expected = [
        [0.0, 0.0],  # chunk 0 has no predecessor: its own running range (0 wide)
        [2 / (2 + EPS), 4 / (4 + EPS)],
        [1 / (2 + EPS), 2 / (4 + EPS)],  # chunk 1: chunk 0's range [0, 2] x [0, 4]
        [3 / (2 + EPS), 0.0],
        [1 / (2 + EPS), 2 / (2 + EPS)],  # chunk 2: chunk 1's range [1, 3] x [0, 2]
    ]
    torch.testing.assert_close(out[0, 0], torch.tensor(expected))


def test_kv_variance_state_is_the_rolling_mean_of_each_new_vector() -> None:
    model = tiny_model()
    caches = {
        name: kvevict.EvictionCache(model, kvevict.make_policy(name, rolling=5), budget=10_000)
        for name in ("kv-key-var", "kv-val-var")
    }
    with torch.no_grad():
        for cache in caches.values():
            model(input_ids=prompt(20), past_key_values=cache)
            for step in range(8):
                model(input_ids=torch.tensor([[step + 3]]), past_key_values=cache)
    for name, cache in caches.items():
        for layer in cache.layers:
            vectors = layer.keys if name == "kv-key-var" else layer.values
            torch.testing.assert_close(layer.policy.scorer.state(layer)[SCORE], rolling_mean(head_variance(vectors), 5))


def test_lag_kv_decode_state_sums_the_normalised_variances() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("lag-kv", lag=4, rolling=3), budget=10_000)
    with torch.no_grad():
        model(input_ids=prompt(10), past_key_values=cache)
        for step in range(7):
            model(input_ids=torch.tensor([[step + 3]]), past_key_values=cache)
    layer = cache.layers[1]
    raw = sum(head_variance(lag_normalize(x, 0, 4)[0]) for x in (layer.keys, layer.values))
    torch.testing.assert_close(layer.policy.scorer.state(layer)[SCORE], rolling_mean(raw, 3))


def test_lagkv_chunk_score_is_the_softmax_of_the_std_against_the_next_chunk() -> None:
    x = torch.tensor([[[[0.0, 1.0], [4.0, 0.0], [0.0, 0.0], [4.0, 2.0]]]])
    # next chunk's range [0, 4] x [0, 2]: [0, .5] and [1, 0]; std over 2 values = |a − b| / √2
    spread = torch.tensor([0.5 / 2**0.5, 1 / 2**0.5])
    torch.testing.assert_close(lagkv_chunk_scores(x, 2), spread.softmax(dim=-1)[None, None], atol=1e-5, rtol=0)


def test_lagkv_keeps_sinks_tail_and_an_even_share_of_every_chunk() -> None:
    keys = torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(0))
    values = torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(1))
    layer = SimpleNamespace(
        length=10,
        seen=10,
        keys=keys,
        values=values,
        positions=torch.arange(10).expand(1, 2, 10),
        valid=None,
        head_lengths=lambda: torch.tensor([[10, 10]]),
    )
    policy = kvevict.make_policy("lagkv", lag=3, sinks=1)  # chunks 1-3, 4-6 scored; 7-9 the tail
    score = lagkv_chunk_scores(keys[:, :, 1:10], 3) + lagkv_chunk_scores(values[:, :, 1:10], 3)
    best = score.reshape(1, 2, 2, 3).argmax(dim=-1)  # the top entry of each chunk, per head
    kept = kept_indices(policy.select(layer, None, 6))
    for head in range(2):
        expected = sorted([0, 1 + best[0, head, 0].item(), 4 + best[0, head, 1].item(), 7, 8, 9])
        assert kept[0][head] == expected
    assert kept_indices(policy.select(layer, None, 3)) == [
        [[0, 8, 9], [0, 8, 9]]
    ]  # tail over budget: most recent first


def test_lagkv_chunks_follow_positions_not_storage_slots() -> None:
    """After an eviction the cache refills slots, so storage order is not position order: the
    entries kept are those kept with the same entries stored in position order."""
    keys = torch.randn(1, 2, 13, 4, generator=torch.Generator().manual_seed(2))
    values = torch.randn(1, 2, 13, 4, generator=torch.Generator().manual_seed(3))
    policy = kvevict.make_policy("lagkv", lag=3, sinks=1)

    def layer(order: torch.Tensor, positions: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(
            length=13,
            seen=13,
            keys=keys[:, :, order],
            values=values[:, :, order],
            positions=(order if positions is None else positions).expand(1, 2, 13),
            valid=None,
            head_lengths=lambda: torch.tensor([[13, 13]]),
        )

    in_order = torch.arange(13)
    moved = torch.tensor([12, 0, 7, 1, 2, 11, 3, 4, 5, 6, 8, 9, 10])  # later entries refilled earlier slots
    expected = policy.select(layer(in_order), None, 7)
    kept = policy.select(layer(moved), None, 7)
    assert torch.equal(kept, expected[..., moved])
    slots_as_positions = policy.select(layer(moved, positions=in_order), None, 7)  # what reading slots would keep
    assert not torch.equal(slots_as_positions, expected[..., moved])


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="lag-kv: parameter 'lag' expects an integer >= 1, got 0"):
        kvevict.make_policy("lag-kv", lag=0)
    with pytest.raises(ValueError, match="kv-key-var: parameter 'rolling' expects an integer >= 1, got 0"):
        kvevict.make_policy("kv-key-var", rolling=0)
    with pytest.raises(ValueError, match="kv-val-var: parameter 'regime' expects one of 'decode', got 'both'"):
        kvevict.make_policy("kv-val-var", regime="both")


def test_lag_normalisation_of_rows_at_different_positions_is_each_rows_own() -> None:
    """Rows at different positions (``first`` per row) cross chunk boundaries at different
    entries: normalised together (ranges stacked as rows in lockstep stack them), pass after
    pass, each row gets bit for bit what it gets alone, and carries the same ranges."""
    generator = torch.Generator().manual_seed(4)
    starts, lag, passes = (0, 5, 11), 4, (7, 1, 1, 3, 1, 9)
    rows = [torch.randn(1, 2, start + sum(passes), 3, generator=generator) for start in starts]
    history = [
        lag_normalize(x[:, :, :start], 0, lag)[1] if start else empty_ranges(x) for x, start in zip(rows, starts)
    ]
    alone = []
    for x, start, ranges in zip(rows, starts, history):
        parts, done = [], start
        for size in passes:
            part, ranges = lag_normalize(x[:, :, done : done + size], done, lag, ranges)
            parts.append(part)
            done += size
        alone.append((torch.cat(parts, dim=2), ranges))
    ranges, parts, done = stack_rows(history, "ranges"), [], 0
    first = torch.tensor(starts)[:, None, None]
    for size in passes:
        x = torch.cat([row[:, :, start + done : start + done + size] for row, start in zip(rows, starts)])
        part, ranges = lag_normalize(x, first + done, lag, ranges)
        parts.append(part)
        done += size
    together = torch.cat(parts, dim=2)
    for row, (expected, expected_ranges) in enumerate(alone):
        assert torch.equal(together[row : row + 1], expected)
        assert torch.equal(ranges[row : row + 1], expected_ranges)


LENGTHS = (20, 70, 45)
"""A left-padded batch: two prompts shorter than the rolling window (64), one longer."""
FAMILY = ("kv-key-var", "kv-val-var", "lag-kv")


def family_policy(name: str) -> kvevict.Policy:
    """``name`` with a small window, and Lag-KV with chunks of 8: rows at different positions
    complete their chunks at different decode steps."""
    return kvevict.make_policy(name, window=4, **({"lag": 8} if name == "lag-kv" else {}))


def run_batch(name: str, new_tokens: int = 12) -> tuple[kvevict.EvictionCache, torch.Tensor, torch.Tensor]:
    model = tiny_model()
    ids, mask = left_padded([prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)])
    cache = kvevict.EvictionCache(model, family_policy(name), budget=16)
    tokens, logits = greedy_batch(model, ids, mask, cache, new_tokens)
    return cache, tokens, logits


def views_of_new_tokens(monkeypatch) -> list[tuple[str, int, int, bool]]:
    """Record, for every call of the family's ``new_tokens``: phase, decode step, rows held and
    whether the rows' new entries lie in different columns (:attr:`EntryView.new_columns`)."""
    calls: list[tuple[str, int, int, bool]] = []
    hook = RollingKVStatistic.new_tokens

    def recorded(self, layer, num_new):
        rows = layer.rows.stop - layer.rows.start
        calls.append((layer.phase(), layer.decode_step, rows, layer.new_columns is not None))
        return hook(self, layer, num_new)

    monkeypatch.setattr(RollingKVStatistic, "new_tokens", recorded)
    return calls


@pytest.mark.parametrize("name", [*FAMILY, "adakv+lag-kv"])
def test_a_left_padded_batch_runs_in_lockstep_and_keeps_per_head_what_each_row_keeps_alone(
    name: str, monkeypatch
) -> None:
    """After the first eviction every decode step runs the hooks once per layer, over one view
    of every row; each row keeps, head by head, the positions it keeps alone (prompts shorter
    than the rolling window included), and generates the same tokens. Under AdaKV's head-wise
    budgets the rows end at different columns, each row's new entry read where it lies."""
    calls = views_of_new_tokens(monkeypatch)
    cache, tokens, logits = run_batch(name)
    decode_steps = [(step, rows) for phase, step, rows, _ in calls if phase == "decode"]
    assert any(apart for *_, apart in calls) == name.startswith("adakv")
    assert decode_steps and all(rows == len(LENGTHS) for step, rows in decode_steps if step > 1)
    # 2 layers × the decode passes (11 of 12 new tokens) but the first, which evicts the rows into lockstep
    assert sum(rows == len(LENGTHS) for _, rows in decode_steps) == 2 * 10
    model = tiny_model()
    for row, length in enumerate(LENGTHS):
        ids = prompt(length, seed=row)
        alone = kvevict.EvictionCache(model, family_policy(name), budget=16)
        expected, expected_logits = greedy(model, ids, alone, new_tokens=12)
        assert torch.equal(tokens[row], expected[0, length:])
        torch.testing.assert_close(logits[row], expected_logits[0], rtol=0, atol=1e-4)
        for layer, alone_layer in zip(cache.eviction_layers, alone.eviction_layers, strict=True):
            assert head_positions(layer, row) == head_positions(alone_layer, 0)


@pytest.mark.parametrize("name", FAMILY)
def test_the_batched_hook_gives_each_row_bit_for_bit_what_its_own_view_gives(name: str) -> None:
    """On the same cache (rows at different positions, histories holding fewer real values
    than the window), ``new_tokens`` over one view of every row returns each row's scores and
    leaves each row's history and ranges exactly as running it on each row's own view does.
    After 5 new tokens the hook scores positions 23, 73 and 48 again: with chunks of 8, the
    first row completes a chunk there, the third starts one, the second does neither."""
    cache, _, _ = run_batch(name, new_tokens=5)
    for layer in cache.eviction_layers:
        (view,) = layer.views()
        assert view.rows == slice(0, len(LENGTHS)) and view.seen.flatten().tolist() == [24, 74, 49]
        before = [dict(row.memo) for row in layer.rows]
        stage = layer.policy.scorer
        together = stage.new_tokens(view, 1)
        memos = [dict(row.memo) for row in layer.rows]
        for row, memo in zip(layer.rows, before, strict=True):
            row.memo = memo
        for i, row in enumerate(layer.rows):
            alone = stage.new_tokens(RowView(layer, i), 1)
            assert alone.keys() == together.keys()
            for key, value in alone.items():
                assert torch.equal(together[key][i : i + 1], value)
            assert row.memo.keys() == memos[i].keys()
            for key, value in row.memo.items():
                assert torch.equal(memos[i][key], value), key
