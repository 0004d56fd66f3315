"""What the vLLM plug-in's tests share: engines run in this process (their scheduler and worker
are inspected between steps), the embedded SmolLM2 and a tiny random Llama as local directories,
and kvevict's own cache as the reference every engine is compared with.

The modules that start engines need vLLM (``make test`` runs them in ``.venv-vllm``); elsewhere
they are skipped."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core and its worker in this process
ENGINE_ARGS = {
    "dtype": "float32",
    "block_size": 32,
    "max_model_len": 512,
    "gpu_memory_utilization": 0.25,
    "num_gpu_blocks_override": 96,
    "seed": 0,
}
"""fp32, blocks of 32 (the CPU kernels' smallest), a small pool."""


SOCKET_NAME, SOCKET_PATH_MAX = 36, 103
"""vLLM names a socket by a UUID (36 characters); a socket's path must fit ``sockaddr_un`` (104 bytes with its
terminator on macOS, 108 on Linux)."""


@pytest.fixture(scope="session", autouse=True)
def vllm_files_in_pytest_s_directory(tmp_path_factory) -> Iterator[None]:
    """vLLM leaves a socket (its ZMQ paths) or a rendezvous file (``file://`` init) in the temporary directory
    for every engine it starts, and ``vllm serve``'s processes too: here they go into pytest's own temporary
    directory, which pytest prunes, not into ``/tmp``."""
    directory = str(tmp_path_factory.mktemp("vllm"))
    with pytest.MonkeyPatch.context() as patch:
        if len(directory) + len("/") + SOCKET_NAME <= SOCKET_PATH_MAX:  # else a deep temporary directory (macOS's)
            patch.setattr(tempfile, "tempdir", directory)
            patch.setenv("TMPDIR", directory)
        yield


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from kvevict.models import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama (2 layers, 4 query heads over 2 KV heads of 32 channels) with SmolLM2's
    tokenizer, saved as a local directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@contextmanager
def engine(model: Path, policy: str | None = None, blocks: int | None = None, **settings: object) -> Iterator[object]:
    """An in-process ``vllm.LLM`` of ``model``: with the plug-in (``policy`` and its settings), or
    vLLM alone with the same engine flags, with a pool of ``blocks`` blocks (default: 96); shut
    down afterwards."""
    import vllm

    import kvevict.vllm

    args = {**ENGINE_ARGS, **({} if blocks is None else {"num_gpu_blocks_override": blocks})}
    # vLLM collects the whole heap several times while an engine starts (about half a second each with vLLM,
    # transformers and the tests' models loaded); what lives before it need not be scanned again. Its shutdown
    # unfreezes it all, so nothing stays uncollectable.
    gc.freeze()
    if policy is None:
        llm = vllm.LLM(model=str(model), enforce_eager=True, **kvevict.vllm.ENGINE_FLAGS, **args)  # as the plug-in runs
    else:
        llm = kvevict.vllm.LLM(str(model), policy, **settings, **args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def core(llm: object) -> object:
    """The in-process engine core (its ``scheduler`` and ``model_executor``)."""
    return llm.llm_engine.engine_core.engine_core


def runner(llm: object) -> object:
    """The in-process worker's model runner."""
    return core(llm).model_executor.driver_worker.worker.model_runner


@dataclass
class Generated:
    tokens: list[int]
    logprobs: list[float]
    kept: list[list[list[int]]] | None = None
    """Absolute positions each layer and KV head held at the end (``[layers][heads]``, ascending)."""


def serve(
    llm: object,
    prompts: dict[str, list[int]],
    new_tokens: int,
    arrivals: dict[str, int] | None = None,
    after_step=None,
) -> dict[str, Generated]:
    """Greedy generation of exactly ``new_tokens`` tokens for each prompt, stepping the engine by
    hand: a request listed in ``arrivals`` joins at that step (others at step 0); ``after_step(llm)``
    runs after every step."""
    from vllm import SamplingParams

    engine_ = llm.llm_engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    arrivals = arrivals or {}
    waiting = dict(sorted(prompts.items(), key=lambda item: arrivals.get(item[0], 0)))
    results: dict[str, Generated] = {}
    step = 0
    while waiting or engine_.has_unfinished_requests():
        for request_id in [r for r in waiting if arrivals.get(r, 0) <= step]:
            engine_.add_request(request_id, {"prompt_token_ids": waiting.pop(request_id)}, params)
        for output in engine_.step():
            if output.finished:
                completion = output.outputs[0]
                logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
                results[output.request_id] = Generated(list(completion.token_ids), logprobs)
        if after_step is not None:
            after_step(llm)
        step += 1
    return results


def kvevict_reference(model, ids: list[int], policy: str, new_tokens: int, **settings: object) -> Generated:
    """The same greedy generation through kvevict's own cache (transformers' ``generate``)."""
    import kvevict
    from kvevict.compat import with_cache

    cache = kvevict.EvictionCache(model, policy, **settings)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            **with_cache(cache),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,  # raw: min_new_tokens masks the end token in the processed scores
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [torch.log_softmax(logits[0].float(), -1)[token].item() for logits, token in zip(out.logits, tokens)]
    kept = []
    for layer in cache.eviction_layers:
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        kept.append([sorted(heads[held].tolist()) for heads, held in zip(layer.positions[0], valid[0])])
    cache.close()
    return Generated(tokens, logprobs, kept)
