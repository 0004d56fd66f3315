"""``kvevict bench throughput`` on the tiny model: admission by each row's ceiling under the cap
on resident bytes, every sequence generated exactly once (and as it is alone), the three
workloads' records, resumption."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.bench import throughput
from kvevict.bench.serving import batch_bound
from kvevict.bench.throughput import MIB, Setting, ThroughputConfig, run_throughput, settings
from kvevict.bench.workloads import Learned, PromptJob, setting_cache
from kvevict.cli import main
from kvevict.generation import greedy_after, prefill, stop_tokens_of
from kvevict.storage import ColumnBytes, capacity_bound
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


def full_column_bytes(model) -> list[int]:
    """Per layer, the resident bytes of an entry column of a full-cache row."""
    cache = kvevict.EvictionCache(model, "full")
    prefill(model, prompt(8), cache)
    return cache.column_bytes()


def rows_bound(model, rows: int, entries: int) -> int:
    """Resident bytes of ``rows`` full-cache rows of ``entries`` entries per head in every layer."""
    column = full_column_bytes(model)
    return batch_bound([[entries] * len(column)] * rows, 1, [ColumnBytes(size) for size in column])


def two_full_sequences(model, length: int, new: int) -> float:
    """A cap (MiB) that holds two full-cache rows of ``length + new`` entries and the prefill
    of a third prompt beside them, but not three rows."""
    cap = rows_bound(model, 2, length + new) + capacity_bound(length, 0) * sum(full_column_bytes(model))
    assert cap < rows_bound(model, 3, length + new)
    return cap / MIB


def test_serves_every_sequence_once_under_the_cap_as_it_is_alone(tmp_path) -> None:
    model = tiny_model()
    prompts = [prompt(n, seed=seed) for seed, n in enumerate(LENGTHS)]
    cap = two_full_sequences(model, 100, NEW)
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
    assert snapkv["max_batch"] > full["max_batch"] and h2o["max_batch"] > full["max_batch"]
    assert 0 <= h2o["quality"] <= 1


@pytest.mark.parametrize("policy", ["h2o", "tova", "streamingllm"])
def test_a_decode_time_policy_is_admitted_by_its_ceiling_not_by_full_growth(tmp_path, policy: str) -> None:
    """Long generations under a cap that holds two full-cache sequences: rows held at budget +
    interval fit several times as many at once, and the resident peak stays under the cap."""
    model = tiny_model()
    length, new = 12, 90
    prompts = [prompt(length, seed=seed) for seed in range(8)]
    cap = two_full_sequences(model, length, new)
    config = ThroughputConfig("tiny", "random", 8, length, new, cap, workload="longgen", fidelity=False)
    full, evicting = run_throughput(model, prompts, config, settings([policy], budgets=(16,)), tmp_path, False)
    assert full["max_batch"] == 2
    assert evicting["max_batch"] >= 2 * full["max_batch"]
    for record in (full, evicting):
        assert record["peak_kv_bytes"] <= config.cap_bytes
        assert [len(tokens) for tokens in record["outputs"]] == [new] * 8  # every sequence served once, whole


def test_a_quantized_setting_admits_more_rows_under_the_same_cap_and_stays_under_it(tmp_path) -> None:
    """Admission by what quantized rows hold (codes, scales, the residual, one dense layer)."""
    model = tiny_model()
    length, new = 100, 150
    prompts = [prompt(length, seed=seed) for seed in range(8)]
    cap = (rows_bound(model, 3, length + new) + capacity_bound(length, 0) * sum(full_column_bytes(model))) / MIB
    config = ThroughputConfig("tiny", "random", 8, length, new, cap, workload="longgen", fidelity=False)
    runs = settings(["tova"], budgets=(192,), quants=(None, "int4"))
    records = run_throughput(model, prompts, config, runs, tmp_path, False)
    assert [(r["policy"], r.get("quant")) for r in records] == [
        ("full", None), ("tova", None), ("full", "int4"), ("tova", "int4")
    ]  # fmt: skip
    full, tova, full_int4, tova_int4 = records
    assert full["max_batch"] == 3
    assert full_int4["max_batch"] > full["max_batch"] and tova_int4["max_batch"] > tova["max_batch"]
    for record in records:
        assert record["peak_kv_bytes"] <= config.cap_bytes
        assert [len(tokens) for tokens in record["outputs"]] == [new] * 8


def test_teacher_forced_fidelity_is_recorded_for_long_generations(tmp_path) -> None:
    model = tiny_model()
    prompts = [prompt(10, seed=seed) for seed in range(3)]
    config = ThroughputConfig("tiny", "random", 3, 10, 30, 50.0, workload="longgen")
    full, tova = run_throughput(model, prompts, config, settings(["tova"], budgets=(16,)), tmp_path, False)
    assert full["teacher_forced_top1"] == 1.0 and full["teacher_forced_kl"] == 0.0
    assert 0 <= tova["teacher_forced_top1"] <= 1 and tova["teacher_forced_kl"] >= 0
    assert set(tova["teacher_forced"]) == {"full_through_policy", "policy_through_full"}
    assert "top-1 forced" in throughput.format_table([full, tova])


def test_a_prompt_is_chunked_only_where_the_policy_can_evict_chunks_of_that_size() -> None:
    model = tiny_model()
    for policy, budget, chunk in (("snapkv", 40, 48), ("kv-key-var", 40, 16), ("kv-key-var", 40, 48), ("full", 40, 16)):
        job = PromptJob(model, prompt(100), Setting(policy, None if policy == "full" else budget), 4, Learned(), chunk)
        expected = None if policy == "full" or (policy == "kv-key-var" and chunk > budget) else chunk
        assert job._chunkable() == expected


def test_a_prompt_window_held_until_the_last_chunk_counts_in_what_chunks_save() -> None:
    model = tiny_model()
    for window, expected in ((0, 16), (24, 16), (60, None)):  # 40 + (60 - 8) + 16 >= 100: no saving
        policy = f"fastkvzip[per_layer=true,gates=initial,window=8,prompt_window={window}]"
        job = PromptJob(model, prompt(100), Setting(policy, 40), 4, Learned(), 16)
        assert job._chunkable() == expected


def test_a_rerun_skips_finished_settings(tmp_path, monkeypatch) -> None:
    model = tiny_model()
    prompts = [prompt(60, seed=seed) for seed in range(2)]
    config = ThroughputConfig("tiny", "random", 2, 60, 3, 1.0, prefill_chunk=None)
    first = run_throughput(model, prompts, config, settings(["full", "tova"], budgets=(40,)), tmp_path, False)
    served = []
    original = throughput.serve_setting
    monkeypatch.setattr(throughput, "serve_setting", lambda *args: served.append(args[3]) or original(*args))
    again = run_throughput(model, prompts, config, settings(["tova"], budgets=(40, 48)), tmp_path, False)
    assert served == [Setting("tova", 48)]  # full and tova 40 were finished
    assert again[:2] == first
    assert len((tmp_path / "throughput.jsonl").read_text().splitlines()) == 3


def test_a_cap_that_holds_no_sequence_is_refused(tmp_path) -> None:
    model = tiny_model()
    config = ThroughputConfig("tiny", "random", 1, 60, 3, 0.001)
    with pytest.raises(ValueError, match="holds no sequence of this setting"):
        run_throughput(model, [prompt(60)], config, settings(["full"]), tmp_path, False)


def test_command_line_refuses_bad_input(capsys, tmp_path) -> None:
    assert main(["bench", "throughput", "--policies", "snapkv", "--out", str(tmp_path)]) == 2
    assert "need --budgets" in capsys.readouterr().err
    assert main(["bench", "throughput", "--keep", "0.2", "--memory-cap", "-1", "--out", str(tmp_path)]) == 2
    assert "memory cap must be a positive number" in capsys.readouterr().err
    assert main(["bench", "throughput", "--keep", "0.2", "--device", "gpu", "--out", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == "kvevict bench throughput: error: unknown device 'gpu'; use cpu, cuda, cuda:N or mps\n"
    )


def test_compress_once_ask_many_answers_every_question_from_a_copy_of_its_document(tmp_path, tokenizer) -> None:
    """Each document is compressed once; every question's tokens are what compressing the
    document, then asking that question alone, gives; a compressed document holds fewer bytes."""
    from kvevict.bench.throughput import ask_documents

    model = tiny_model(vocab=len(tokenizer))
    config = ThroughputConfig("tiny", "niah", 2, 300, 5, 64.0, workload="ask", questions=3)
    documents = ask_documents(config, tokenizer)
    assert [len(doc.questions) for doc in documents] == [3, 3]
    full, snapkv = run_throughput(
        model, documents, config, settings(["snapkv"], keeps=(0.25,)), tmp_path, False, tokenizer=tokenizer
    )
    for record, setting in ((full, Setting("full")), (snapkv, Setting("snapkv", keep=0.25))):
        assert record["answers"] == 6 and len(record["predictions"]) == 6
        assert 0 <= record["score"] <= 100
        expected = []
        for doc in documents:
            for tail in doc.questions:
                cache = setting_cache(setting, model, doc.context.shape[-1])
                prefill(model, doc.context, cache)
                expected.append(greedy_after(model, cache, tail, 5, stop_tokens_of(model)))
        assert record["outputs"] == expected
    assert snapkv["kv_bytes_per_document"] < 0.5 * full["kv_bytes_per_document"]
    table = throughput.format_table([full, snapkv])
    assert "answers/s" in table and "prefill share" in table


def test_each_quant_option_runs_every_setting() -> None:
    runs = settings(["full", "snapkv"], keeps=(0.25,), quants=(None, "int4"))
    assert [(s.policy, s.keep, s.quant) for s in runs] == [
        ("full", None, None),
        ("snapkv", 0.25, None),
        ("full", None, "int4"),
        ("snapkv", 0.25, "int4"),
    ]
    assert runs[3].describe() == "snapkv (int4) keeping 0.25"
