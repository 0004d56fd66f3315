import warnings

import torch
import transformers
from packaging.version import Version

import kvevict
from kvevict.compat import CACHE_ARGUMENT, multiplies_bf16_natively, pass_cache, with_cache
from kvevict.generation import prefill
from tests.conftest import prompt, tiny_model


def test_the_pass_cache_is_found_under_either_name_transformers_gives_it() -> None:
    cache = object()
    assert pass_cache({"cache": cache}) is cache  # transformers >= 5.24
    assert pass_cache({"past_key_values": cache, "use_cache": True}) is cache  # before
    assert pass_cache({"input_ids": None}) is None


def test_the_cache_goes_under_the_name_the_installed_transformers_expects() -> None:
    renamed = Version(transformers.__version__) >= Version("5.24")
    assert CACHE_ARGUMENT == ("cache" if renamed else "past_key_values")
    cache = object()
    assert with_cache(cache) == {CACHE_ARGUMENT: cache}


def test_kvevict_own_calls_raise_no_warning_about_the_cache_argument() -> None:
    model = tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with kvevict.EvictionCache(model, "h2o", budget=12) as cache:
            prefill(model, prompt(20), cache)
            assert max(cache.layer_lengths()) == 12  # the pass went through the cache, which evicted
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_bf16_in_hardware_is_read_from_the_cpu_and_never_claimed_elsewhere(monkeypatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert multiplies_bf16_natively(torch.device("cpu"))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not multiplies_bf16_natively(torch.device("cpu"))
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")  # a torch without the probe reads as no
    assert not multiplies_bf16_natively(torch.device("cpu"))
    assert not multiplies_bf16_natively(torch.device("meta"))
