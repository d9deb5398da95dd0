"""Fair scheduling with a per-step token budget and chunked prefill. CPU only, no torch.

Policy, in one place:
- Admitted requests whose prompt is only partly scheduled come first (they are older than
  anything waiting), then waiting ones: online batches, then background ones (batch jobs,
  ``RequestBatch.background``), which go only into steps that take no online work: a step
  that carries online requests stays as short as they make it. Except that background work
  is never starved: while it waits it is owed ``BACKGROUND_SHARE`` (a tenth) of the tokens
  planned, and a step goes to it first for what it is owed (online work filling the rest).
- Within a queue, each call's requests go in its order, and a small call never waits for
  large ones: while several batches wait, every batch whose rest fits an equal share of the
  step (tokens and seats) goes in whole first. Then batches go in arrival order, one taking
  what fits; a call that had that turn and still has requests left goes to the back of its
  queue at the next step (all its batches: a call's slices are one call), so large calls take
  turns step by step.
- A step holds at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests, or
  the smaller budget the driver gives it (``schedule(max_tokens)``): shorter steps while a
  light call waits beside other calls' work (``light_call_waits``, ``driver.shared_steps``).
  Encoders' light calls need not wait for a long step in flight at all: ``schedule_light``
  plans them alone, and the driver runs that plan between two layers of the long one.
- Causal models chunk: a prompt longer than the budget left in the step is split, and its
  next chunk may be planned while the previous one is still in the pipeline (stages apply
  plans in FIFO order, so the KV the next chunk reads is always written first). A prompt
  that would fit whole in a step of its own is not split once the step is at least half
  full: it waits for the next step instead, so short prompts never pay for the KV cache.
- Encoders cannot chunk (attention is bidirectional): a prompt goes whole into one step; one
  larger than the whole budget runs alone in a step of its own.
  Only they take key lengths (``RequestBatch.key_lens``): keys a prefix of the prompt, which
  a chunked prompt could not honour (its later chunks would need the masked tokens' K/V).
- A causal request that will be chunked is admitted only when KV blocks for its whole
  prompt are free (pooling prompts have a known length and no decode, so it never needs more
  and never deadlocks). One that fits whole in its first step needs no KV cache at all.
  Blocks are returned once the plan holding its final chunk is built, or when it is
  aborted: later plans that reuse them run after the plans that used them, on every stage.

Requests arrive in batches (``RequestBatch``) and are admitted as slices of them, so the
work per step grows with the number of requests only inside numpy.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import StageFailure, StateDivergence
from .digest import StageState, check_digest, empty_ids, expected_parts
from .kv_blocks import BlockAllocator
from .media import no_media, text_media
from .plan import NewRequests, StepPlan, StepResult
from .request import Pooling, PoolingParams, RequestBatch


@dataclass(eq=False)
class _Split:
    """An admitted request whose prompt spans several steps (it holds KV blocks)."""

    request_id: int
    batch: RequestBatch
    row: int
    num_scheduled: int  # tokens handed to plans so far; the next chunk starts here
    block_ids: np.ndarray

    @property
    def prompt_len(self) -> int:
        return int(self.batch.lengths[self.row])


class _NewPart(NamedTuple):
    """Requests scheduled for the first time from one batch, as one ``take`` adds them."""

    ids: np.ndarray  # [n] int64
    prompt_lens: np.ndarray  # [n] int64
    params: PoolingParams
    block_ids: np.ndarray | None  # the KV blocks of a single split request; None: none
    key_lens: np.ndarray | None  # [n] int64 (0: every token a key); None: every token a key
    images: list | None  # [n] each row's images (vision-language prompts); None: none


@dataclass(frozen=True)
class Ledger:
    """What the driver keeps of a plan in flight, to deliver its results."""

    batches: tuple[RequestBatch, ...]  # batches with requests in the plan, by first id
    final: np.ndarray  # [R] bool: the plan holds the request's final chunk


class _Queue(deque[RequestBatch]):
    """Batches with requests not yet admitted, in the order they take turns; ``served``: the
    call whose batch last had the head's turn."""

    served: int | None = None

    def to_back(self, call: int) -> None:
        """Every batch of ``call`` behind the others, each keeping its order."""
        mine = [b for b in self if b.call == call]
        if len(mine) < len(self):
            rest = [b for b in self if b.call != call]
            self.clear()
            self.extend(rest + mine)


# The share of the tokens planned that background work (batch jobs) is owed while it waits,
# however busy online calls keep the engine: a batch moves under any online load. It is
# paid in small parts, step by step (never a whole step of background work while online work
# waits), so online latency stays as it was.
BACKGROUND_SHARE = 0.1


class _PlanBuilder:
    """Collects one plan's rows as array slices (each ``take`` adds one or many rows)."""

    def __init__(self, budget: int, max_seqs: int) -> None:
        self.limit = budget  # the step's whole budget
        self.budget, self.seqs = budget, max_seqs
        self.ids: list[np.ndarray] = []
        self.starts: list[np.ndarray] = []
        self.ends: list[np.ndarray] = []
        self.tokens: list[np.ndarray] = []
        self.types: list[np.ndarray | None] = []  # None: the slice's tokens are all type 0
        self.media: list[np.ndarray | None] = []  # None: a text slice (core/media.py)
        self.final: list[np.ndarray] = []
        self.prompt_lens: list[np.ndarray] = []
        self.block_counts: list[np.ndarray] = []  # KV blocks each row taken holds
        self.block_ids: list[np.ndarray] = []  # those blocks, row order
        self.new: list[_NewPart] = []
        self.batches: dict[int, RequestBatch] = {}
        self.background_tokens = 0  # of background batches (``RequestBatch.background``)

    @property
    def empty(self) -> bool:
        return not self.ids

    @property
    def full(self) -> bool:
        return self.budget <= 0 or self.seqs <= 0

    def take(self, batch, ids, starts, ends, span, final, blocks=None) -> None:
        """``span``: (tokens, type ids or None, media rows or None) of the rows taken, back to
        back; ``blocks``: the KV blocks of a single row taken (a prompt spanning several
        steps)."""
        tokens, types, media = span
        self.media.append(media)
        self.prompt_lens.append(batch.lengths[ids - batch.first_id])
        if blocks is None:
            self.block_counts.append(np.zeros(len(ids), np.int64))
        else:
            self.block_counts.append(np.array([len(blocks)], np.int64))
            self.block_ids.append(blocks)
        self.ids.append(ids)
        self.starts.append(starts)
        self.ends.append(ends)
        self.tokens.append(tokens)
        self.types.append(types)
        self.final.append(final)
        self.budget -= len(tokens)
        self.seqs -= len(ids)
        self.batches[batch.first_id] = batch
        if batch.background:
            self.background_tokens += len(tokens)

    def build(
        self, step_id: int, freed: tuple[int, ...], expected: np.ndarray | None
    ) -> tuple[StepPlan, Ledger]:
        cat = np.concatenate
        empty = np.empty(0, dtype=np.int64)
        req_ids = cat(self.ids) if self.ids else empty
        starts = cat(self.starts) if self.ids else empty
        ends = cat(self.ends) if self.ids else empty
        plan = StepPlan(
            step_id=step_id,
            req_ids=req_ids,
            starts=starts,
            ends=ends,
            new=_new_requests(self.new),
            token_ids=cat(self.tokens) if self.ids else empty,
            freed_ids=freed,
            num_tokens=int((ends - starts).sum()),
            token_type_ids=self._type_ids(),
            **({"expected_state": expected} if expected is not None else {}),
            media=self._media(),
        )
        batches = tuple(self.batches[k] for k in sorted(self.batches))
        final = cat(self.final) if self.ids else np.empty(0, dtype=bool)
        return plan, Ledger(batches, final)

    def state_after(self, running: list[_Split]) -> StageState:
        """What the last stage holds after this plan if it applied it right: the plan's
        requests at their chunk ends, the split prompts still running (``running``, after
        this plan) as its live set, and pooling accumulators for those that pool other than
        LAST (the other stages hold the same but no accumulators)."""
        cat, ids = np.concatenate, empty_ids()
        live = sorted(running, key=lambda s: s.request_id)
        live_ids = np.fromiter((s.request_id for s in live), np.int64, len(live))
        live_done = np.fromiter((s.num_scheduled for s in live), np.int64, len(live))
        pool = np.array([s.batch.params.code != Pooling.LAST for s in live], dtype=bool)
        taken = bool(self.ids)
        return StageState(
            req_ids=cat(self.ids) if taken else ids,
            computed=cat(self.ends) if taken else ids,
            prompt_lens=cat(self.prompt_lens) if taken else ids,
            block_counts=cat(self.block_counts) if taken else ids,
            block_ids=cat(self.block_ids) if self.block_ids else ids,
            live_ids=live_ids,
            live_computed=live_done,
            pool_ids=live_ids[pool],
            pool_tokens=live_done[pool],
            media=self._media(),
        )

    def _media(self) -> np.ndarray:
        """The step's media rows: empty unless some slice carries them (a vision-language
        prompt), then text rows (``text_media``) for the slices that do not."""
        if all(m is None for m in self.media):
            return no_media()
        return np.concatenate(
            [
                m if m is not None else text_media(s, e)
                for m, s, e in zip(self.media, self.starts, self.ends, strict=True)
            ]
        )

    def _type_ids(self) -> np.ndarray:
        """The step's token type ids: empty unless some slice carries them (pair inputs), then
        zeros for the slices that do not."""
        if all(t is None for t in self.types):
            return np.empty(0, dtype=np.int64)
        return np.concatenate(
            [
                t if t is not None else np.zeros(len(tok), np.int64)
                for tok, t in zip(self.tokens, self.types, strict=True)
            ]
        )


def _drop_admitted(queue: _Queue) -> None:
    """Batches every prompt of which is admitted out of ``queue``, the rest in order."""
    kept = [b for b in queue if b.cursor < len(b.lengths)]
    if len(kept) < len(queue):
        queue.clear()
        queue.extend(kept)


def _new_requests(parts: list[_NewPart]) -> NewRequests:
    """Only a split request (a part of one row) holds blocks; key lengths are sent only when
    some part has them."""
    if not parts:
        return NewRequests.none()
    cat = np.concatenate
    counts = np.array([len(p.ids) for p in parts], dtype=np.int64)
    blocks = [p.block_ids if p.block_ids is not None else np.empty(0, np.int32) for p in parts]

    def spread(values: list, dtype) -> np.ndarray:  # one value per part -> one per row
        return np.repeat(np.array(values, dtype=dtype), counts)

    # Blocks belong to a part of one row (a split request)
    per_row = spread(
        [len(b) if n == 1 else 0 for n, b in zip(counts, blocks, strict=True)], np.int64
    )
    offsets = np.zeros(len(per_row) + 1, dtype=np.int64)
    np.cumsum(per_row, out=offsets[1:])

    keys = np.empty(0, dtype=np.int64)
    if any(p.key_lens is not None for p in parts):
        keys = cat([p.key_lens if p.key_lens is not None else np.zeros(len(p.ids), np.int64)
                    for p in parts])  # fmt: skip
    images: tuple = ()
    if any(p.images is not None for p in parts):
        images = tuple(
            image
            for p in parts
            for image in (p.images if p.images is not None else [()] * len(p.ids))
        )
    return NewRequests(
        request_ids=cat([p.ids for p in parts]),
        prompt_lens=cat([p.prompt_lens for p in parts]),
        poolings=spread([p.params.code for p in parts], np.int8),
        normalize=spread([p.params.normalize for p in parts], bool),
        dimensions=spread([p.params.dimensions or 0 for p in parts], np.int64),
        block_offsets=offsets,
        block_ids=cat(blocks).astype(np.int32, copy=False),
        key_lens=keys,
        images=images,
    )


class Scheduler:
    """The driver's queues of request batches (online, then background), cut into steps.

    ``schedule(max_tokens)`` returns the next immutable ``StepPlan`` (or None): requests in
    the module's fair order within the token budget and the request cap; causal prompts
    (``chunked``)
    split into chunks across steps, admitted only when KV blocks for the whole prompt are
    free; bidirectional prompts whole, one longer than the budget alone in its step. Every
    plan carries each request's expected ``num_computed_tokens`` and, with ``verify_state``,
    what every stage's state must hash to after it. ``update(plan, result)`` checks the
    result against those expectations (``StateDivergence`` naming the stage) and frees what
    finished. Torch-free; one thread (the engine's loop) calls it.
    """

    def __init__(
        self,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        chunked: bool,
        blocks: BlockAllocator | None,
        verify_state: bool = True,
    ) -> None:
        assert chunked == (blocks is not None), "causal models chunk and need a KV cache"
        # Put into every plan what the stages' state must hash to after it (``digest.py``).
        self.verify_state = verify_state
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked = chunked
        self.blocks = blocks
        # Batches with requests not yet admitted: online ones, and background ones.
        self.waiting = _Queue()
        self.background = _Queue()
        self.running: list[_Split] = []  # split prompts with chunks left to plan; FIFO
        self.num_waiting = 0  # requests not yet admitted
        self.num_admitted = 0  # admitted, result not yet back (nor aborted)
        self._ledgers: dict[int, Ledger] = {}  # plans in flight, by step id
        self._freed: list[int] = []  # aborted ids the stages must drop, sent with the next plan
        self._next_step = 0
        # Tokens background work is owed (its share of the steps planned while it waited, less
        # what it got), within one step's budget either way.
        self.background_owed = 0.0

    # -- intake ---------------------------------------------------------------------------

    def add(self, batch: RequestBatch) -> None:
        if self.chunked and batch.has_key_lens:
            raise ValueError(
                "key lengths (RequestBatch.key_lens) need bidirectional attention; this model is "
                "causal and chunks its prompts"
            )
        self._queue_of(batch).append(batch)
        self.num_waiting += len(batch)

    def abort(self, batch: RequestBatch) -> int:
        """Cancel a batch: nothing more of it is planned, blocks of its split prompts return
        now, and results of its requests still in the pipeline will be dropped. Returns the
        tokens of it that no plan will now hold."""
        batch.cancelled = True
        unplanned = 0
        if batch.cursor < len(batch):
            unplanned += int(batch.offsets[-1] - batch.offsets[batch.cursor])
            self.num_waiting -= len(batch) - batch.cursor
            batch.cursor = len(batch)
            self._queue_of(batch).remove(batch)
        for split in [s for s in self.running if s.batch is batch]:
            # Admitted, so the stages mirror it, but its final chunk will never reach them:
            # they drop it with the next plan.
            unplanned += split.prompt_len - split.num_scheduled
            self.running.remove(split)
            self._free_blocks(split)
            self._freed.append(split.request_id)
            self.num_admitted -= 1
        return unplanned

    def has_schedulable(self) -> bool:
        return bool(self.running or self.waiting or self.background or self._freed)

    def light_call_waits(self, light_tokens: int) -> bool:
        """Whether a light call waits beside another call's work: an online batch of at most
        ``light_tokens``, none of it scheduled yet, while another call has requests waiting
        (online or background) or split across steps (a step of theirs would hold the light
        one up: ``driver.shared_steps``). A large call's slices are large, but for the last
        one's rest. Stops at the first such pair: a queue of many light calls costs two."""
        light: int | None = None  # the call of a light batch found
        calls: set[int] = {s.batch.call for s in self.running}
        for b in itertools.chain(self.waiting, self.background):
            fresh = not b.background and b.cursor == 0
            if light is None and fresh and b.num_tokens <= light_tokens:
                light = b.call
            calls.add(b.call)
            if light is not None and len(calls) > 1:
                return True
        return False

    def sole_call(self) -> int | None:
        """The call all work waiting or under way belongs to (None: several calls, or none)."""
        calls = {s.batch.call for s in self.running}
        for b in itertools.chain(self.waiting, self.background):
            calls.add(b.call)
            if len(calls) > 1:
                return None
        return next(iter(calls)) if len(calls) == 1 else None

    def light_batches_of_one_call(self, light_tokens: int) -> int | None:
        """The tokens waiting where all of it is one call's online batches of at most
        ``light_tokens`` each, none of them scheduled, and nothing else is (no other call's
        batch, no background batch, no prompt split across steps); else None. One client's
        stream of small requests (a server's client takes one turn) is such a call, however
        many of its requests wait."""
        if self.running or self.background or not self.waiting:
            return None
        call = self.waiting[0].call
        tokens = 0
        for b in self.waiting:
            if b.call != call or b.cursor or b.num_tokens > light_tokens:
                return None
            tokens += b.num_tokens
        return tokens

    # -- planning -------------------------------------------------------------------------

    def schedule(self, max_tokens: int | None = None) -> StepPlan | None:
        """The next plan, or None when nothing can be scheduled now. ``max_tokens``: a
        smaller budget for this step alone (the same rules apply within it)."""
        budget = self.max_num_batched_tokens
        if max_tokens is not None:
            budget = max(1, min(budget, max_tokens))
        step = _PlanBuilder(budget, self.max_num_seqs)
        done = self._continue_splits(step)
        self._admit(step)
        # Only now: a block freed mid-plan could be handed to a request of this same plan,
        # whose K/V writes would land before this plan's reads of the same block.
        for split in done:
            self._free_blocks(split)
        if step.empty and not self._freed:
            return None
        plan = self._plan(step, tuple(self._freed))
        self._freed.clear()
        return plan

    def schedule_light(self, light_tokens: int, max_tokens: int) -> StepPlan | None:
        """A plan of light calls alone, or None: waiting online batches of at most
        ``light_tokens`` tokens, none of them scheduled yet, of calls other than those of the
        plans in flight, whole, in queue order while ``max_tokens`` and the seats last (the
        first one found always goes). The driver runs it between two layers of a step in
        flight (``LocalPipeline._light_step``), so only for bidirectional models, whose
        requests live one step and hold no state between steps."""
        assert not self.chunked, "causal prompts span steps: no plan runs inside another"
        step = _PlanBuilder(max(1, min(max_tokens, self.max_num_batched_tokens)), self.max_num_seqs)
        for batch in self._light_batches(light_tokens):
            if step.seqs <= 0:
                break
            if len(batch) > step.seqs or (not step.empty and batch.num_tokens > step.budget):
                continue
            self._take_prompts(step, batch, len(batch))
        if step.empty:
            return None
        _drop_admitted(self.waiting)
        return self._plan(step, ())

    def light_call_to_run(self, light_tokens: int) -> bool:
        """Whether ``schedule_light`` has a light call to plan."""
        return next(self._light_batches(light_tokens), None) is not None

    def _light_batches(self, light_tokens: int) -> Iterator[RequestBatch]:
        """Waiting online batches of at most ``light_tokens``, none of them scheduled, of calls
        other than those of the plans in flight (a call's own requests keep their order)."""
        busy = {b.call for ledger in self._ledgers.values() for b in ledger.batches}
        for batch in list(self.waiting):
            fresh = not batch.background and not batch.cursor
            if fresh and batch.num_tokens <= light_tokens and batch.call not in busy:
                yield batch

    def _plan(self, step: _PlanBuilder, freed: tuple[int, ...]) -> StepPlan:
        """The plan of a step built, with what every stage must hold after it; its ledger kept."""
        self._settle_background_share(step)
        expected = None
        if self.verify_state:
            expected = expected_parts(step.state_after(self.running), self._next_step)
        plan, ledger = step.build(self._next_step, freed, expected)
        self._ledgers[plan.step_id] = ledger
        self._next_step += 1
        return plan

    def _continue_splits(self, step: _PlanBuilder) -> list[_Split]:
        """Next chunks of split prompts (older than anything waiting); returns those whose
        final chunk is now planned."""
        done = []
        for split in list(self.running):
            if step.full:
                break
            start = split.num_scheduled
            end = start + min(split.prompt_len - start, step.budget)
            final = end == split.prompt_len
            offset = int(split.batch.offsets[split.row])
            step.take(
                split.batch, np.array([split.request_id]), np.array([start]), np.array([end]),
                split.batch.span(offset + start, offset + end), np.array([final]),
                split.block_ids,
            )  # fmt: skip
            split.num_scheduled = end
            if final:
                self.running.remove(split)
                done.append(split)
        return done

    def _admit(self, step: _PlanBuilder) -> None:
        """First chunks of waiting requests while budget and seats last: online ones, or if
        there are none, background ones; but background work owed its share of the tokens
        (``BACKGROUND_SHARE``) goes first for what it is owed, online work filling the rest."""
        owed = int(self.background_owed)
        if self.background and owed > 0 and not step.full:
            budget = step.budget
            step.budget = min(budget, owed)  # what is owed, no more: a small part of the step
            self._admit_queue(self.background, step)
            step.budget = budget - (min(budget, owed) - step.budget)
        seats = step.seqs
        self._admit_queue(self.waiting, step)
        if not self.waiting and step.seqs == seats:  # online work took none of the step
            self._admit_queue(self.background, step)

    def _settle_background_share(self, step: _PlanBuilder) -> None:
        """After a step is planned: background work that waits is owed its share of it, less
        what it got."""
        if not self.background and not step.background_tokens:
            self.background_owed = 0.0  # nothing waits: nothing is owed
            return
        planned = step.limit - step.budget
        owed = self.background_owed + BACKGROUND_SHARE * planned - step.background_tokens
        self.background_owed = min(max(owed, -step.limit), step.limit)

    def _admit_queue(self, queue: _Queue, step: _PlanBuilder) -> None:
        """First chunks of ``queue``'s requests in its fair order, while budget and seats last
        (and its head does not wait: nothing behind it starts before it)."""
        if len(queue) > 1:
            if queue[0].call == queue.served:
                # The head's call had its turn in an earlier step: the others go first.
                queue.to_back(queue[0].call)
            self._admit_small(queue, step)
        self._admit_from(queue, step)

    def _admit_small(self, queue: _Queue, step: _PlanBuilder) -> None:
        """Whole what is left of every batch in ``queue`` that fits an equal share of the step
        (tokens and seats) and is its call's next: a small call queued behind large ones
        starts in this step."""
        tokens, seats = step.budget // len(queue), step.seqs // len(queue)
        if not tokens or not seats:
            return  # a queued batch has a row and a token left: none fits a share of nothing
        calls, took = set(), False
        for batch in list(queue):
            if batch.call in calls:
                continue  # a later slice of a call waits for the earlier ones
            calls.add(batch.call)
            c = batch.cursor
            n = len(batch.lengths) - c
            if n <= seats and batch.num_tokens - batch.offsets[c] <= tokens:
                self._take_prompts(step, batch, n)
                took = True
        if took:
            _drop_admitted(queue)

    def _admit_from(self, queue: _Queue, step: _PlanBuilder) -> None:
        """First chunks of ``queue``'s requests, in its order, while budget and seats last."""
        while queue and not step.full:
            batch = queue[0]
            c = batch.cursor
            left = len(batch.lengths) - c
            if left <= step.seqs and batch.num_tokens - batch.offsets[c] <= step.budget:
                fits = left  # all of it (the searchsorted below would say the same)
            else:
                window = batch.lengths[c : c + min(left, step.seqs, step.budget)]
                fits = int(np.searchsorted(np.cumsum(window), step.budget, side="right"))
            if fits:  # whole prompts, one slice of the batch
                self._take_prompts(step, batch, fits)
                queue.served = batch.call
                continue
            if not self._admit_split(step, batch):
                return
            queue.served = batch.call

    def _take_prompts(self, step: _PlanBuilder, batch: RequestBatch, n: int) -> None:
        """The batch's next ``n`` prompts, whole, into the step (they fit it)."""
        c = batch.cursor
        rows = slice(c, c + n)
        ids = np.arange(batch.first_id + c, batch.first_id + c + n, dtype=np.int64)
        lens = batch.lengths[rows]
        span = batch.span(batch.offsets[c], batch.offsets[c + n])
        step.take(batch, ids, np.zeros(n, np.int64), lens, span, np.ones(n, bool))
        keys = batch.key_lens[rows] if batch.key_lens is not None else None
        images = batch.images[rows] if batch.images is not None else None
        step.new.append(_NewPart(ids, lens, batch.params, None, keys, images))
        self._advance(batch, n)

    def _admit_split(self, step: _PlanBuilder, batch: RequestBatch) -> bool:
        """The head of the queue does not fit whole in what is left of the step: split it,
        run it alone (an oversized encoder prompt), or leave it for the next step (False)."""
        row = batch.cursor
        prompt_len = int(batch.lengths[row])
        n = self._first_chunk(prompt_len, step)
        if n == 0:
            return False
        request_id = batch.first_id + row
        blocks = None
        if n < prompt_len:  # later chunks read this one's K/V: blocks for the whole prompt
            assert self.blocks is not None, "only chunked (causal) prompts split"
            blocks = self.blocks.allocate(prompt_len)
            if blocks is None:
                return False  # FIFO: nobody overtakes the head of the queue
            self.running.append(_Split(request_id, batch, row, n, blocks))
        ids = np.array([request_id], dtype=np.int64)
        offset = int(batch.offsets[row])
        step.take(
            batch, ids, np.zeros(1, np.int64), np.array([n]), batch.span(offset, offset + n),
            np.array([n == prompt_len]), blocks,
        )  # fmt: skip
        keys = batch.key_lens[row : row + 1] if batch.key_lens is not None else None
        images = batch.images[row : row + 1] if batch.images is not None else None
        step.new.append(_NewPart(ids, np.array([prompt_len]), batch.params, blocks, keys, images))
        self._advance(batch, 1)
        return True

    def _first_chunk(self, prompt_len: int, step: _PlanBuilder) -> int:
        """Tokens of a prompt that does not fit whole in the budget left to take now."""
        full = step.limit
        if not self.chunked:  # an encoder prompt over the whole budget runs alone
            return prompt_len if step.empty and prompt_len > full else 0
        if prompt_len <= full and 2 * (full - step.budget) >= full:
            return 0  # fits a step of its own, and this one is half full already
        return step.budget

    def _advance(self, batch: RequestBatch, n: int) -> None:
        """``n`` more of the batch's prompts admitted; the queue's head leaves it once all
        are. A batch admitted whole from behind the head (``_admit_small``,
        ``schedule_light``) is left for its taker to drop (``_drop_admitted``): one pass for
        all it took, not a scan of the queue each."""
        batch.cursor += n
        self.num_waiting -= n
        self.num_admitted += n
        if batch.cursor == len(batch):
            queue = self._queue_of(batch)
            if queue[0] is batch:
                queue.popleft()

    def _queue_of(self, batch: RequestBatch) -> _Queue:
        return self.background if batch.background else self.waiting

    def _free_blocks(self, split: _Split) -> None:
        if len(split.block_ids):
            assert self.blocks is not None, "only chunked (causal) prompts split"
            self.blocks.free(split.block_ids)
            split.block_ids = split.block_ids[:0]

    # -- results --------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult, *, last_stage: int) -> Ledger:
        """Apply the last stage's result to the plan it answers; returns the plan's ledger
        (its batches, and which rows finished) for delivery.

        The digest chain must match what the plan expected of every stage (the driver check
        of docs/design.md §1, naming the first stage that differs), and the outputs must be
        exactly those of the requests the plan finished.
        """
        ledger = self._ledgers[plan.step_id]  # a rejected result changes nothing
        if result.step_id != plan.step_id:
            raise StateDivergence(
                step_id=plan.step_id, stage=last_stage, request_id=-1,
                expected=plan.step_id, found=result.step_id, what="step id",
            )  # fmt: skip
        if len(plan.expected_state):
            if result.digest is None:
                raise StateDivergence(
                    step_id=plan.step_id, stage=last_stage, request_id=-1, expected=1,
                    found=0, what="state digest (none returned)", check="driver",
                    found_by="the driver",
                )  # fmt: skip
            check_digest(
                result.digest, plan.expected_state, step_id=plan.step_id,
                num_stages=last_stage + 1, upto=last_stage + 1, check="driver",
                found_by="the driver",
            )  # fmt: skip
        finished = plan.req_ids[ledger.final]
        if not np.array_equal(np.sort(result.finished_ids), np.sort(finished)):
            raise StageFailure(
                f"step {plan.step_id}: the last stage returned outputs for "
                f"{len(result.finished_ids)} requests, the plan finished {len(finished)}",
                stage=last_stage,
            )
        del self._ledgers[plan.step_id]
        self.num_admitted -= len(finished)
        return ledger
