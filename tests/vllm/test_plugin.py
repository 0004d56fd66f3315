"""The plug-in's hold on vLLM: its entry point, the one function it wraps (this test fails when
vLLM changes it), and every engine it cannot honour refused in one line when the engine's
configuration is built (no engine starts)."""

from __future__ import annotations

import hashlib
import inspect
from importlib.metadata import entry_points

import pytest

vllm = pytest.importorskip("vllm")

from vllm import EngineArgs
from vllm.config import CompilationMode, VllmConfig

import kvevict.vllm
from kvevict.vllm import plugin
from kvevict.vllm.config import SCHEDULER, WORKER, EngineRefused

WRAPPED_SOURCE = "a3cf210dbc5dbd3c"
"""SHA-256 (first 16 digits) of vLLM 0.32.0's ``VllmConfig.try_verify_and_update_config`` source."""


def test_the_entry_point_registers_the_plug_in() -> None:
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvevict"]
    assert entry.value == "kvevict.vllm.plugin:register"


def test_the_wrapped_function_is_the_one_it_was_written_against() -> None:
    """If vLLM changes the function, or stops calling it from ``VllmConfig.__post_init__`` before
    the platform's checks (which resolve the worker class), the wrap must be looked at again."""
    plugin.register()
    plugin.register()  # vLLM loads plug-ins in each process, maybe more than once: one wrap
    wrapped = getattr(VllmConfig, plugin.WRAPPED)
    assert wrapped.kvevict_configure and not getattr(wrapped.__wrapped__, "kvevict_configure", False)
    assert vllm.__version__ == "0.32.0"
    assert hashlib.sha256(inspect.getsource(wrapped.__wrapped__).encode()).hexdigest()[:16] == WRAPPED_SOURCE
    post_init = inspect.getsource(VllmConfig.__post_init__)
    assert post_init.index("self.try_verify_and_update_config()") < post_init.index(
        "current_platform.check_and_update_config(self)"
    )


def config(model, **changes):
    args = {
        "model": str(model),
        "dtype": "float32",
        **kvevict.vllm.ENGINE_FLAGS,
        "additional_config": {"kvevict": {"policy": "h2o", "budget": 64}},
    }
    return EngineArgs(**{**args, **changes}).create_engine_config()


def test_an_engine_that_asks_for_it_gets_its_scheduler_and_worker_and_runs_eagerly(smollm2_dir) -> None:
    engine = config(smollm2_dir, enforce_eager=False)  # a plain vllm.LLM's default
    assert (engine.scheduler_config.scheduler_cls, engine.parallel_config.worker_cls) == (SCHEDULER, WORKER)
    assert engine.model_config.enforce_eager and engine.compilation_config.mode == CompilationMode.NONE
    plain = config(smollm2_dir, additional_config={})
    assert (plain.scheduler_config.scheduler_cls, plain.parallel_config.worker_cls) != (SCHEDULER, WORKER)


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory, smollm2_dir):
    """A tiny random Mistral whose layers attend a sliding window."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    path = tmp_path_factory.mktemp("sliding")
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=64,
    )
    MistralForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"enable_prefix_caching": True}, "prefix caching shares blocks between requests"),
        ({"enable_chunked_prefill": True}, "chunked prefill is not supported"),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
            "speculative",
        ),
        ({"kv_cache_dtype": "fp8"}, "a quantized KV cache (fp8) is not supported"),
        ({"pipeline_parallel_size": 2}, "pipeline parallelism is not supported"),
        (
            {"tensor_parallel_size": 2, "additional_config": {"kvevict": {"policy": "tova", "budget": 64}}},
            "tova reads every KV head of a layer to score one, and tensor parallelism splits the heads",
        ),
        ({"worker_cls": "my.Worker"}, "it brings its own worker class"),
        (
            {"additional_config": {"kvevict": {"policy": "adakv+snapkv", "budget": 64}}},
            "not in vLLM's per-request block layout; use a uniform budget",
        ),
        ({"additional_config": {"kvevict": {"policy": "h2o", "budget": 64, "x": 1}}}, "unknown settings ['x']"),
    ],
)
def test_what_it_cannot_honour_is_refused_in_one_line(changes, message: str, smollm2_dir) -> None:
    with pytest.raises(EngineRefused) as refused:
        config(smollm2_dir, **changes)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_sliding_window_model_is_refused(sliding_dir) -> None:
    with pytest.raises(EngineRefused, match="sliding-window models are not supported"):
        config(sliding_dir)


def test_another_vllm_version_is_refused(smollm2_dir, monkeypatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(EngineRefused, match=r"it needs vLLM 0\.32\.x, found 0\.33\.1"):
        config(smollm2_dir)
