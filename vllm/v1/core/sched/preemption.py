"""Preemption by recompute: who gives way, in what order, and what giving way means.

`Preemption` is the scheduler's `preemption` field. Two occasions take
running requests away from the device, both in one order, from the end of
the scheduler's `running` list (fcfs: the newest; priority: the worst, as
`RequestQueue.place_running` keeps it):

    running = [A, B, C, D]        victims: D, then C, then B ...
                         ^
    1. a step's allocation fails (`allocate_or_preempt`): the last one goes,
       until the request being scheduled fits (or is itself the last one);
    2. the elastic cache gives its tail to a peer engine (`for_shrink`): the
       requests `may_preempt` allows go until at most `max_in_use` blocks are
       in use; `shrink_victims` answers, without preempting, which ones that
       would be and how many blocks stay in use (the engine core's
       `ElasticKVController` picks its boundary with it).

A preempted request loses its blocks, its encoder inputs, its computed tokens
and drafts, and waits as PREEMPTED at its place in `waiting`; it is recomputed
from its prompt and outputs when admitted again (as vLLM V1 preempts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.request_queue import RequestQueue

logger = init_logger(__name__)

# Which running requests a shrink may preempt; None: any of them.
MayPreempt = Callable[[Request], bool] | None


class Preemption:
    """Preempts running requests by recompute, from the end of `running`.

    Args:
        kv_cache_manager, encoder, waiting: the scheduler's (blocks and encoder
            inputs are freed, the request goes back to `waiting`).
        num_lookahead_tokens: KV slots every scheduled request holds beyond its
            tokens of the step (the scheduler's, for `allocate_or_preempt`).

    The methods take the scheduler's `running` list and remove their victims
    from it in place (as `RequestQueue.place_running` places a request in it).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, encoder: EncoderCacheManager,
                 waiting: RequestQueue, num_lookahead_tokens: int) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.encoder = encoder
        self.waiting = waiting
        self.num_lookahead_tokens = num_lookahead_tokens
        self.num_preemptions = 0  # cumulative
        self._between_steps: set[str] = set()  # for a peer engine (`for_shrink`)

    def allocate_or_preempt(self, running: list[Request], request: Request,
                            num_new_tokens: int, preempted_ids: set[str]
                            ) -> list[KVCacheBlock] | None:
        """Allocate `request`'s slots of this step, preempting the last running requests
        until it fits; each victim's id joins `preempted_ids`.

        The victims come from the end of `running`, i.e. after `request`, so
        none of them has been scheduled in this step. Returns None when
        `request` itself had to be preempted.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if new_blocks is not None:
                return new_blocks
            victim = running.pop()
            self._preempt(victim)
            preempted_ids.add(victim.request_id)
            if victim is request:
                return None

    def shrink_victims(self, running: Sequence[Request], max_in_use: int,
                       may_preempt: MayPreempt = None) -> tuple[list[Request], int]:
        """Which running requests `for_shrink` preempts, and the blocks in use after it.

        Walks `running` from its end, over the requests `may_preempt` allows
        (None: all), until at most `max_in_use` blocks are in use. Nothing
        changes: a block shared by several requests counts as freed with its
        last holder among the victims, as `KVCacheManager.free` frees it.

        Returns:
            (the victims, last first; the blocks then in use, which may stay
            above `max_in_use` when the allowed requests run out).
        """
        kv = self.kv_cache_manager
        in_use, refs, victims = kv.num_blocks_in_use(), {}, []
        for request in reversed(running):
            if in_use <= max_in_use:
                break
            if may_preempt is not None and not may_preempt(request):
                continue
            victims.append(request)
            for block in kv.get_blocks(request.request_id):
                refs[block.block_id] = refs.get(block.block_id, block.ref_cnt) - 1
                in_use -= refs[block.block_id] == 0
        return victims, in_use

    def for_shrink(self, running: list[Request], max_in_use: int,
                   may_preempt: MayPreempt = None) -> int:
        """Preempt `shrink_victims`' requests (an elastic cache's release for a peer);
        the next step reports them (`take_preempted_between_steps`). Returns how many."""
        victims, _ = self.shrink_victims(running, max_in_use, may_preempt)
        for request in victims:
            running.remove(request)
            self._preempt(request)
            self._between_steps.add(request.request_id)
        return len(victims)

    def take_preempted_between_steps(self) -> set[str]:
        """The ids `for_shrink` preempted since the last call (a step's preempted_req_ids)."""
        ids, self._between_steps = self._between_steps, set()
        return ids

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and put it back in the waiting queue (its place)."""
        self.kv_cache_manager.free(request)
        self.encoder.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        # The token of a step in flight arrives later and is appended as usual.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)
