"""kvevict as a model of EleutherAI's lm-evaluation-harness (``lm-eval``): any policy on any task.

Importing this module registers the model type ``kvevict`` with lm-eval (lm-eval 0.4 finds
models only through modules imported before it runs; no entry point, no patching)::

    import kvevict.lm_eval, lm_eval
    lm_eval.simple_evaluate(model="kvevict", model_args={"pretrained": "smollm2", "policy": "snapkv",
                            "budget": 64}, tasks=["kvevict_niah_long"])

or ``kvevict lm-eval --model_args pretrained=smollm2,policy=snapkv,budget=64 --tasks T`` (:func:`main`,
lm-eval's own command line with ``--model kvevict`` implied and the offline tasks of
``kvevict/lm_eval_tasks`` on its include path unless another is given).

:class:`KvevictLM` is lm-eval's ``hf`` model (:class:`HFLM`: the same tokenization, truncation,
request order, stop sequences and answer post-processing) whose three request types run through
an :class:`~kvevict.cache.EvictionCache`:

- ``loglikelihood``: every input token but the ``n`` of the continuation's positions is a prompt,
  prefilled and compressed under the policy (:func:`kvevict.generation.prefill`, chunked with
  ``prefill_chunk``); the last context token and the continuation are then fed through the
  compressed cache in one decode pass, whose logits score the continuation. Requests sharing all
  but the continuation's last token share one pass (multiple choice with one-token answers).
- ``loglikelihood_rolling``: the text (lm-eval's windows of it) is a prompt fed in chunks of
  ``prefill_chunk`` tokens (:data:`ROLLING_CHUNK` by default), evicted back to the budget after
  each, and every token is scored by the logits of its chunk.
- ``generate_until``: the prompt but its last token is prefilled under the policy; ``generate``
  continues from the compressed cache (decode-time policies keep evicting), lm-eval's stop
  sequences ending it.

Rows of a batch are left-padded; prompts prefilled in chunks are padded on the left to a whole
number of chunks (:func:`kvevict.batching.pad_to_multiple`), so each row gets the same chunks,
and the same scores, in a batch of any size. Policies that read hidden states by column allow no
padding after a prompt's first pass, and a policy that scores each row of a batch by prefilling it
again alone (KVzip in bf16) would pay a prefill more per row: both run one request at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.batching import left_padded, pad_to_multiple, padded_positions
from kvevict.budgets import Budget
from kvevict.cache import EvictionCache
from kvevict.compat import with_cache
from kvevict.generation import check_chunk, pad_token_id, prefill
from kvevict.models import load_model, tokenizer_of
from kvevict.policies import make_policy

try:
    from lm_eval.__main__ import cli_evaluate
    from lm_eval._cli.utils import MergeDictAction
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ModuleNotFoundError as err:  # the optional extra
    raise ModuleNotFoundError(
        f"kvevict's lm-eval model needs lm-evaluation-harness ({err.name} is missing): pip install 'kvevict[lm-eval]'"
    ) from err

TASKS = Path(__file__).parent / "lm_eval_tasks"
"""The offline tasks (YAML and JSON lines): ``--include_path`` of ``kvevict lm-eval`` by default."""
ROLLING_CHUNK = 128
"""Tokens per chunk of a ``loglikelihood_rolling`` text when ``prefill_chunk`` is not given."""
KVEVICT_ARGS = (
    "pretrained",
    "tokenizer",
    "policy",
    "budget",
    "keep",
    "interval",
    "prefill_chunk",
    "dtype",
    "attn_implementation",
    "device",
)
HARNESS_ARGS = ("batch_size", "max_batch_size", "max_length", "add_bos_token", "prefix_token_id", "truncation")
"""lm-eval's ``hf`` arguments that mean the same here (``batch_size``, ``max_batch_size`` and
``device`` are passed to every model by lm-eval itself)."""


def _integer(name: str, value: object, least: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"model arg {name} must be an integer >= {least}, got {value!r}")
    return value


@dataclass(frozen=True)
class CacheSettings:
    """The eviction a :class:`KvevictLM` runs every request under, checked before a model loads."""

    policy: str = "full"
    """A policy spec, parameters in brackets (``snapkv[window=8]``; see ``kvevict policies``)."""
    budget: int | None = None
    keep: float | None = None
    interval: int | None = None
    prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise TypeError(f"model arg policy must be a policy spec such as snapkv[window=8], got {self.policy!r}")
        policy = make_policy(self.policy)
        _integer("budget", self.budget, 1)
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, (int, float))):
            raise ValueError(f"model arg keep must be a fraction in (0, 1], got {self.keep!r}")
        Budget(self.budget, None if self.keep is None else float(self.keep))
        if policy.method.evicts and self.budget is None and self.keep is None:
            raise ValueError(f"policy {self.policy!r} needs model arg budget= (tokens) or keep= (fraction)")
        if self.budget is not None:
            policy.check_budget(self.budget)
        _integer("interval", self.interval, 1)
        check_chunk(self.prefill_chunk)
        if self.prefill_chunk is not None and not policy.takes_chunks:
            raise ValueError(self.unchunked())

    def unchunked(self) -> str:
        return make_policy(self.policy).chunk_refusal(
            "leave out the model arg prefill_chunk, and run no loglikelihood_rolling requests"
        )

    def cache(self, model: PreTrainedModel) -> EvictionCache:
        return EvictionCache(model, self.policy, budget=self.budget, keep=self.keep, interval=self.interval)


def _refuse_unknown(args: dict[str, Any]) -> None:
    unknown = sorted(set(args) - set(HARNESS_ARGS))
    if unknown:
        raise ValueError(
            f"unknown model arg{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"allowed: {', '.join(KVEVICT_ARGS + HARNESS_ARGS)}"
        )


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # a malformed --model_args: one line, as a bad model arg
        raise ValueError(message)


def refuse_bad_model_args(argv: Sequence[str]) -> None:
    """Refuse what :class:`KvevictLM` would refuse in ``--model_args`` (an argument it does not take,
    bad eviction settings) before lm-eval indexes its tasks and loads the model: seconds, not tens of
    seconds. They are parsed by lm-eval's own action, so they are read as lm-eval then reads them."""
    parser = _Refusing(add_help=False, allow_abbrev=False)
    parser.add_argument("--model_args", "-a", nargs="+", action=MergeDictAction, default=None)
    given = parser.parse_known_args(list(argv))[0].model_args or {}
    _refuse_unknown({name: value for name, value in given.items() if name not in KVEVICT_ARGS})
    CacheSettings(
        **{field.name: given[field.name] for field in dataclasses.fields(CacheSettings) if field.name in given}
    )


@register_model("kvevict")
class KvevictLM(HFLM):
    """lm-eval's ``hf`` model under a kvevict policy (see the module's docstring).

    ``pretrained``: ``"smollm2"``/``"gemma3"`` (embedded, offline), a local directory or a hub id
    (:func:`kvevict.load_model`, with ``dtype``, ``device`` and ``attn_implementation``), or a
    loaded model (with ``tokenizer``, unless :func:`kvevict.load_model` loaded it).
    ``policy``, ``budget``/``keep``, ``interval``, ``prefill_chunk``: :class:`CacheSettings`.
    """

    def __init__(
        self,
        pretrained: str | PreTrainedModel = "smollm2",
        tokenizer: PreTrainedTokenizerBase | None = None,
        policy: str = "full",
        budget: int | None = None,
        keep: float | None = None,
        interval: int | None = None,
        prefill_chunk: int | None = None,
        dtype: str | None = None,
        attn_implementation: str | None = None,
        device: str | None = None,
        **harness: Any,
    ):
        _refuse_unknown(harness)
        self.settings = CacheSettings(policy, budget, keep, interval, prefill_chunk)
        if isinstance(pretrained, str):
            if tokenizer is not None:
                raise ValueError("model arg tokenizer goes with a loaded model; pretrained= names one with its own")
            if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
                device = "cuda" if torch.cuda.is_available() else None  # as hf; lm-eval's CLI says cuda:0 by default
            pretrained, tokenizer = load_model(pretrained, dtype, device, attn_implementation)
        elif not isinstance(pretrained, PreTrainedModel):
            raise TypeError(f"model arg pretrained must be a model name, a path or a loaded model, got {pretrained!r}")
        tokenizer = tokenizer or tokenizer_of(pretrained.get_decoder())
        if tokenizer is None:
            raise ValueError("a loaded model (pretrained=) needs its tokenizer (tokenizer=)")
        self.settings.cache(pretrained)  # refuses what this model cannot run (architecture, policy) before any request
        chosen = make_policy(policy)  # one request at a time: hidden states read by column, or rows scored alone
        reads_by_column = bool(chosen.hidden_layers(pretrained.config.get_text_config().num_hidden_layers))
        self.one_by_one = reads_by_column or chosen.batches_alone
        if self.one_by_one:
            harness["batch_size"] = 1
        self._rolling = False
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, backend="causal", **harness)

    # -- loglikelihood and loglikelihood_rolling ------------------------------------------------
    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """lm-eval's windows of each text, each fed as a prompt in chunks (see the module's docstring)."""
        if not make_policy(self.settings.policy).takes_chunks:
            raise ValueError(self.settings.unchunked())
        self._rolling = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._rolling = False

    def _loglikelihood_tokens(
        self,
        requests: Sequence[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """``(log-likelihood, greedy)`` of each continuation after its context, as ``hf`` computes them
        (the same left truncation to ``max_length``) but through the compressed cache. Passes run
        longest first, requests with the same input (all but the last continuation token) in one."""
        shared: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for index, (_, context, continuation) in enumerate(requests):
            tokens = (context + continuation)[-(self.max_length + 1) :]
            shared.setdefault((tuple(tokens[:-1]), len(continuation)), []).append(index)
        passes = sorted(shared, key=lambda key: (-len(key[0]), key))
        size = override_bs or (self.batch_size if isinstance(self.batch_size, int) else self.max_batch_size)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for batch in self._batches(passes, size):
            for (inputs, scored), logits in zip(batch, self._score(batch)):
                for index in shared[(inputs, scored)]:
                    key, _, continuation = requests[index]
                    target = torch.tensor(continuation, device=logits.device)
                    greedy = bool((logits.argmax(dim=-1) == target).all())
                    results[index] = (float(logits.gather(-1, target[:, None]).sum()), greedy)
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, results[index])
        return results

    def _batches(
        self, passes: Sequence[tuple[tuple[int, ...], int]], size: int
    ) -> Iterator[list[tuple[tuple[int, ...], int]]]:
        """``passes`` (longest first) in batches of up to ``size`` whose prompts span as many chunks:
        a chunk that is all padding for a row, beside longer rows, does not give it what it gets
        alone under every policy (one that evicts as the padding passes)."""
        chunk = self._chunk()
        batch: list[tuple[tuple[int, ...], int]] = []
        for item in passes:
            if batch and (len(batch) == size or self._chunks(batch[0], chunk) != self._chunks(item, chunk)):
                yield batch
                batch = []
            batch.append(item)
        if batch:
            yield batch

    def _chunk(self) -> int | None:
        """The chunk of the prompts now prefilled (rolling texts are always chunked)."""
        return self.settings.prefill_chunk or ROLLING_CHUNK if self._rolling else self.settings.prefill_chunk

    def _chunks(self, item: tuple[tuple[int, ...], int], chunk: int | None) -> int:
        """How many chunks the prompt of a pass spans (0 when prefilled in one pass)."""
        inputs, scored = item
        return 0 if chunk is None else -(-(len(inputs) - (0 if self._rolling else scored)) // chunk)

    @torch.inference_mode()
    def _score(self, batch: Sequence[tuple[tuple[int, ...], int]]) -> list[torch.Tensor]:
        """The log-probabilities ``[n, V]`` predicting the last ``n`` tokens after each ``inputs`` of ``batch``."""
        model, cache, pad = self.model, self.settings.cache(self.model), pad_token_id(self.tokenizer)
        rows = [torch.tensor([inputs], dtype=torch.long) for inputs, _ in batch]
        if self._rolling:
            chunk = self._chunk()
            ids, mask = pad_to_multiple(*left_padded(rows, pad), chunk, pad)
            logits = prefill(model, ids, cache, mask, chunk, every_logit=True)
        else:
            heads = [row[:, : row.shape[-1] - scored] for row, (_, scored) in zip(rows, batch)]
            _, mask = self._compress(*left_padded(heads, pad), cache)
            tail_ids, tail_mask = left_padded([row[:, -scored:] for row, (_, scored) in zip(rows, batch)], pad)
            mask = torch.cat([mask, tail_mask], dim=-1).to(model.device)
            logits = model(
                input_ids=tail_ids.to(model.device),
                attention_mask=mask,
                position_ids=padded_positions(mask)[:, -tail_ids.shape[-1] :],
                **with_cache(cache),
            ).logits
        return [
            torch.log_softmax(row[-scored:], dim=-1, dtype=self.softmax_dtype)
            for row, (_, scored) in zip(logits, batch)
        ]

    def _compress(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: EvictionCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the left-padded prompts ``ids`` into ``cache`` under the policy, in chunks of
        ``prefill_chunk`` (padded on the left to whole chunks, which it returns with their mask)."""
        ids, mask = pad_to_multiple(ids, mask, self.settings.prefill_chunk or 1, pad_token_id(self.tokenizer))
        if ids.shape[-1]:
            prefill(self.model, ids, cache, mask, self.settings.prefill_chunk)
        else:  # a one-token context (lm-eval's prefix token): nothing to compress
            cache.end_prompt()
        return ids, mask

    # -- generate_until -------------------------------------------------------------------------
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """``hf``'s generation (see :meth:`_model_generate`); prompts prefilled in chunks one at a time
        (``hf`` batches prompts of any lengths, see :meth:`_batches`)."""
        if self.settings.prefill_chunk is None:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        generate = super().generate_until
        return [text for request in requests for text in generate([request], disable_tqdm=True)]

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any):
        """``hf``'s generation after the prompt but its last token was prefilled under the policy."""
        mask = generation_kwargs.pop("attention_mask")
        cache = self.settings.cache(self.model)
        head, head_mask = self._compress(context[:, :-1], mask[:, :-1], cache)
        extra = head.shape[-1] - context.shape[-1] + 1
        output = super()._model_generate(
            torch.cat([head, context[:, -1:]], dim=-1),
            max_length + extra,
            stop,
            attention_mask=torch.cat([head_mask, mask[:, -1:]], dim=-1),
            **with_cache(cache),
            **generation_kwargs,
        )
        return output[:, extra:]

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records of the model (``hf``'s, but the hub's commit, which a loaded model has
        none of) and the cache's settings."""
        return {
            "model_num_parameters": self.model.num_parameters(),
            "model_dtype": str(self.model.dtype),
            "kvevict": vars(self.settings) | {"one_by_one": self.one_by_one},
        }


def main(argv: Sequence[str]) -> int:
    """``kvevict lm-eval ARGS``: lm-eval's own command line (``run`` unless another subcommand is
    named) with ``--model kvevict`` implied and, without ``--include_path``, kvevict's offline tasks."""
    args = list(argv)
    if args[:1] not in (["run"], ["ls"], ["validate"]):
        args.insert(0, "run")
    if not any(arg.split("=")[0] == "--include_path" for arg in args):
        args += ["--include_path", str(TASKS)]
    if args[0] == "run":
        named = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ("--model", "-M")]
        named += [arg.split("=", 1)[1] for arg in args if arg.startswith("--model=")]
        if any(name != "kvevict" for name in named):
            print(f"kvevict lm-eval: error: the model is kvevict (got --model {named[0]})", file=sys.stderr)
            return 2
        if not named:
            args += ["--model", "kvevict"]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        if args[0] == "run":
            refuse_bad_model_args(args)
        cli_evaluate()
    except (ValueError, TypeError) as err:  # bad model args, a malformed task: one line
        print(f"kvevict lm-eval: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        sys.argv = saved
    return 0
