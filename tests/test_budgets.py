import pytest

from kvevict.budgets import Budget


def test_tokens_and_fraction() -> None:
    assert Budget(tokens=64).resolve(1000) == 64
    assert Budget(keep=0.25).resolve(1000) == 250
    assert Budget(keep=0.001).resolve(10) == 1
    assert Budget().resolve(1000) is None and not Budget().given


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokens": 64, "keep": 0.5}, "either budget= .* or keep= .* not both"),
        ({"tokens": 0}, "positive integer"),
        ({"tokens": 2.5}, "positive integer"),
        ({"keep": 1.5}, r"fraction of the prompt in \(0, 1\]"),
        ({"keep": 0}, r"fraction of the prompt in \(0, 1\]"),
    ],
)
def test_bad_budgets_say_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Budget(**kwargs)
