"""Token type ids of pair inputs ride with the plan's token ids (issue 13): step by step, chunk
by chunk, zeros for requests without them, and only to the first stage."""

from __future__ import annotations

import numpy as np
from test_scheduler import answer, make_scheduler

from pipepool.core.request import PoolingParams, RequestBatch

PARAMS = PoolingParams(pooling="last")


def test_type_ids_follow_their_tokens_through_chunks_and_mixed_steps():
    sched = make_scheduler(budget=8, max_seqs=16)
    pairs_tokens = np.arange(100, 112)  # two pairs of 6 tokens: types 0 0 0 1 1 1
    pairs_types = np.tile([0, 0, 0, 1, 1, 1], 2)
    pairs = RequestBatch(0, pairs_tokens, np.array([6, 6]), PARAMS, pairs_types)
    single = RequestBatch(2, np.arange(200, 211), np.array([11]), PARAMS)  # no types: 0s
    sched.add(pairs)
    sched.add(single)
    lens = {0: 6, 1: 6, 2: 11}
    tokens, types = [], []
    while (plan := sched.schedule()) is not None:
        # Types for every token of the step, or none at all (a step without pairs).
        step_types = plan.token_type_ids
        assert len(step_types) in (0, plan.num_tokens)
        assert not len(plan.without_tokens().token_type_ids)  # later stages never get them
        tokens.append(plan.token_ids)
        types.append(step_types if len(step_types) else np.zeros(plan.num_tokens, np.int64))
        sched.update(plan, answer(plan, lens), last_stage=0)
    # Every token arrived exactly once (the two calls take turns, so in either order), with
    # the type its batch gave it.
    arrived = np.concatenate(tokens).tolist()
    assert sorted(arrived) == [*range(100, 112), *range(200, 211)]
    type_of = dict(zip(arrived, np.concatenate(types).tolist(), strict=True))
    assert [type_of[t] for t in range(100, 112)] == pairs_types.tolist()
    assert [type_of[t] for t in range(200, 211)] == [0] * 11
    assert len(tokens) > 2  # the 11-token prompt was chunked across steps


def test_steps_without_pairs_carry_no_type_ids():
    sched = make_scheduler(budget=64, max_seqs=16)
    sched.add(RequestBatch(0, np.arange(10), np.array([4, 6]), PARAMS))
    plan = sched.schedule()
    assert plan.num_tokens == 10 and not len(plan.token_type_ids)
