"""A stage's own copy of request progress (docs/design.md §1), and one step's requests as the
stage sees them.

A request whose prompt fits in one step lives for that step only: its state is the step's
arrays. A request whose prompt spans several steps (it holds KV blocks) has a mirror entry
from its first chunk to its last; its ``num_computed_tokens`` comes from that entry, never
from the plan, and is checked against the plan before every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.digest import StageState, empty_ids
from ..core.plan import StepPlan
from ..errors import StateDivergence


@dataclass
class MirrorEntry:
    """What a stage knows of a request whose prompt spans several steps."""

    prompt_len: int
    pooling: int  # Pooling code
    normalize: bool
    dimensions: int
    block_ids: np.ndarray
    num_computed_tokens: int = 0


@dataclass(frozen=True)
class StepView:
    """One step's requests in plan order: where each chunk sits (from the plan, always), and
    what this stage knows of each request (its mirror)."""

    starts: np.ndarray  # [R] chunk starts from the plan: positions and KV slots derive from it
    mirror_starts: np.ndarray  # [R] this stage's own num_computed_tokens (0 for new requests)
    lens: np.ndarray  # [R] chunk lengths
    prompt_lens: np.ndarray  # [R]
    poolings: np.ndarray  # [R] int8 Pooling codes
    normalize: np.ndarray  # [R] bool
    dimensions: np.ndarray  # [R] int64, 0 = every component
    entry_rows: np.ndarray  # rows of requests with a mirror entry (they hold KV blocks)
    entries: list[MirrorEntry]  # their entries, same order

    @property
    def ends(self) -> np.ndarray:
        return self.starts + self.lens

    @property
    def block_tables(self) -> list[np.ndarray]:
        return [e.block_ids for e in self.entries]


class Mirror:
    """One stage's copy of the progress of every request that spans several steps: its
    ``num_computed_tokens``, prompt length and block table. Checked against each plan before
    computing, advanced by the post-step after it, hashed into the stage's digest."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.entries: dict[int, MirrorEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def view(self, plan: StepPlan) -> StepView:
        """Look up continuing requests, register new ones that span several steps."""
        new = plan.new
        k = plan.num_reqs - len(new)  # continuing requests come first
        continuing = [self._lookup(plan.step_id, rid) for rid in plan.req_ids[:k].tolist()]
        if self.entries and np.isin(new.request_ids, list(self.entries)).any():
            rid = int(new.request_ids[np.isin(new.request_ids, list(self.entries))][0])
            raise StateDivergence(
                step_id=plan.step_id, stage=self.stage, request_id=rid, expected=-1,
                found=self.entries[rid].num_computed_tokens,
                what="mirror entry (request scheduled as new, but already known)",
            )  # fmt: skip
        split = np.nonzero(np.diff(new.block_offsets))[0]  # new requests holding KV blocks
        registered = []
        for i in split.tolist():
            entry = MirrorEntry(
                int(new.prompt_lens[i]), int(new.poolings[i]), bool(new.normalize[i]),
                int(new.dimensions[i]), new.blocks(i),
            )  # fmt: skip
            self.entries[int(new.request_ids[i])] = entry
            registered.append(entry)

        def column(attr: str, new_values: np.ndarray, dtype) -> np.ndarray:
            head = np.fromiter((getattr(e, attr) for e in continuing), dtype=dtype, count=k)
            return np.concatenate([head, new_values.astype(dtype, copy=False)])

        return StepView(
            starts=plan.starts,
            mirror_starts=column("num_computed_tokens", np.zeros(len(new), np.int64), np.int64),
            lens=plan.ends - plan.starts,
            prompt_lens=column("prompt_len", new.prompt_lens, np.int64),
            poolings=column("pooling", new.poolings, np.int8),
            normalize=column("normalize", new.normalize, bool),
            dimensions=column("dimensions", new.dimensions, np.int64),
            entry_rows=np.concatenate([np.arange(k), k + split]).astype(np.int64),
            entries=continuing + registered,
        )

    def advance(self, view: StepView) -> np.ndarray:
        """The post-step: every scheduled request advanced by its chunk, from this stage's own
        count (not copied from the plan, so that a stage that drifted shows it). Returns each
        request's num_computed_tokens after the step."""
        post = view.mirror_starts + view.lens
        for entry, row in zip(view.entries, view.entry_rows.tolist(), strict=True):
            entry.num_computed_tokens = int(post[row])
        return post

    def drop(self, plan: StepPlan, view: StepView, *, freed: bool = True) -> list[int]:
        """Forget requests whose final chunk this was, and (``freed``) those the plan frees;
        returns the ids forgotten (their pooling state goes too)."""
        done = [
            int(plan.req_ids[row])
            for entry, row in zip(view.entries, view.entry_rows.tolist(), strict=True)
            if entry.num_computed_tokens >= entry.prompt_len
        ]
        gone = done + list(plan.freed_ids) if freed else done
        for rid in gone:
            self.entries.pop(rid, None)
        return gone

    def state(self, plan: StepPlan, view: StepView, post: np.ndarray, pool) -> StageState:
        """What this stage holds after the step (after ``drop``), for the digest: its own
        counts, the block tables it registered, its live set; ``pool``: (ids, tokens) of
        its pooling accumulators."""
        counts = np.zeros(plan.num_reqs, np.int64)
        counts[view.entry_rows] = [len(e.block_ids) for e in view.entries]
        tables = [e.block_ids for e in view.entries]
        live = sorted(self.entries)
        return StageState(
            req_ids=plan.req_ids,
            computed=post,
            prompt_lens=view.prompt_lens,
            block_counts=counts,
            block_ids=np.concatenate(tables) if tables else empty_ids(),
            live_ids=np.array(live, np.int64),
            live_computed=np.fromiter(
                (self.entries[r].num_computed_tokens for r in live), np.int64, len(live)
            ),
            pool_ids=pool[0],
            pool_tokens=pool[1],
        )

    def _lookup(self, step_id: int, rid: int) -> MirrorEntry:
        entry = self.entries.get(rid)
        if entry is None:
            raise StateDivergence(
                step_id=step_id, stage=self.stage, request_id=rid, expected=0, found=-1,
                what="mirror entry (request unknown to this stage)",
            )  # fmt: skip
        return entry
