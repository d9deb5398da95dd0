"""FIFO scheduling with a per-step token budget and chunked prefill. CPU only, no torch.

Policy, in one place:
- Requests are served strictly in arrival order. Admitted requests whose prompt is only
  partly scheduled come first (they are older than anything waiting), then waiting ones.
- A step holds at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests.
- Causal models chunk: a prompt longer than the budget left in the step is split, and its
  next chunk may be planned while the previous one is still in the pipeline (stages apply
  plans in FIFO order, so the KV the next chunk reads is always written first).
- Encoders cannot chunk (attention is bidirectional): a prompt goes whole into one step; one
  larger than the whole budget runs alone in a step of its own.
- A causal request that will be chunked is admitted only when KV blocks for its whole
  prompt are free (pooling prompts have a known length and no decode, so it never needs more
  and never deadlocks). One that fits whole in its first step needs no KV cache at all.
  Blocks are returned once the plan holding its final chunk is built, or when it is
  aborted: later plans that reuse them run after the plans that used them, on every stage.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .errors import StateDivergence
from .kv_blocks import BlockAllocator
from .plan import NewRequest, StepPlan, StepResult, check_digest
from .request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        chunked: bool,
        blocks: BlockAllocator | None,
    ) -> None:
        assert chunked == (blocks is not None), "causal models chunk and need a KV cache"
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked = chunked
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, chunks left to schedule; admission order
        self.requests: dict[int, Request] = {}  # every request not yet finished or aborted
        self._freed: list[int] = []  # aborted ids the stages must drop, sent with the next plan
        self._next_step = 0

    # -- intake ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, "duplicate request id"
        assert request.prompt_len > 0
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: int) -> Request | None:
        """Drop a request wherever it is; its blocks return now. None if unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            # Admitted, so the stages mirror it, but its final chunk will never reach them:
            # they drop it with the next plan. Its blocks return now (a SCHEDULED request
            # returned its own when its final chunk was planned).
            self.running.remove(request)
            self._free_blocks(request)
            self._freed.append(request_id)
        request.status = RequestStatus.ABORTED
        return request

    def has_schedulable(self) -> bool:
        return bool(self.running or self.waiting or self._freed)

    # -- planning -------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next plan, or None when nothing can be scheduled now."""
        budget = self.max_num_batched_tokens
        ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        new: list[NewRequest] = []
        new_tokens: dict[int, np.ndarray] = {}
        done: list[Request] = []  # fully scheduled in this plan: blocks return after it

        def take(request: Request, n: int) -> None:
            ids.append(request.request_id)
            starts.append(request.num_scheduled_tokens)
            ends.append(request.num_scheduled_tokens + n)
            request.num_scheduled_tokens += n
            if request.num_scheduled_tokens == request.prompt_len:
                request.status = RequestStatus.SCHEDULED
                done.append(request)

        for request in list(self.running):
            if budget == 0 or len(ids) == self.max_num_seqs:
                break
            n = min(request.prompt_len - request.num_scheduled_tokens, budget)
            take(request, n)
            budget -= n
            if request.status == RequestStatus.SCHEDULED:
                self.running.remove(request)

        while self.waiting and budget > 0 and len(ids) < self.max_num_seqs:
            request = self.waiting[0]
            n = self._first_chunk(request, budget, step_empty=not ids)
            if n == 0:
                break
            # Only a prompt split across steps needs KV blocks: later chunks read the earlier
            # ones' K/V. A prompt that fits whole attends within its own step.
            if self.blocks is not None and n < request.prompt_len:
                block_ids = self.blocks.allocate(request.prompt_len)
                if block_ids is None:
                    break  # FIFO: nobody overtakes the head of the queue
                request.block_ids = block_ids
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            new.append(
                NewRequest(
                    request.request_id,
                    request.prompt_len,
                    request.params.pooling,
                    request.block_ids,
                )
            )
            new_tokens[request.request_id] = request.token_ids
            take(request, n)
            budget -= n
            if request.status == RequestStatus.RUNNING:
                self.running.append(request)

        # Only now: a block freed mid-plan could be handed to a request of this same plan,
        # whose K/V writes would land before this plan's reads of the same block.
        for request in done:
            self._free_blocks(request)
        if not ids and not self._freed:
            return None
        plan = StepPlan(
            step_id=self._next_step,
            req_ids=np.asarray(ids, dtype=np.int64),
            starts=np.asarray(starts, dtype=np.int64),
            ends=np.asarray(ends, dtype=np.int64),
            new_requests=tuple(new),
            new_token_ids=new_tokens,
            freed_ids=tuple(self._freed),
            num_tokens=self.max_num_batched_tokens - budget if ids else 0,
        )
        self._freed.clear()
        self._next_step += 1
        return plan

    def _first_chunk(self, request: Request, budget: int, *, step_empty: bool) -> int:
        if self.chunked:
            return min(request.prompt_len, budget)
        if request.prompt_len <= budget:
            return request.prompt_len
        if step_empty and budget == self.max_num_batched_tokens:
            return request.prompt_len  # an encoder prompt over the budget runs alone
        return 0

    def _free_blocks(self, request: Request) -> None:
        if self.blocks is not None and len(request.block_ids):
            self.blocks.free(request.block_ids)
            request.block_ids = request.block_ids[:0]

    # -- results --------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult, *, last_stage: int) -> list[Request]:
        """Apply the last stage's result; returns the requests that finished in this step.

        The digest must say that every scheduled request advanced to exactly its chunk end.
        """
        if result.step_id != plan.step_id:
            raise StateDivergence(
                step_id=plan.step_id,
                stage=last_stage,
                request_id=-1,
                expected=plan.step_id,
                found=result.step_id,
                what="step id",
            )
        check_digest(plan, np.asarray(result.digest), stage=last_stage)
        finished = []
        for rid, end in zip(plan.req_ids.tolist(), plan.ends.tolist(), strict=True):
            request = self.requests.get(rid)
            if request is None:  # aborted while its chunk was in the pipeline
                continue
            request.num_computed_tokens = end
            if end == request.prompt_len:
                request.output = result.outputs[rid]
                request.status = RequestStatus.FINISHED
                del self.requests[rid]
                finished.append(request)
        return finished
