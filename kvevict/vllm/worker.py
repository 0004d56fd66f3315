"""The worker-side half of the plug-in: vLLM's CPU worker with a model runner that evicts.

For each request the runner keeps a :class:`~kvevict.vllm.paged.RequestEntries` and reads the
same :class:`~kvevict.vllm.schedule.EvictionSchedule` as the scheduler
(:mod:`kvevict.vllm.scheduler`). Each pass:

- the RoPE positions stay each token's true index, while its slot and the attention's sequence
  length count only the entries held (:meth:`EvictionModelRunner._prepare_inputs`): a request
  that evicted ``e`` entries writes token ``p`` at slot ``p − e`` of its block table;
- a policy that reads hidden states (EpiKV's family) gets them from forward hooks on the decoder
  layers it names: each request's tokens' residual stream after the layer (vLLM's layers return it
  as ``hidden + residual``, the sum transformers' layers return) goes to the request's
  :class:`~kvevict.hidden.HiddenSeries`, which freezes each token's score as kvevict's cache does;
- after each attention layer, a forward hook hands the policy the pass's queries and the
  requests' entries (requests in lockstep at once, as one batch: :func:`~kvevict.vllm.paged.lockstep`),
  and on a pass the schedule says evicts, compacts what the policy keeps into each request's
  first blocks (:func:`~kvevict.vllm.paged.observe_and_evict`);
- after the pass, the block-table rows of the requests that evicted stop at their kept entries,
  as the scheduler's table does when it next schedules them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.utils.math_utils import cdiv
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from kvevict.hidden import HiddenSeries
from kvevict.vllm.config import settings_of
from kvevict.vllm.paged import BlockLayout, RequestEntries, RowPass, lockstep, observe_and_evict
from kvevict.vllm.schedule import lifetime

FINISHED_KEPT = 256
"""Finished requests whose kept positions a worker remembers (:meth:`EvictionModelRunner.kept`)."""


class EvictionModelRunner(CPUModelRunner):
    """vLLM's CPU model runner, evicting under the engine's kvevict settings (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = settings_of(self.vllm_config.additional_config)
        if settings is None:
            raise ValueError("EvictionModelRunner needs additional_config['kvevict'] (kvevict.vllm.config)")
        self.settings = settings
        self.policy = settings.make_policy()
        """The engine's policy, bound to the model's config (its model-dependent defaults, e.g.
        LazyEviction's α), shared by every request: what a request keeps of it lives in its
        :class:`~kvevict.vllm.paged.RequestEntries`."""
        self.policy.bind(self.vllm_config.model_config.hf_config.get_text_config())
        self.entries: dict[str, RequestEntries] = {}
        self.step: list[RowPass] = []
        """The requests of the pass under way (set by :meth:`_prepare_inputs`)."""
        self.layout: BlockLayout | None = None
        self.attention: list[Attention] = []
        """The model's attention layers, in order (found once the model is loaded)."""
        self.hidden_layers: tuple[int, ...] = ()
        """The decoder layers whose outputs the policy reads (found once the model is loaded)."""
        self.finished: dict[str, list[list[list[int]]]] = {}
        """What the last :data:`FINISHED_KEPT` finished requests held when they finished (:meth:`kept`)."""

    # -- the model: a hook after each attention layer ------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.attention = attention_layers(self.model)
        for index, module in enumerate(self.attention):
            module.register_forward_hook(self._after_attention(index))
        self.hidden_layers = tuple(sorted(set(self.policy.hidden_layers(len(self.attention)))))
        if self.hidden_layers:
            layers = decoder_layers(self.model, self.attention)
            for index in self.hidden_layers:
                layers[index].register_forward_hook(self._after_decoder_layer(index))

    def _after_decoder_layer(self, layer_idx: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not self.step:
                return
            stream = output[0] + output[1] if isinstance(output, tuple) and output[1] is not None else output
            stream = stream[0] if isinstance(stream, tuple) else stream
            for step in self.step:
                step.entries.owner.hidden.record(layer_idx, stream[step.start : step.start + step.num_new][None])

        return hook

    def _after_attention(self, layer_idx: int):
        def hook(module: Attention, args: tuple, output: torch.Tensor) -> None:
            if not self.step:
                return
            metadata = get_forward_context().attn_metadata
            metadata = metadata[module.layer_name] if isinstance(metadata, dict) else metadata
            if metadata is None:  # a warm-up or profiling pass
                return
            steps = [step for step in self.step if step.reads_attention]
            if not steps:  # (a pass that only records hidden states)
                return
            query = args[0].view(-1, module.num_heads, module.head_size)
            layout = self._layout(module)
            for group in lockstep(steps, layer_idx):
                rows = [query[step.start : step.start + step.num_new] for step in group]  # [num_new, Hq, d] each
                observe_and_evict(
                    group,
                    layer_idx,
                    module.kv_cache,
                    layout,
                    metadata.block_table[[step.row for step in group]],
                    # [B, Hq, num_new, d], as transformers hands it over
                    (rows[0][None] if len(rows) == 1 else torch.stack(rows)).transpose(1, 2),
                    module.impl.scale,
                )

        return hook

    def _shape(self) -> tuple[int, int]:
        """The model's attention layers and KV heads per layer (on this worker)."""
        return len(self.attention), self.attention[0].num_kv_heads

    def _layout(self, module: Attention) -> BlockLayout:
        """The block layout of ``module``'s cache (every layer's alike: probed once)."""
        if self.layout is None:
            self.layout = BlockLayout.probe(
                lambda key, value, cache, slots: module.impl.do_kv_cache_update(module, key, value, cache, slots),
                module.kv_cache,
            )
        return self.layout

    # -- the requests ------------------------------------------------------------------------
    def kept(self, request_id: str) -> list[list[list[int]]] | None:
        """The absolute positions each layer and KV head of a request holds (``[layers][heads]``,
        ascending): now, or when it finished (one of the last :data:`FINISHED_KEPT`); None if unknown.
        ``request_id`` is the id the request was given (the engine appends a suffix of its own)."""
        for internal, entries in self.entries.items():
            if same_request(internal, request_id) and entries.tokens:
                return entries.kept_positions(*self._shape())
        return next((kept for internal, kept in self.finished.items() if same_request(internal, request_id)), None)

    def _update_states(self, scheduler_output: Any) -> Any:
        for req_id in scheduler_output.finished_req_ids:
            entries = self.entries.pop(req_id, None)
            if entries is not None and entries.tokens:
                self.finished[req_id] = entries.kept_positions(*self._shape())
                while len(self.finished) > FINISHED_KEPT:
                    del self.finished[next(iter(self.finished))]
        result = super()._update_states(scheduler_output)
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids  # preempted: computed again from nothing
        for req_id, state in self.requests.items():
            entries = self.entries.get(req_id)
            prompt = state.num_prompt_tokens
            if entries is None or entries.schedule.prompt_length != prompt or req_id in resumed:
                params = state.sampling_params
                most = lifetime(prompt, None if params is None else params.max_tokens, self.max_model_len)
                hidden = None
                if self.hidden_layers:
                    policy = self.policy
                    hidden = HiddenSeries(self.hidden_layers, policy.hidden_scores, context=policy.hidden_context)
                schedule = self.settings.for_request(None if params is None else params.extra_args).schedule(prompt)
                self.entries[req_id] = RequestEntries(schedule, self.policy, most, hidden)
        return result

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        """vLLM's inputs, then each request's slots and sequence length counted in the entries it
        holds (its true positions stay the RoPE positions), and the pass's :class:`RowPass` list."""
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        num_reqs = self.input_batch.num_reqs
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs]
        starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens[:num_reqs])])
        evicted = np.zeros(num_reqs, dtype=np.int64)
        self.step = []
        for row, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            entries = self.entries[req_id]
            done, new = int(computed[row]), int(num_scheduled_tokens[row])
            entries.tokens = done + new
            if not entries.evicts:  # nothing for the policy to do, ever
                continue
            held = entries.schedule.held(done)
            evicted[row] = done - held
            entries.passes += 1
            step = RowPass(
                entries=entries,
                row=row,
                start=int(starts[row]),
                num_new=new,
                held=held,
                tokens=done + new,
                passes=entries.passes,
                keep=entries.schedule.held(done + new),
            )
            # else the pass asks nothing of the policy (a hidden-state policy records every pass's decoder outputs)
            if step.reads_attention or entries.owner.hidden is not None:
                self.step.append(step)
        if evicted.any():
            shift = torch.from_numpy(evicted)
            total = int(starts[-1])
            self.seq_lens[:num_reqs] -= shift.to(self.seq_lens.dtype)
            self.optimistic_seq_lens_cpu[:num_reqs] -= shift.to(self.optimistic_seq_lens_cpu.dtype)
            slots = self.positions[:total] - shift.repeat_interleave(torch.from_numpy(num_scheduled_tokens[:num_reqs]))
            self.input_batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], slots)
        return result

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            for step in self.step:
                if step.evicts:
                    self._truncate(step)
            self.step = []

    def _truncate(self, step: RowPass) -> None:
        """The request's block-table row and block ids stop at the blocks its kept entries fill."""
        req_id = self.input_batch.req_ids[step.row]
        for group, table in enumerate(self.input_batch.block_table.block_tables):
            keep = cdiv(step.keep, table.block_size)
            table.block_table.np[step.row, keep : table.num_blocks_per_row[step.row]] = 0
            table.num_blocks_per_row[step.row] = min(table.num_blocks_per_row[step.row], keep)
            del self.requests[req_id].block_ids[group][keep:]


class EvictionWorker(CPUWorker):
    """vLLM's CPU worker with :class:`EvictionModelRunner` as its model runner."""

    def init_device(self) -> None:
        super().init_device()
        self.model_runner = EvictionModelRunner(self.vllm_config, torch.device("cpu"))

    def kvevict_kept(self, request_id: str) -> list[list[list[int]]] | None:
        """:meth:`EvictionModelRunner.kept`, for ``LLM.collective_rpc("kvevict_kept", args=(id,))``."""
        return self.model_runner.kept(request_id)


def same_request(internal: str, given: str) -> bool:
    """Whether the engine's id ``internal`` is the request given the id ``given`` (vLLM appends
    ``-`` and eight hexadecimal digits to the ids it is given)."""
    return internal == given or (internal.startswith(f"{given}-") and len(internal) == len(given) + 9)


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    """The model's attention layers, in order (their index is kvevict's layer index)."""
    return [module for module in model.modules() if isinstance(module, Attention)]


def decoder_layers(model: torch.nn.Module, attention: list[Attention]) -> list[torch.nn.Module]:
    """The model's decoder layers, in order: the module list whose ``i``-th layer holds the
    ``i``-th attention layer."""
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) == len(attention)
            and all(any(sub is attn for sub in layer.modules()) for layer, attn in zip(module, attention))
        ):
            return list(module)
    raise TypeError(
        f"cannot find the decoder layers of {type(model).__name__} (a module list holding its attention layers)"
    )
