import math

import pytest
import torch

import kvevict
from kvevict.bench.fidelity import fidelity_metrics, reference_logits, replay
from tests.conftest import prompt, tiny_model


def test_metrics_by_hand() -> None:
    # full: p = softmax([0, 1]) favours token 1; policy: q = [.75, .25] favours token 0; reference token 1
    metrics = fidelity_metrics(torch.tensor([[0.0, 1.0]]), torch.tensor([[math.log(3.0), 0.0]]), torch.tensor([1]))
    p = [1 / (1 + math.e), math.e / (1 + math.e)]
    assert metrics.top1 == 0.0  # the argmaxes differ
    assert metrics.kl == pytest.approx(p[0] * math.log(p[0] / 0.75) + p[1] * math.log(p[1] / 0.25), abs=1e-6)
    assert metrics.ppl == pytest.approx(4.0)  # exp(-ln .25)
    agree = fidelity_metrics(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 3.0]]), torch.tensor([0]))
    assert agree.top1 == 1.0  # same argmax, whatever token the reference text holds
    same = fidelity_metrics(torch.tensor([[2.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([0]))
    assert (same.top1, same.kl, same.tokens) == (1.0, 0.0, 1)


@pytest.mark.parametrize("step_by_step", [True, False])
def test_replay_without_eviction_reproduces_the_full_cache(step_by_step: bool) -> None:
    model = tiny_model()
    ids = prompt(60)
    answer = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 60:]
    expected = reference_logits(model, ids, answer)
    cache = kvevict.EvictionCache(model, "h2o", budget=500)
    logits = replay(model, cache, ids, answer, step_by_step=step_by_step)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    metrics = fidelity_metrics(expected, logits, answer)
    assert metrics.top1 == 1.0 and metrics.kl < 1e-6


def test_step_by_step_replay_evicts_exactly_as_generation_does() -> None:
    """Replaying a policy's own greedy answer gives the logits it generated with."""
    model = tiny_model()
    ids = prompt(96)
    out = model.generate(
        ids,
        past_key_values=kvevict.EvictionCache(model, "tova", budget=40),
        max_new_tokens=30,
        min_new_tokens=30,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    answer = out.sequences[0, 96:]
    logits = replay(model, kvevict.EvictionCache(model, "tova", budget=40), ids, answer, step_by_step=True)
    torch.testing.assert_close(logits, torch.cat(out.logits), rtol=0, atol=1e-5)


def test_long_decode_time_generation_loses_fidelity_under_a_tight_budget() -> None:
    model = tiny_model()
    ids = prompt(40)
    answer = model.generate(ids, max_new_tokens=200, min_new_tokens=200, do_sample=False, pad_token_id=0)[0, 40:]
    expected = reference_logits(model, ids, answer)
    tight = replay(model, kvevict.EvictionCache(model, "streamingllm", budget=16), ids, answer, step_by_step=True)
    loose = replay(model, kvevict.EvictionCache(model, "streamingllm", budget=400), ids, answer, step_by_step=True)
    assert fidelity_metrics(expected, tight, answer).kl > fidelity_metrics(expected, loose, answer).kl
    assert fidelity_metrics(expected, loose, answer).top1 == 1.0


def test_teacher_forcing_the_full_cache_against_itself_is_exact_and_blocks_change_nothing() -> None:
    """Fidelity 1 / KL 0 for the full cache against itself, in a left-padded batch; and a policy's
    figures equal a token-by-token replay of each row alone (the full cache fed in blocks gives
    what one token per pass gives)."""
    import kvevict
    from kvevict.bench.fidelity import FULL_BLOCK, fidelity_metrics, replay, teacher_forced
    from tests.conftest import prompt, tiny_model

    model = tiny_model()
    prompts = [prompt(n, seed=seed) for seed, n in enumerate((30, 24))]
    length = FULL_BLOCK + 9  # across a block boundary
    sequences = [torch.randint(5, 90, (length,), generator=torch.Generator().manual_seed(s)).tolist() for s in (0, 1)]
    full = teacher_forced(model, prompts, sequences, lambda: kvevict.EvictionCache(model, "full"))
    assert [top1 for top1, _ in full] == [1.0, 1.0] and all(kl < 1e-6 for _, kl in full)
    rows = teacher_forced(model, prompts, sequences, lambda: kvevict.EvictionCache(model, "tova", budget=20))
    for ids, tokens, (top1, kl) in zip(prompts, sequences, rows):
        answer = torch.tensor(tokens)
        policy = replay(model, kvevict.EvictionCache(model, "tova", budget=20), ids, answer, step_by_step=True)
        reference = replay(model, kvevict.EvictionCache(model, "full"), ids, answer, step_by_step=True)
        alone = fidelity_metrics(reference, policy, answer)
        assert top1 == pytest.approx(alone.top1) and kl == pytest.approx(alone.kl, rel=1e-4, abs=1e-6)
