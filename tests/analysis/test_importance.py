import json
import math

import pytest

from kvevict.analysis import importance
from kvevict.analysis.importance import (
    answer_boundary,
    average_ranks,
    extract_answer,
    labels_from_flips,
    make_problems,
    occlusion_windows,
    spearman,
)
from tests.conftest import tiny_model


@pytest.mark.parametrize(
    ("length", "windows"),
    [
        (64, [(0, 32), (16, 48), (32, 64)]),  # every interior token covered twice
        (40, [(0, 32), (16, 40)]),
        (10, [(0, 10)]),
    ],
)
def test_occlusion_windows(length: int, windows: list) -> None:
    assert occlusion_windows(length) == windows


def test_a_token_is_important_when_any_covering_window_flips() -> None:
    assert labels_from_flips(6, [(0, 4), (2, 6)], [False, True]) == [0, 0, 1, 1, 1, 1]
    assert labels_from_flips(6, [(0, 4), (2, 6)], [True, False]) == [1, 1, 1, 1, 0, 0]


def test_spearman_uses_average_ranks_for_ties() -> None:
    assert average_ranks([1, 2, 2, 3]) == [1, 2.5, 2.5, 4]
    assert spearman([1, 2, 2, 3], [0, 0, 1, 1]) == pytest.approx(3 / math.sqrt(18))
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1)
    assert math.isnan(spearman([1, 2, 3], [1, 1, 1]))


def test_answers_and_problems() -> None:
    assert extract_answer("5 + 3 = 8 so\nAnswer: 8.") == "8"
    assert extract_answer("the total is 12 apples") == "12"
    assert extract_answer(" no numbers ") == "no numbers"
    assert make_problems(3, seed=1) == make_problems(3, seed=1) != make_problems(3, seed=2)


def test_answer_boundary_is_the_last_answer_mark(tokenizer) -> None:
    generated = tokenizer("First 2 + 2 = 4.\nAnswer: 4", add_special_tokens=False).input_ids
    boundary = answer_boundary(tokenizer, generated, answer_tokens=3)
    assert tokenizer.decode(generated[:boundary]).rstrip() == "First 2 + 2 = 4."
    no_mark = tokenizer("just text here and more", add_special_tokens=False).input_ids
    assert answer_boundary(tokenizer, no_mark, answer_tokens=2) == len(no_mark) - 2


def test_labels_and_correlations_on_a_tiny_model(tokenizer, tmp_path, monkeypatch) -> None:
    model = tiny_model(vocab=len(tokenizer))
    options = {"window": 8, "stride": 4, "answer_tokens": 4}
    samples = importance.run_importance(
        model, tokenizer, tmp_path, samples=2, max_new_tokens=14, progress=False, **options
    )
    assert [s.index for s in samples] == [0, 1]
    for sample in samples:
        assert len(sample.labels) == len(sample.span_tokens) == len(sample.rolling_change[0])
        assert len(sample.rolling_change) == 2 and set(sample.labels) <= {0, 1}
        assert sample.labels == labels_from_flips(len(sample.labels), sample.windows, sample.flipped)
    # resumed: finished samples are not labelled again
    monkeypatch.setattr(importance, "label_sample", lambda *a, **k: pytest.fail("relabelled"))
    again = importance.run_importance(model, tokenizer, tmp_path, samples=2, max_new_tokens=14, progress=False)
    assert [s.labels for s in again] == [s.labels for s in samples]
    result = importance.summary(samples, "tiny")
    assert [c["layer"] for c in result["layers"]] == [0, 1]
    assert "rho(g_rolling)" in importance.format_summary(result)
    paths = importance.write_outputs(samples, result, tmp_path)
    assert all(path.is_file() for path in paths)
    assert json.loads((tmp_path / "importance.json").read_text())["tokens"] == sum(len(s.labels) for s in samples)
