import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvevict.analysis import recurrence
from kvevict.analysis.recurrence import (
    BUILTIN_PROMPTS,
    RecurrenceRun,
    format_summary,
    layer_mri,
    load_prompts,
    mri_summary,
    plot_histogram,
    recurrence_cache,
    summarize_run,
    track_generation,
)
from kvevict.cli import main
from kvevict.policies.lazyeviction import ALPHA_LLAMA, ALPHA_QWEN, MRI, TIMESTAMP
from kvevict.signals import attention_rows
from tests.conftest import capture_passes, prompt, tiny_model

PAD = SimpleNamespace(pad_token_id=0, eos_token_id=0)  # what continue_greedy needs of a tokenizer


# -- the distribution ---------------------------------------------------------------------
def test_mri_summary_on_a_hand_made_array() -> None:
    values = np.array([[0, 0, 1, 1, 2], [3, 5, 8, 13, 40]])  # any shape: flattened
    summary = mri_summary(values)
    assert (summary.tokens, summary.recurring, summary.max_mri) == (10, 8, 40)
    assert summary.share_mri_gt_0 == pytest.approx(0.8)
    assert summary.share_mri_gt_1 == pytest.approx(0.6)
    # recurring [1, 1, 2, 3, 5, 8, 13, 40]: smallest v with >= p% of the 8 entries <= v
    assert summary.percentiles_recurring == {50: 3, 80: 13, 90: 40, 95: 40, 99: 40}
    # all [0, 0, 1, 1, 2, 3, 5, 8, 13, 40]
    assert summary.percentiles_all == {50: 2, 80: 8, 90: 13, 95: 40, 99: 40}
    assert summary.suggested_window == 13
    assert mri_summary(torch.tensor(values, dtype=torch.int32)) == summary


def test_nothing_recurring_suggests_no_window_and_empty_input_fails() -> None:
    summary = mri_summary([0, 0, 0])
    assert summary.recurring == 0 and summary.suggested_window is None
    assert summary.percentiles_recurring == {} and summary.percentiles_all[80] == 0
    assert "suggested W = -" in format_summary(summary)
    with pytest.raises(ValueError, match="no MRI values"):
        mri_summary([])


def test_format_summary_names_each_population_and_the_window_rule() -> None:
    summary = mri_summary([0, 0, 1, 1, 2, 3, 5, 8, 13, 40])
    text = format_summary(summary, [summary, summary], title="demo")
    assert text.startswith("demo\n")
    assert "share MRI > 1:" in text and "60.0%" in text and "80.0%" in text
    assert "recurring (MRI>=1)  3    13   40   40   40" in text
    assert "all entries         2    8    13   40   40" in text
    assert "suggested W = 13 (p80 of MRI over recurring entries" in text
    assert "per layer" in text and "\n1      10" in text


def test_summary_json_and_histogram(tmp_path) -> None:
    run = RecurrenceRun("tiny", "builtin", 5e-4, 8)
    run.add(5, 3, [np.array([[0, 1, 2, 3, 4, 4, 7]]), np.array([[1, 1, 1, 1, 1, 1, 2]])])
    run.add(4, 2, [np.array([[0, 5, 0, 1, 2]]), np.array([[3, 3, 0, 0, 1]])])
    assert run.values().size == 24 and run.values(1).tolist() == [1, 1, 1, 1, 1, 1, 2, 3, 3, 0, 0, 1]
    summary = json.loads(json.dumps(summarize_run(run)))
    assert summary["prompts"] == 2 and summary["prompt_tokens"] == [5, 4] and summary["new_tokens"] == [3, 2]
    assert summary["overall"]["tokens"] == 24 and len(summary["layers"]) == 2
    assert summary["overall"]["suggested_window"] == summary["overall"]["percentiles_recurring"]["80"]
    assert sum(summary["mri_counts"].values()) == 24 and summary["mri_counts"]["1"] == 9
    assert "prompt and decode tokens" in summary["population"]
    path = plot_histogram(run.values(), tmp_path / "sub" / "mri.png", window=3)
    assert path.read_bytes()[:4] == b"\x89PNG"


# -- tracking on a model ------------------------------------------------------------------
def brute_force_mri(passes: list[dict], num_kv_heads: int, prefilled: int, alpha: float) -> np.ndarray:
    """MRI per (KV head, entry) from the recorded attention rows, token by token: the largest
    gap between consecutive times it was attended (≥ α, max over the GQA group), its birth
    timestamp first (0 for prefilled tokens, t − 1 for the token fed at decode step t)."""
    steps = []  # per decode step t = 1, 2, ...: [Hkv, n_t]
    for record in passes[1:]:
        rows = attention_rows(record["query"][:, :, -1:], record["keys"], record["scaling"])[0, :, 0]
        steps.append(rows.reshape(num_kv_heads, -1, rows.shape[-1]).amax(dim=1))
    total = steps[-1].shape[-1]
    mri = np.zeros((num_kv_heads, total), dtype=np.int64)
    for head in range(num_kv_heads):
        for token in range(total):
            times = [token - prefilled if token >= prefilled else 0]
            times += [t for t, a in enumerate(steps, start=1) if token < a.shape[-1] and a[head, token] >= alpha]
            mri[head, token] = max([b - a for a, b in itertools.pairwise(times)], default=0)
    return mri


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tracking_equals_a_brute_force_recomputation(arch: str) -> None:
    model = tiny_model(arch)
    alpha = 0.04  # ~ the mean attention over ~25 entries: some attended, some not
    cache = recurrence_cache(model, alpha=alpha)
    passes = [capture_passes(layer) for layer in cache.eviction_layers]
    ids = prompt(16)
    new = track_generation(model, PAD, ids, 12, cache)
    steps = len(passes[0]) - 1
    assert steps == new.shape[-1] >= 2  # one decode pass per generated token
    found = layer_mri(cache)
    for layer, records, mri in zip(cache.eviction_layers, passes, found):
        assert layer.length == ids.shape[-1] + steps - 1  # nothing evicted
        state = cache.policy.method.state(layer)
        assert state[MRI].dtype == state[TIMESTAMP].dtype == torch.int32
        expected = brute_force_mri(records, layer.num_kv_heads, ids.shape[-1] - 1, alpha)
        np.testing.assert_array_equal(mri, expected)
    values = np.concatenate([m.reshape(-1) for m in found])
    assert 0 < (values > 1).sum() < values.size  # the threshold separates something


def test_alpha_defaults_to_the_model_family() -> None:
    assert recurrence_cache(tiny_model("llama")).policy.method.alpha == ALPHA_LLAMA
    assert recurrence_cache(tiny_model("qwen2")).policy.method.alpha == ALPHA_QWEN
    assert recurrence_cache(tiny_model("qwen2"), alpha=0.01).policy.method.alpha == 0.01


def test_run_recurrence_applies_the_template_and_accumulates(monkeypatch) -> None:
    model = tiny_model()
    monkeypatch.setattr(
        "kvevict.generation.split_prompt",
        lambda tokenizer, text: (prompt(len(text)), torch.tensor([[3, 4]])),
    )
    run = recurrence.run_recurrence(model, PAD, ["abcdef", "abcdefghij"], max_new_tokens=5, progress=False)
    assert run.prompt_tokens == [8, 12] and run.alpha == ALPHA_LLAMA
    assert len(run.layers) == 2 and all(len(store) == 2 for store in run.layers)
    kv_heads = model.config.num_key_value_heads
    assert run.values(0).size == kv_heads * sum(p + n - 1 for p, n in zip(run.prompt_tokens, run.new_tokens))


# -- prompt sets --------------------------------------------------------------------------
def test_builtin_prompt_set() -> None:
    assert 6 <= len(BUILTIN_PROMPTS) <= 10
    assert load_prompts("builtin", 3) == list(BUILTIN_PROMPTS[:3])
    assert load_prompts("builtin", 100) == list(BUILTIN_PROMPTS)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        load_prompts("builtin", 0)


def test_txt_prompt_set_splits_on_blank_lines(tmp_path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("\n\nFirst problem,\nsecond line.  \n\n \n\nSecond problem.\n\nThird.", encoding="utf-8")
    assert load_prompts(str(path), 10) == ["First problem,\nsecond line.", "Second problem.", "Third."]
    assert load_prompts(str(path), 2) == ["First problem,\nsecond line.", "Second problem."]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(str(empty), 2)


def test_jsonl_prompt_set_reads_prompt_question_or_problem(tmp_path) -> None:
    path = tmp_path / "set.jsonl"
    rows = [{"prompt": "p", "question": "ignored"}, {"question": "q", "answer": 3}, {"problem": "r"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    assert load_prompts(str(path), 5) == ["p", "q", "r"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no field"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2: no string field prompt / question / problem"):
        load_prompts(str(bad), 5)


def test_unknown_or_missing_prompt_sets_fail_clearly(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown prompt set 'gsm9k'; use 'builtin'") as error:
        load_prompts("gsm9k", 2)
    assert ".txt file" in str(error.value) and ".jsonl" in str(error.value) and "gsm8k" in str(error.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.txt"), 2)


def test_task_prompt_set_uses_its_samples_and_explains_a_hub_failure(monkeypatch) -> None:
    from kvevict.bench.maths import GSM8K
    from kvevict.bench.task import Sample

    def fake(self, tokenizer, *, length, count, seed=0):
        return [Sample("gsm8k", i, f"problem {i}", "", "", ("1",), 8, str(i)) for i in range(count)]

    monkeypatch.setattr(GSM8K, "samples", fake)
    assert load_prompts("gsm8k", 2) == ["problem 0", "problem 1"]

    def offline(self, tokenizer, *, length, count, seed=0):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(GSM8K, "samples", offline)
    with pytest.raises(ValueError, match=r"task 'gsm8k' \(it loads from the Hugging Face hub.*no route to host"):
        load_prompts("gsm8k", 2)


# -- on the embedded model (its command line: tests/commands/test_analyze.py) -------------
@pytest.mark.slow
def test_recurrence_on_the_embedded_model(tmp_path, capsys) -> None:
    out, plot = tmp_path / "out", tmp_path / "mri.png"
    argv = ["analyze", "recurrence", "--model", "smollm2", "--prompt-set", "builtin", "--samples", "2"]
    argv += ["--max-new-tokens", "48", "--out", str(out), "--plot", str(plot), "--per-layer"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "recurrence.json").read_text())
    overall = summary["overall"]
    print(text)  # the numbers, with -s
    assert summary["prompts"] == 2 and summary["alpha"] == ALPHA_LLAMA and len(summary["layers"]) == 30
    entries = sum(p + n - 1 for p, n in zip(summary["prompt_tokens"], summary["new_tokens"]))
    assert overall["tokens"] == 30 * 3 * entries  # 30 layers × 3 KV heads, nothing evicted
    assert 1 <= overall["suggested_window"] == overall["percentiles_recurring"]["80"] <= 48
    assert 0 < overall["share_mri_gt_1"] <= overall["share_mri_gt_0"] <= 1
    assert f"suggested W = {overall['suggested_window']}" in text and "per layer" in text
    assert plot.read_bytes()[:4] == b"\x89PNG"
