import pytest

import kvevict
from kvevict.policies import POLICIES, parse_spec, split_names


def test_registry_lists_every_baseline() -> None:
    baselines = ["full", "random", "knorm", "streamingllm", "tova", "h2o", "snapkv"]
    assert kvevict.list_policies()[:7] == baselines
    assert {"lazyeviction", "raas", "rkv"} <= set(kvevict.list_policies())
    assert all(summary for _, summary in kvevict.describe_policies())


def test_every_policy_documents_its_paper() -> None:
    for cls in POLICIES.values():
        assert cls.__doc__ and len(cls.__doc__) > 30


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'snapkvv'; known policies: full, random, knorm, .*snapkv"):
        kvevict.make_policy("snapkvv")


def test_bad_parameters_name_the_policy() -> None:
    with pytest.raises(ValueError, match=r"snapkv: unknown parameter 'windw'; its parameters: window, kernel"):
        kvevict.make_policy("snapkv", windw=8)
    with pytest.raises(
        ValueError, match="streamingllm: parameter 'regime' expects one of 'both', 'prefill', 'decode', got 'sometimes'"
    ):
        kvevict.make_policy("streamingllm", regime="sometimes")
    with pytest.raises(ValueError, match="snapkv: parameter 'kernel' expects an odd integer >= 1, got 4"):
        kvevict.make_policy("snapkv", kernel=4)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("snapkv[window=abc]", "snapkv: parameter 'window' expects an integer >= 1, got 'abc'"),
        ("snapkv[window=8.0]", "snapkv: parameter 'window' expects an integer >= 1, got 8.0"),
        ("snapkv[window=true]", "snapkv: parameter 'window' expects an integer >= 1, got True"),
        ("snapkv[pool=median]", "snapkv: parameter 'pool' expects one of 'max', 'avg', got 'median'"),
        ("h2o[window=-1]", r"h2o: parameter 'window' expects an integer >= 0, or None \(min\(128, budget // 4\)\)"),
        ("momentkv[mi=yes]", "momentkv: parameter 'mi' expects true or false, got 'yes'"),
        ("lazyeviction[alpha=abc]", r"lazyeviction: parameter 'alpha' expects a number in \(0, 1\)"),
        ("epikv[layers=3]", "epikv: parameter 'layers' expects 2 layer indices"),
        ("critical+snapkv[critical.alpha=x]", r"critical: parameter 'alpha' expects a number in \[0, 1\], got 'x'"),
        ("headkv[headkv.beta=1]", r"headkv: parameter 'beta' expects a number > 1, got 1"),
        ("critical+snapkv[critical=5]", "parameters of critical go in a dict"),
    ],
)
def test_every_stage_checks_its_parameters_when_built(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvevict.make_policy(spec)


def test_budget_smaller_than_sinks_and_window_is_refused() -> None:
    from tests.conftest import tiny_model

    with pytest.raises(ValueError, match=r"budget 20 is smaller than h2o's sinks \(4\) \+ recent window \(30\) = 34"):
        kvevict.EvictionCache(tiny_model(), kvevict.make_policy("h2o", window=30), budget=20)


def test_cache_argument_errors() -> None:
    from tests.conftest import tiny_model

    model = tiny_model()
    with pytest.raises(ValueError, match="not both"):
        kvevict.EvictionCache(model, "snapkv", budget=64, keep=0.5)
    with pytest.raises(ValueError, match="'h2o' needs a budget: give budget= .* or keep="):
        kvevict.EvictionCache(model, "h2o")
    with pytest.raises(ValueError, match="interval must be an integer >= 1"):
        kvevict.EvictionCache(model, "h2o", budget=64, interval=0)


def test_a_spec_carries_parameters_for_the_policy_and_its_wrappers() -> None:
    assert parse_spec("h2o") == ("h2o", {})
    assert parse_spec("lazyeviction[window=22, alpha=1e-4]") == ("lazyeviction", {"window": 22, "alpha": 1e-4})
    assert parse_spec("critical+snapkv[critical.alpha=0,pool=avg,sinks=None]") == (
        "critical+snapkv",
        {"critical": {"alpha": 0}, "pool": "avg", "sinks": None},
    )
    assert parse_spec("momentkv[mi=false,nc=True]") == ("momentkv", {"mi": False, "nc": True})
    policy = kvevict.make_policy("critical+adakv+snapkv[critical.alpha=0,adakv.safeguard=0.1,window=16]")
    assert (policy.selector.alpha, policy.allocator.safeguard, policy.method.window) == (0, 0.1, 16)
    assert (
        kvevict.make_policy("lazyeviction[window=22]").params()
        == kvevict.make_policy("lazyeviction", window=22).params()
    )


def test_policy_lists_split_outside_brackets() -> None:
    assert split_names("full, h2o,lazyeviction[window=22,alpha=1e-4],,critical+snapkv[critical.alpha=0]") == (
        "full",
        "h2o",
        "lazyeviction[window=22,alpha=1e-4]",
        "critical+snapkv[critical.alpha=0]",
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("h2o[window=8", r"bad policy spec 'h2o\[window=8': write name\[key=value,...\] with one pair"),
        ("h2o[window]", r"bad parameter 'window' in policy spec 'h2o\[window\]': write key=value"),
        ("h2o[window=8,window=9]", r"parameter 'window' given twice"),
        ("h2o[windw=8]", r"h2o: unknown parameter 'windw'; its parameters: sinks, window, group, regime"),
        ("snapkvv[window=8]", r"unknown policy 'snapkvv'"),
    ],
)
def test_bad_specs_say_what_is_allowed(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvevict.make_policy(spec)


def test_a_parameter_in_the_spec_and_as_an_argument_is_refused() -> None:
    with pytest.raises(ValueError, match="parameters window of policy 'h2o' given both in its name and as arguments"):
        kvevict.make_policy("h2o[window=8]", window=9)
