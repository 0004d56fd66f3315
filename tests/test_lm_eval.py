"""kvevict as an lm-evaluation-harness model, on the offline tasks of kvevict/lm_eval_tasks (its
command line: tests/commands/test_lm_eval.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed: pip install 'kvevict[lm-eval]'")

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from kvevict.lm_eval import TASKS, KvevictLM
from tests.conftest import tiny_model

LONG, SHORT, GENERATE, ROLLING = "kvevict_niah_long", "kvevict_niah_short", "kvevict_niah_long_gen", "kvevict_essays"
pytestmark = [
    pytest.mark.usefixtures("hub_offline"),
    pytest.mark.xdist_group("lm-eval"),  # under `make test`'s workers, lm-eval indexes its tasks (~10 s) on one
]


@pytest.fixture(scope="module")
def tasks() -> TaskManager:
    return TaskManager(include_path=str(TASKS))


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A tiny random Llama over the SmolLM2 vocabulary: real text in, deterministic scores out, fast."""
    return tiny_model(vocab=len(tokenizer))


def evaluate(lm, tasks: TaskManager, names: list[str], limit: int) -> dict:
    """lm-eval's results for ``names`` (the first ``limit`` documents each) with every request's responses."""
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=tasks, limit=limit, log_samples=True)


def responses(results: dict, name: str) -> list:
    """Each request's raw response (log-likelihoods, greedy flags, generated text), in document order."""
    samples = sorted(results["samples"][name], key=lambda sample: sample["doc_id"])
    return [response for sample in samples for response in sample["resps"]]


def log_likelihoods(results: dict, name: str) -> torch.Tensor:
    values = [
        response[0] if isinstance(response[0], float) else response[0][0] for response in responses(results, name)
    ]
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.slow
def test_full_gives_the_hf_model_s_numbers_on_the_embedded_model(smollm2, tasks) -> None:
    model, tokenizer = smollm2
    hf = evaluate(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4), tasks, [SHORT], limit=4)
    ours = evaluate(KvevictLM(pretrained=model, tokenizer=tokenizer, batch_size=4), tasks, [SHORT], limit=4)
    assert ours["results"][SHORT]["acc,none"] == hf["results"][SHORT]["acc,none"] == 1.0
    torch.testing.assert_close(log_likelihoods(ours, SHORT), log_likelihoods(hf, SHORT), rtol=0, atol=1e-4)
    assert [greedy for ((_, greedy),) in responses(ours, SHORT)] == [greedy for ((_, greedy),) in responses(hf, SHORT)]


def test_full_gives_the_hf_model_s_numbers_for_every_request_type(tiny, tokenizer, tasks) -> None:
    hf = evaluate(HFLM(pretrained=tiny, tokenizer=tokenizer, batch_size=2), tasks, [LONG, GENERATE, ROLLING], 2)
    ours = evaluate(KvevictLM(pretrained=tiny, tokenizer=tokenizer, batch_size=2), tasks, [LONG, GENERATE, ROLLING], 2)
    torch.testing.assert_close(log_likelihoods(ours, LONG), log_likelihoods(hf, LONG), rtol=0, atol=1e-4)
    torch.testing.assert_close(log_likelihoods(ours, ROLLING), log_likelihoods(hf, ROLLING), rtol=1e-6, atol=1e-4)
    assert responses(ours, GENERATE) == responses(hf, GENERATE)
    assert ours["results"][LONG]["acc,none"] == hf["results"][LONG]["acc,none"]


def test_eviction_changes_the_scores_of_a_long_context_only(tiny, tokenizer, tasks) -> None:
    names = [SHORT, LONG, ROLLING]
    full = evaluate(KvevictLM(pretrained=tiny, tokenizer=tokenizer, batch_size=4), tasks, names, 2)
    evicted = evaluate(
        KvevictLM(pretrained=tiny, tokenizer=tokenizer, policy="snapkv", budget=160, batch_size=4), tasks, names, 2
    )
    assert torch.equal(log_likelihoods(evicted, SHORT), log_likelihoods(full, SHORT))  # ~110 tokens < budget
    for name in (LONG, ROLLING):  # ~740 and ~500 tokens
        assert (log_likelihoods(evicted, name) - log_likelihoods(full, name)).abs().min() > 1e-3


@pytest.mark.parametrize("chunk", [None, 48])
def test_batch_size_does_not_change_the_numbers(tiny, tokenizer, tasks, chunk) -> None:
    names = [LONG, GENERATE] + ([ROLLING] if chunk else [])  # rolling texts are always chunked
    settings = {"policy": "snapkv", "budget": 96, "prefill_chunk": chunk}
    one = evaluate(KvevictLM(pretrained=tiny, tokenizer=tokenizer, batch_size=1, **settings), tasks, names, 4)
    four = evaluate(KvevictLM(pretrained=tiny, tokenizer=tokenizer, batch_size=4, **settings), tasks, names, 4)
    for name in names[::2]:
        torch.testing.assert_close(log_likelihoods(four, name), log_likelihoods(one, name), rtol=1e-6, atol=1e-4)
    assert responses(four, GENERATE) == responses(one, GENERATE)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"colour": "red"}, "unknown model arg colour; allowed: pretrained, tokenizer, policy, budget, keep"),
        ({"policy": "snapkv"}, "needs model arg budget= .tokens. or keep="),
        ({"policy": "snapkv", "budget": "many"}, "budget must be an integer >= 1, got 'many'"),
        ({"policy": "snapkv", "keep": 1.5}, "keep"),
        ({"policy": "kvzip", "budget": 64, "prefill_chunk": 32}, "cannot compress a prompt chunk by chunk"),
        ({"policy": "no-such-policy", "budget": 64}, "no-such-policy"),
        ({"interval": 0}, "interval must be an integer >= 1"),
    ],
)
def test_bad_model_args_are_refused_in_one_line(tiny, tokenizer, args, message) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        KvevictLM(pretrained=tiny, tokenizer=tokenizer, **args)
    assert "\n" not in str(refused.value)


def test_a_policy_that_scores_each_row_alone_is_run_one_request_at_a_time(tiny, tokenizer, tasks) -> None:
    """kvzip in bf16 would prefill each row of a batch a second time, alone: one by one is cheaper."""
    lm = KvevictLM(pretrained=tiny, tokenizer=tokenizer, policy="kvzip[precision=bf16]", budget=64, batch_size=4)
    assert lm.batch_size == 1
    assert torch.isfinite(log_likelihoods(evaluate(lm, tasks, [LONG], 2), LONG)).all()
    assert (
        KvevictLM(
            pretrained=tiny, tokenizer=tokenizer, policy="kvzip[precision=fp32]", budget=64, batch_size=4
        ).batch_size
        == 4
    )


def test_a_pool_allocated_chunk_by_chunk_takes_chunks_where_kvzips_pool_is_refused(tiny, tokenizer) -> None:
    """``global+X`` (and ``fastkvzip``'s pool) evict after every chunk, so the harness's chunked
    prompts (``prefill_chunk``, rolling windows) are accepted; KVzip's pooled repeat is not."""
    KvevictLM(pretrained=tiny, tokenizer=tokenizer, policy="global+snapkv", budget=64, prefill_chunk=32)
    with pytest.raises(ValueError, match="cannot compress a prompt chunk by chunk"):
        KvevictLM(pretrained=tiny, tokenizer=tokenizer, policy="kvzip", budget=64, prefill_chunk=32)
