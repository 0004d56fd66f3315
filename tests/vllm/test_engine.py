"""The plug-in in a running vLLM engine (CPU, fp32): an ample budget is vLLM alone; under
eviction it keeps the entries kvevict's own cache keeps and gives its tokens (the cross-host
contract), for requests of different lengths served at once and for one that arrives while
others decode; evicted blocks go back to the pool, and nothing leaks."""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("vllm")

import kvevict
from kvevict.policies import make_policy
from kvevict.vllm.config import SUPPORTED
from tests.vllm.conftest import ENGINE_ARGS, core, engine, kvevict_reference, runner, serve

BUDGET, INTERVAL, NEW_TOKENS = 48, 8, 40
SEEDS = ("lazyeviction", "epikv")
"""The seeds' methods that evict while decoding, run on SmolLM2 too (LazyEviction's baseline R-KV shares its path:
on the tiny model)."""
NEW_LONG = 300


def prompts_of(tokenizer_dir, lengths: dict[str, int]) -> dict[str, list[int]]:
    """Prompts of the given lengths: the start of the offline essays, each from another offset."""
    from transformers import AutoTokenizer

    from kvevict.bench.haystack import essays

    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(essays()[:20000]).input_ids
    starts = [(100 * i) % (len(ids) - max(lengths.values())) for i in range(len(lengths))]
    return {name: ids[start : start + length] for start, (name, length) in zip(starts, lengths.items())}


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model_dir(request, tiny_llama_dir, smollm2_dir):
    return {"tiny": tiny_llama_dir, "smollm2": smollm2_dir}[request.param]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return kvevict.load_model(str(model_dir))[0]


def test_an_ample_budget_is_vllm_alone(model_dir) -> None:
    prompts = prompts_of(model_dir, {"a": 70, "b": 130})
    with engine(model_dir) as alone:
        expected = serve(alone, prompts, NEW_TOKENS)
    with engine(model_dir, "h2o", budget=1024) as plugged:
        got = serve(plugged, prompts, NEW_TOKENS)
        assert runner(plugged).kept("a") is not None  # the plug-in ran, and evicted nothing
    for name in prompts:
        assert got[name].tokens == expected[name].tokens
        assert got[name].logprobs == expected[name].logprobs


@pytest.mark.parametrize(
    ("policy", "interval"),
    [
        *((policy, INTERVAL) for policy in SUPPORTED),
        ("lazyeviction", None),
        ("rkv", None),
        ("epikv", None),
    ],  # None: its own
)
def test_vllm_keeps_what_kvevict_keeps_and_gives_its_tokens(
    policy: str, interval: int | None, model_dir, hf_model, tiny_llama_dir
) -> None:
    """Three requests of different lengths (one shorter than the budget, evicting only while it
    decodes); a fourth arrives after five steps, while the others decode. A method's own interval
    is checked on the tiny model; SmolLM2 runs the seeds' methods at the given one."""
    if interval is None and model_dir != tiny_llama_dir:
        pytest.skip("a method's own interval is checked on the tiny model")
    if model_dir != tiny_llama_dir and policy not in SEEDS:
        pytest.skip("SmolLM2 runs the seeds' own methods; the others on the tiny model (TOVA: test_server)")
    prompts = prompts_of(model_dir, {"short": 30, "long": 150, "middle": 90, "late": 110})
    block_size = ENGINE_ARGS["block_size"]
    most_blocks = math.ceil((BUDGET + (interval or make_policy(policy).default_interval(BUDGET) or 1)) / block_size) + 1
    free_at_start = {}

    def blocks_bounded(llm) -> None:
        scheduler = core(llm).scheduler
        manager = scheduler.kv_cache_manager
        free_at_start.setdefault("blocks", manager.block_pool.get_num_free_blocks())
        for request in scheduler.running:
            # its prompt compressed: at prefill, or (a decode-time policy) by its first eviction
            if manager.held(request) < request.num_computed_tokens:
                held = manager.coordinator.single_type_managers[0].req_to_blocks[request.request_id]
                assert len(held) <= most_blocks, (request.request_id, request.num_computed_tokens, len(held))

    with engine(model_dir, policy, budget=BUDGET, interval=interval) as llm:
        pool = core(llm).scheduler.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        got = serve(llm, prompts, NEW_TOKENS, arrivals={"late": 5}, after_step=blocks_bounded)
        kept = {name: runner(llm).kept(name) for name in prompts}
        assert pool.get_num_free_blocks() == free  # every block came back
    for name, ids in prompts.items():
        reference = kvevict_reference(hf_model, ids, policy, NEW_TOKENS, budget=BUDGET, interval=interval)
        assert kept[name] == reference.kept, f"{policy}: {name} keeps other entries than kvevict's cache"
        assert got[name].tokens == reference.tokens, f"{policy}: {name}"
        assert max(abs(a - b) for a, b in zip(got[name].logprobs, reference.logprobs)) < 1e-4


def test_two_hundred_requests_leak_no_block(tiny_llama_dir) -> None:
    prompts = prompts_of(tiny_llama_dir, {f"r{i}": 20 + (i * 7) % 90 for i in range(200)})
    with engine(tiny_llama_dir, "streamingllm", budget=16, interval=4) as llm:
        pool = core(llm).scheduler.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        got = serve(llm, prompts, 12)
        assert len(got) == 200 and all(len(g.tokens) == 12 for g in got.values())
        assert pool.get_num_free_blocks() == free
        assert not core(llm).scheduler.kv_cache_manager.schedules
        # the worker hears of the last ones' end with the next step, as vLLM's own runner does
        assert set(runner(llm).entries) <= set(runner(llm).requests)


def test_evicting_requests_are_admitted_while_the_pool_holds_their_peaks(tiny_llama_dir, hf_model_tiny) -> None:
    """Eight TOVA requests whose prompts take 2 blocks each and who grow back to 96 entries (3
    blocks) between evictions, in a pool of 17: vLLM alone would admit all eight and preempt; the
    plug-in admits five at a time (each one's peak and the others' fit), preempts none, and each
    gives kvevict's tokens."""
    prompts = prompts_of(tiny_llama_dir, {f"r{i}": 40 + i for i in range(8)})
    running, preempted = [], []

    def watch(llm) -> None:
        scheduler = core(llm).scheduler
        running.append(len(scheduler.running))
        preempted.extend(r.request_id for r in scheduler.running if r.num_preemptions)

    with engine(tiny_llama_dir, "tova", blocks=17, budget=80, interval=16) as llm:
        got = serve(llm, prompts, 100, after_step=watch)
    assert max(running) == 5 and not preempted
    for name, ids in prompts.items():
        reference = kvevict_reference(hf_model_tiny, ids, "tova", 100, budget=80, interval=16)
        assert got[name].tokens == reference.tokens


def test_a_preempted_request_is_computed_again_and_keeps_the_schedule_s_count(tiny_llama_dir, hf_model_tiny) -> None:
    """SnapKV evicts only the prompt. A short prompt under the budget never evicts, so it is
    admitted as vLLM admits (nothing reserved for its growth) and outgrows a pool of 17 blocks
    beside a long one, and vLLM preempts: computed again from its tokens as one pass, a request
    evicts down to the schedule's count in that pass, the others keep kvevict's tokens, and the
    pool is whole at the end."""
    prompts = prompts_of(tiny_llama_dir, {"short": 30, "a": 100, "b": 110})
    preempted: set[str] = set()

    def watch(llm) -> None:
        preempted.update(r.request_id.rsplit("-", 1)[0] for r in core(llm).scheduler.running if r.num_preemptions)

    with engine(tiny_llama_dir, "snapkv", blocks=17, budget=BUDGET) as llm:
        pool = core(llm).scheduler.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        got = serve(llm, prompts, NEW_LONG, after_step=watch)
        assert pool.get_num_free_blocks() == free
        kept = {name: runner(llm).kept(name) for name in prompts}
    assert preempted and len(preempted) < len(prompts)
    for name, ids in prompts.items():
        assert len(got[name].tokens) == NEW_LONG
        # the prompt evicted to the budget (if over it), then every token kept (the last unprocessed)
        held = min(len(ids), BUDGET) + NEW_LONG - 1
        assert {len(head) for layer in kept[name] for head in layer} == {held}
        if name not in preempted:
            assert got[name].tokens == kvevict_reference(hf_model_tiny, ids, "snapkv", NEW_LONG, budget=BUDGET).tokens


@pytest.fixture(scope="module")
def hf_model_tiny(tiny_llama_dir):
    return kvevict.load_model(str(tiny_llama_dir))[0]


def test_a_request_runs_at_its_own_budget_or_without_eviction(tiny_llama_dir, hf_model_tiny) -> None:
    """Under an engine that evicts with TOVA at 48, a request asking for 64 keeps what kvevict's
    cache keeps at 64, and one asking for 'full' what it keeps without eviction, beside one that
    asks for nothing; a request asking for another policy is refused when it is added."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    prompts = prompts_of(tiny_llama_dir, {"engine": 90, "own": 100, "full": 110})
    asked = {"engine": None, "own": {"kvevict": {"budget": 64}}, "full": {"kvevict": {"policy": "full"}}}
    with engine(tiny_llama_dir, "tova", budget=BUDGET, interval=INTERVAL) as llm:
        for name, ids in prompts.items():
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args=asked[name])
            llm.llm_engine.add_request(name, {"prompt_token_ids": ids}, params)
        got = {}
        while llm.llm_engine.has_unfinished_requests():
            for output in llm.llm_engine.step():
                if output.finished:
                    got[output.request_id] = list(output.outputs[0].token_ids)
        kept = {name: runner(llm).kept(name) for name in prompts}
        refused = SamplingParams(max_tokens=4, extra_args={"kvevict": {"policy": "h2o"}})
        with pytest.raises(
            VLLMValidationError, match="this engine evicts with 'tova': a request may ask for it or for 'full'"
        ):
            llm.generate([{"prompt_token_ids": prompts["engine"]}], refused)
    settings = {"engine": ("tova", BUDGET), "own": ("tova", 64), "full": ("full", None)}
    for name, ids in prompts.items():
        policy, budget = settings[name]
        interval = INTERVAL if budget else None
        reference = kvevict_reference(hf_model_tiny, ids, policy, NEW_TOKENS, budget=budget, interval=interval)
        assert got[name] == reference.tokens, name
        assert kept[name] == reference.kept, name


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two workers need two cores")
def test_tensor_parallel_workers_each_evict_their_own_heads(tiny_llama_dir, hf_model_tiny, monkeypatch) -> None:
    """Tensor parallelism of 2: each worker holds one of the tiny model's two KV heads and evicts it
    under the request's one count; together they keep what kvevict's cache keeps and give its tokens."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a core each (vLLM's CPU workers bind by NUMA node)
    prompts = prompts_of(tiny_llama_dir, {"a": 90, "b": 120})
    parallel = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    with engine(tiny_llama_dir, "h2o", budget=BUDGET, interval=INTERVAL, **parallel) as llm:
        got = serve(llm, prompts, NEW_TOKENS)
        halves = {name: llm.collective_rpc("kvevict_kept", args=(name,)) for name in prompts}
    for name, ids in prompts.items():
        first, second = halves[name]
        kept = [mine + theirs for mine, theirs in zip(first, second)]  # worker 0 holds head 0, worker 1 head 1
        reference = kvevict_reference(hf_model_tiny, ids, "h2o", NEW_TOKENS, budget=BUDGET, interval=INTERVAL)
        assert kept == reference.kept, name
        assert got[name].tokens == reference.tokens, name
