"""The last stage's answer to a plan, from device tensors to the driver's ``StepResult`` in
one device-to-host copy per step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.digest import Digest
from ..core.plan import StepResult
from .pooling import PooledStep


@dataclass(frozen=True)
class StageOutput:
    """What the last stage produced for one plan: outputs still on the device, digest and
    busy clocks on the host."""

    step_id: int
    digest: Digest | None  # every stage's state digest, chained; None: state not verified
    stage_busy_s: tuple[float, ...]  # cumulative, stages 0..last
    pooled: PooledStep

    def start_host_copy(self) -> PendingResult:
        """Queue the device-to-host copy without waiting (it overlaps the next step's host
        work); ``PendingResult.result()`` waits for it."""
        return PendingResult(self)


class PendingResult:
    """A ``StageOutput`` on its way to the host: every output of the step packed into one
    float32 buffer and copied once (into pinned memory on CUDA, asynchronously)."""

    def __init__(self, output: StageOutput) -> None:
        self.output = output
        p = output.pooled
        parts = [t.reshape(-1) for t in (p.vectors, p.token_vectors) if t is not None]
        self._event = None
        if not parts:
            self._host = None
            return
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        if flat.device.type == "cuda":
            # Pinned memory comes from torch's caching host allocator, reused after the copy.
            self._host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            # On the stream of the outputs' own device, which need not be the current one
            # (in-process stages on several GPUs).
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flat.device))
        else:
            self._host = flat

    def result(self) -> StepResult:
        out, p = self.output, self.output.pooled
        vectors = tokens = None
        if self._host is not None:
            if self._event is not None:
                self._event.synchronize()
            flat = self._host.numpy()
            # Vectors only, on CUDA: views of the pinned buffer, which the driver copies into
            # each call's result at once (``Submission.put_vectors``); the buffer goes back to
            # torch's cache with the last view. A copy here was 2.3 MB a 64k-token step of short
            # queries, 5% of the loop thread's time (py-spy, H200). Otherwise a copy of our own:
            # callers keep views of token embeddings as they come.
            if self._event is None or p.token_vectors is not None:
                flat = np.array(flat)
            n_vec = p.vectors.numel() if p.vectors is not None else 0
            if p.vectors is not None:
                vectors = flat[:n_vec].reshape(p.vectors.shape)
            if p.token_vectors is not None:
                tokens = flat[n_vec:].reshape(p.token_vectors.shape)
        return StepResult(
            step_id=out.step_id,
            digest=out.digest,
            vector_ids=p.vector_ids,
            vectors=vectors,
            token_owner_ids=p.token_owner_ids,
            token_offsets=p.token_offsets,
            token_vectors=tokens,
            stage_busy_s=out.stage_busy_s,
        )
