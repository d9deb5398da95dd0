"""CPU encoders run each slice of a call longest prompt first (``Deployment.length_sorted``):
steps of equal lengths attend in fewer kernel calls. Results, token counts and a restarted
pipeline's retries still map to the call's own rows."""

from __future__ import annotations

import numpy as np
from tiny_models import cosine

import pipepool
from pipepool.core.request import PoolingParams, RequestBatch
from pipepool.core.submission import Submission
from pipepool.driver.owners import Owners
from pipepool.intake.inputs import TokenSlice


def test_longest_first_moves_each_prompts_tokens_and_types_together():
    lengths = np.array([2, 4, 1, 4])
    tokens = np.arange(100, 111)  # prompt 0: 100-101, 1: 102-105, 2: 106, 3: 107-110
    part = TokenSlice(5, tokens, lengths, tokens - 100)
    sorted_part, order = part.longest_first()
    assert order.tolist() == [1, 3, 0, 2]  # ties keep input order
    assert sorted_part.first == 5 and sorted_part.lengths.tolist() == [4, 4, 2, 1]
    assert sorted_part.token_ids.tolist() == [102, 103, 104, 105, 107, 108, 109, 110, 100, 101, 106]
    assert (sorted_part.type_ids == sorted_part.token_ids - 100).all()


def test_reordered_rows_survive_a_restart():
    """A batch holding rows 10-13 of a call in the order 11, 13, 10, 12: finished requests map
    to their call rows, and after a restart each unfinished run, queued again under new ids,
    still does."""
    submission = Submission(PoolingParams("cls"), 14, 4, on_cancel=lambda s: None)
    batch = RequestBatch(50, np.arange(10), np.array([4, 3, 2, 1]), submission.params)
    owners = Owners()
    owners.add(submission, 10, batch, rows=np.array([11, 13, 10, 12]))
    _, rows = owners.finish(batch, np.array([50, 52]))
    assert rows.tolist() == [11, 10]
    again, next_id = owners.requeue(200)
    assert [len(b) for b in again] == [1, 1] and next_id == 202  # batch rows 1 and 3
    assert [owners.finish(b, np.array([b.first_id]))[1].tolist() for b in again] == [[13], [12]]


def test_cpu_encoder_results_and_token_counts_come_back_in_input_order(bert_path, reference):
    prompts = [" ".join(["word"] * n) + f" {n}" for n in (3, 40, 1, 17, 40, 9, 25, 2)]
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=64) as engine:
        assert engine.pipeline.deployment.length_sorted  # CPU, encoder
        submission = engine.submit(prompts, pooling="mean", normalize=False)
        got = submission.result(timeout=60)
    ref = reference(bert_path)
    ids = [ref.token_ids(p) for p in prompts]
    assert submission.num_tokens.tolist() == [len(i) for i in ids]
    for i, want in enumerate(ids):
        assert float(cosine(got[i], ref.pooled(want, "mean")).min()) >= 0.99999, i


def test_decoders_keep_input_order(qwen3_path, bert_path):
    """Decoders chunk prompts across steps (and CUDA's varlen kernels take any mix): no sort."""
    from pipepool.config import EngineConfig
    from pipepool.loading.deployment import plan_deployment

    assert not plan_deployment(EngineConfig(model=str(qwen3_path), device="cpu")).length_sorted
    assert plan_deployment(EngineConfig(model=str(bert_path), device="cpu")).length_sorted
