"""The engine-side half of the plug-in: a vLLM scheduler whose KV cache manager counts, for a
request that evicts, the entries its layers hold rather than the tokens it has seen.

Every layer and KV head of a request holds as many entries (:mod:`kvevict.vllm.config` refuses
policies that vary them), so one count per request, from :class:`~kvevict.vllm.schedule.
EvictionSchedule`, sizes its blocks: after the pass that evicted, the worker has compacted the
kept entries into the request's first blocks (:mod:`kvevict.vllm.worker`), and once the step's
outputs are in, the blocks past them go back to the pool (:meth:`EvictionScheduler.
update_from_output`; again, if need be, before new ones are allocated for the request's next
tokens). Both sides read the same schedule, so they agree without messages.

Admission: vLLM admits a request when its prompt fits and preempts the latest when the pool
runs out, which, for requests that grow back to ``budget + interval`` entries between
evictions, would recompute them again and again. The manager knows each evicting request's
peak (:meth:`~kvevict.vllm.schedule.EvictionSchedule.peak`), so it admits one only while the
pool holds every running evicting request's peak and its own
(:meth:`EvictingKVCacheManager.admission_reserve`); requests that never evict are admitted as
vLLM admits them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from kvevict.vllm.config import EvictionSettings, settings_of
from kvevict.vllm.schedule import EvictionSchedule, lifetime


@contextmanager
def counting_entries(request: Request, evicted: int) -> Iterator[None]:
    """Within the block, ``request.num_computed_tokens`` counts the entries the request's layers
    hold (its tokens less the ``evicted``), which is what vLLM's manager sizes blocks by."""
    request.num_computed_tokens -= evicted
    try:
        yield
    finally:
        request.num_computed_tokens += evicted


class EvictingKVCacheManager(KVCacheManager):
    """vLLM's KV cache manager, sizing an evicting request's blocks by the entries it holds and
    returning the blocks past them to the pool (module docstring)."""

    def __init__(
        self, *args: Any, settings: EvictionSettings, running: Callable[[], Iterable[Request]] = tuple, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.running = running
        """The requests the scheduler runs (whose growth an admission must leave room for)."""
        self.schedules: dict[str, EvictionSchedule] = {}

    def schedule_of(self, request: Request) -> EvictionSchedule:
        schedule = self.schedules.get(request.request_id)
        if schedule is None or schedule.prompt_length != request.num_prompt_tokens:
            params = request.sampling_params
            settings = self.settings.for_request(None if params is None else params.extra_args)
            schedule = self.schedules[request.request_id] = settings.schedule(request.num_prompt_tokens)
        return schedule

    def held(self, request: Request) -> int:
        """Entries each layer and KV head of ``request`` holds now (its processed tokens, less what was evicted)."""
        return self.schedule_of(request).held(request.num_computed_tokens)

    def release_evicted(self, request: Request) -> int:
        """Return to the pool the blocks past the entries ``request`` holds (the worker compacted
        them into its first blocks); the number of blocks released."""
        held = self.held(request)
        released = 0
        for manager in self.coordinator.single_type_managers:
            blocks = manager.req_to_blocks.get(request.request_id)
            if not blocks:
                continue
            keep = cdiv(held, manager.block_size)
            tail = blocks[keep:]
            if not tail:
                continue
            del blocks[keep:]
            if request.request_id in manager.num_cached_block:
                manager.num_cached_block[request.request_id] = min(manager.num_cached_block[request.request_id], keep)
            manager.block_pool.free_blocks(reversed(tail))
            released += len(tail)
        return released

    def blocks_for(self, tokens: int) -> int:
        return cdiv(tokens, self.coordinator.single_type_managers[0].block_size)

    def held_blocks(self, request: Request) -> int:
        return len(self.coordinator.single_type_managers[0].req_to_blocks.get(request.request_id, ()))

    def growth(self, request: Request, holding: int | None = None) -> int:
        """Blocks an evicting ``request`` may still need beyond the ``holding`` it holds (default:
        those it holds now) before it finishes; 0 for one that never evicts."""
        schedule = self.schedule_of(request)
        most = lifetime(request.num_prompt_tokens, request.max_tokens, self.max_model_len)
        if not schedule.evicts_within(most):
            return 0
        holding = self.held_blocks(request) if holding is None else holding
        return max(0, self.blocks_for(schedule.peak(most)) - holding)

    def admission_reserve(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks an admission of ``request`` (``num_new_tokens`` now) must leave: what the other
        running requests may still grow by, and what it may itself grow by past this pass. Nothing
        while no other request runs (a request is always admitted to an idle pool)."""
        others = [other for other in self.running() if other is not request]
        if not others:
            return 0
        now = self.blocks_for(self.held(request) + num_new_tokens)
        return sum(self.growth(other) for other in others) + self.growth(request, holding=now)

    def allocate_slots(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any) -> KVCacheBlocks | None:
        self.release_evicted(request)
        if not self.held_blocks(request):  # an admission: a new request, or a preempted one computed again
            kwargs["reserved_blocks"] = kwargs.get("reserved_blocks", 0) + self.admission_reserve(
                request, num_new_tokens
            )
        evicted = request.num_computed_tokens - self.held(request)
        if evicted == 0:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        with counting_entries(request, evicted):
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)

    def free(self, request: Request) -> None:
        self.schedules.pop(request.request_id, None)
        super().free(request)


class EvictionScheduler(Scheduler):
    """vLLM's scheduler with :class:`EvictingKVCacheManager` in place of its own manager (the
    same arguments, so the same pool and block size)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = settings_of(self.vllm_config.additional_config)
        if settings is None:
            raise ValueError("EvictionScheduler needs additional_config['kvevict'] (kvevict.vllm.config)")
        self.kv_cache_manager = EvictingKVCacheManager(
            kv_cache_config=self.kv_cache_config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.vllm_config.max_in_flight_tokens,
            enable_caching=False,
            use_eagle=False,
            num_prefill_lookahead=self.num_prefill_lookahead,
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            dcp_world_size=self.dcp_world_size,
            pcp_world_size=1,
            scheduler_block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            metrics_collector=self.kv_metrics_collector,
            watermark=self.scheduler_config.watermark,
            settings=settings,
            running=lambda: self.running,
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's bookkeeping of a step, then the blocks past what each request that evicted in it
        still holds go back to the pool at once (the worker has compacted its entries)."""
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished():
                self.kv_cache_manager.release_evicted(request)
        return outputs
