"""``kvevict bench throughput`` on the tiny model: admission under the cap, every sequence
generated exactly once (and as it is alone), the records' fields, resumption."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.bench import throughput
from kvevict.bench.throughput import MIB, Setting, ThroughputConfig, run_throughput, settings, token_bytes
from kvevict.cli import main
from kvevict.generation import prefill
from tests.conftest import prompt, tiny_model

NEW = 6
LENGTHS = (100, 100, 93, 100, 87)
FIELDS = {
    "policy", "budget", "keep", "sequences", "max_batch", "peak_kv_bytes", "prefill_tokens_per_s",
    "decode_tokens_per_s", "tokens_per_s", "quality", "prefill_chunk", "memory_cap_mib", "prefill_seconds",
    "decode_seconds",
}  # fmt: skip


def alone(model, ids: torch.Tensor, setting: Setting, chunk: int | None) -> list[int]:
    """Greedy tokens of one prompt served on its own."""
    size = {} if setting.policy == "full" else {"budget": setting.budget}
    cache = kvevict.EvictionCache(model, setting.policy, **size)
    tokens = [int(prefill(model, ids, cache, chunk=chunk)[0].argmax())]
    with torch.inference_mode():
        for _ in range(NEW - 1):
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


def test_serves_every_sequence_once_under_the_cap_as_it_is_alone(tmp_path) -> None:
    model = tiny_model()
    prompts = [prompt(n, seed=seed) for seed, n in enumerate(LENGTHS)]
    per_token = token_bytes(model)
    cap = 2.5 * (100 + NEW) * per_token / MIB  # two full sequences (prefill included), not three
    config = ThroughputConfig("tiny", "random", len(prompts), 100, NEW, cap, prefill_chunk=16)
    runs = settings(["snapkv", "h2o"], budgets=(40,))
    records = run_throughput(model, prompts, config, runs, tmp_path, progress=False)
    assert [(r["policy"], r["budget"]) for r in records] == [("full", None), ("snapkv", 40), ("h2o", 40)]
    for setting, record in zip(runs, records):
        assert FIELDS <= record.keys()
        assert record["sequences"] == len(prompts)
        assert record["peak_kv_bytes"] <= config.cap_bytes
        assert 0 < record["prefill_seconds"] + record["decode_seconds"] <= record["seconds"]
        chunks = record["prefill_chunks"]
        assert record["outputs"] == [alone(model, ids, setting, chunk) for ids, chunk in zip(prompts, chunks)]
    assert "prefill share" in throughput.format_table(records)
    full, snapkv, h2o = records
    assert full["max_batch"] == 2 and full["prefill_chunk"] is None and full["quality"] == 1.0
    assert (
        snapkv["prefill_chunks"][0] is None and 16 in snapkv["prefill_chunks"]
    )  # chunked once one pass no longer fits
    assert snapkv["max_batch"] > full["max_batch"]
    assert 0 <= h2o["quality"] <= 1


def test_a_prompt_is_chunked_only_where_the_policy_can_evict_chunks_of_that_size() -> None:
    model = tiny_model()
    for policy, budget, chunk in (("snapkv", 40, 48), ("kv-key-var", 40, 16), ("kv-key-var", 40, 48), ("full", 40, 16)):
        cache = kvevict.EvictionCache(model, policy, **({} if policy == "full" else {"budget": budget}))
        expected = None if policy == "full" or (policy == "kv-key-var" and chunk > budget) else chunk
        assert throughput._chunk_for(Setting(policy, budget), chunk, cache, 100) == expected


def test_a_rerun_skips_finished_settings(tmp_path, monkeypatch) -> None:
    model = tiny_model()
    prompts = [prompt(60, seed=seed) for seed in range(2)]
    config = ThroughputConfig("tiny", "random", 2, 60, 3, 1.0, prefill_chunk=None)
    first = run_throughput(model, prompts, config, settings(["full", "tova"], budgets=(40,)), tmp_path, False)
    served = []
    original = throughput.serve
    monkeypatch.setattr(throughput, "serve", lambda *args: served.append(args[2]) or original(*args))
    again = run_throughput(model, prompts, config, settings(["tova"], budgets=(40, 48)), tmp_path, False)
    assert served == [Setting("tova", 48)]  # full and tova 40 were finished
    assert again[:2] == first
    assert len((tmp_path / "throughput.jsonl").read_text().splitlines()) == 3


def test_a_cap_that_holds_no_sequence_is_refused(tmp_path) -> None:
    model = tiny_model()
    config = ThroughputConfig("tiny", "random", 1, 60, 3, 0.001)
    with pytest.raises(ValueError, match="holds no full sequence"):
        run_throughput(model, [prompt(60)], config, settings(["full"]), tmp_path, False)


def test_command_line_refuses_bad_input(capsys, tmp_path) -> None:
    assert main(["bench", "throughput", "--policies", "snapkv", "--out", str(tmp_path)]) == 2
    assert "need --budgets" in capsys.readouterr().err
    assert main(["bench", "throughput", "--keep", "0.2", "--memory-cap", "-1", "--out", str(tmp_path)]) == 2
    assert "memory cap must be a positive number" in capsys.readouterr().err


def test_each_quant_option_runs_every_setting() -> None:
    runs = settings(["full", "snapkv"], keeps=(0.25,), quants=(None, "int4"))
    assert [(s.policy, s.keep, s.quant) for s in runs] == [
        ("full", None, None),
        ("snapkv", 0.25, None),
        ("full", None, "int4"),
        ("snapkv", 0.25, "int4"),
    ]
    assert runs[3].label == "snapkv+int4 keep 0.25"
