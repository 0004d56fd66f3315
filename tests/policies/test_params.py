"""Parameters of policy stages (kvevict.policies.params): what each kind accepts, how it is
converted, and the one-line error a bad value gets (the stage, the parameter, what is allowed,
what was given). The same errors reached through specs: tests/policies/test_registry.py."""

from __future__ import annotations

import math

import pytest

from kvevict.policies.params import (
    Param,
    choice,
    declare,
    flag,
    integer,
    is_integer,
    is_number,
    layer_indices,
    number,
)


def refusal(param: Param, value: object) -> str:
    with pytest.raises(ValueError) as refused:
        param.check("stage", "p", value)
    return str(refused.value)


def test_integers_and_numbers_are_not_booleans() -> None:
    assert is_integer(3) and is_integer(-2) and not is_integer(True) and not is_integer(3.0) and not is_integer("3")
    assert is_number(3) and is_number(0.5) and not is_number(False)
    assert not any(is_number(v) for v in (math.nan, math.inf, -math.inf, "0.5", None))


def test_an_integer_at_or_above_its_lower_end() -> None:
    window = integer(8, low=1)
    assert window.default == 8 and window.check("stage", "p", 1) == 1 and window.check("stage", "p", 300) == 300
    for value in (0, -1, 8.0, True, "abc", None):
        assert refusal(window, value) == f"stage: parameter 'p' expects an integer >= 1, got {value!r}"


def test_an_odd_integer() -> None:
    kernel = integer(7, low=1, odd=True)
    assert kernel.check("stage", "p", 5) == 5
    assert refusal(kernel, 4) == "stage: parameter 'p' expects an odd integer >= 1, got 4"
    assert refusal(kernel, -1) == "stage: parameter 'p' expects an odd integer >= 1, got -1"


def test_unset_allows_none_and_says_what_it_stands_for() -> None:
    window = integer(None, low=0, unset="min(128, budget // 4)")
    assert window.check("stage", "p", None) is None and window.check("stage", "p", 0) == 0
    assert refusal(window, -1) == (
        "stage: parameter 'p' expects an integer >= 0, or None (min(128, budget // 4)), got -1"
    )


@pytest.mark.parametrize(
    ("param", "expects", "accepted", "refused"),
    [
        (number(0.5, 0, 1), "a number in [0, 1]", (0, 0.5, 1), (-0.1, 1.5)),
        (number(0.5, 0, 1, open_low=True, open_high=True), "a number in (0, 1)", (1e-9, 0.5), (0, 1, 0.0, 1.0)),
        (number(0.5, 0, 1, open_high=True), "a number in [0, 1)", (0, 0.99), (1,)),
        (number(2.0, 1, open_low=True), "a number > 1", (1.5, 1e9), (1, 0.5)),
        (number(0.0, 0.25), "a number >= 0.25", (0.25, 7), (0.2,)),
    ],
)
def test_a_number_within_its_ends(param: Param, expects: str, accepted: tuple, refused: tuple) -> None:
    for value in accepted:
        checked = param.check("stage", "p", value)
        assert checked == value and type(checked) is float  # integers given are stored as numbers
    for value in (*refused, math.nan, math.inf, True, "0.5"):
        assert refusal(param, value) == f"stage: parameter 'p' expects {expects}, got {value!r}"


def test_a_choice_lists_its_options() -> None:
    pool = choice("max", "max", "avg")
    assert pool.default == "max" and pool.check("stage", "p", "avg") == "avg"
    assert refusal(pool, "median") == "stage: parameter 'p' expects one of 'max', 'avg', got 'median'"
    allocation = choice(None, "uniform", "adakv", unset="the method's own")
    assert allocation.check("stage", "p", None) is None
    assert refusal(allocation, 1) == (
        "stage: parameter 'p' expects one of 'uniform', 'adakv', or None (the method's own), got 1"
    )


def test_a_flag_is_true_or_false_only() -> None:
    mi = flag(True)
    assert mi.default is True and mi.check("stage", "p", False) is False
    for value in (1, 0, "yes", "true", None):
        assert refusal(mi, value) == f"stage: parameter 'p' expects true or false, got {value!r}"


def test_layer_indices_of_a_fixed_count_become_a_tuple() -> None:
    layers = layer_indices(2)
    assert layers.default is None and layers.check("stage", "p", None) is None
    assert layers.check("stage", "p", [3, 0]) == (3, 0)
    expects = "2 layer indices (integers >= 0), or None (scaled from the model's depth)"
    for value in ([3], [1, 2, 3], [], [-1, 2], [1, 2.0], 3, "3,4"):
        assert refusal(layers, value) == f"stage: parameter 'p' expects {expects}, got {value!r}"


def test_layer_indices_of_any_count() -> None:
    layers = layer_indices()
    assert layers.check("stage", "p", (5,)) == (5,) and layers.check("stage", "p", [1, 2, 3]) == (1, 2, 3)
    assert refusal(layers, []) == (
        "stage: parameter 'p' expects a list of layer indices (integers >= 0), or None (scaled from the model's "
        "depth), got []"
    )


def test_declared_parameters_keep_their_order_and_are_read_only() -> None:
    params = declare(window=integer(8, low=1), kernel=integer(7, low=1, odd=True), pool=choice("max", "max", "avg"))
    assert list(params) == ["window", "kernel", "pool"]
    with pytest.raises(TypeError):
        params["window"] = integer(4)  # type: ignore[index]
