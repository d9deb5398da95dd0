"""The first stage's image features (vision-language models, ``models/qwen2_vl.py``).

A request's images come once, with the plan that starts it (``NewRequests.images``); the
vision tower encodes them then, in one call, and their rows wait here until the chunks that
hold the request's image placeholder tokens have read them, however the chunks cut through
an image. Which row a placeholder reads comes from the plan (``StepPlan.media``), never from
a count kept here. Before computing, the stage checks that the plan's placeholders are exactly
the image token ids of the step and that each names a row this request's images have: a
mismatch is a ``StateDivergence``, never a vector computed from another image's rows."""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import torch

from ..core.media import FEATURE_ROW
from ..core.plan import StepPlan
from ..errors import StateDivergence


class ImageFeatures:
    """Vision-tower rows per request in flight, on the first stage. ``step_rows(plan, ...)``
    encodes the images of the requests the plan starts and returns the rows its placeholders
    read, in step order; ``keep(live)`` forgets every request not in ``live``."""

    def __init__(self, stage: int, image_token_id: int) -> None:
        self.stage, self.image_token_id = stage, image_token_id
        self.rows: dict[int, torch.Tensor] = {}

    def step_rows(self, plan: StepPlan, encode) -> torch.Tensor | None:
        """``encode(images) -> [rows, hidden]``: the vision tower."""
        new = plan.new
        for rid, images in zip(new.request_ids.tolist(), new.images, strict=False):
            if images:
                self.rows[rid] = encode(list(images))
        if not len(plan.media):
            return None
        feature = plan.media[:, FEATURE_ROW]
        wanted = feature > 0
        lens = plan.ends - plan.starts
        # Requests with images: their image tokens and the plan's image rows must coincide.
        # (A text-only prompt may spell the image token out: it is embedded as a token, as
        # transformers embeds it without pixel values.)
        with_images = np.repeat(np.isin(plan.req_ids, list(self.rows)), lens)
        placeholders = np.asarray(plan.token_ids).reshape(-1) == self.image_token_id
        differ = (placeholders != wanted) & (with_images | wanted)
        if differ.any():
            row = int(np.nonzero(differ)[0][0])
            self._diverged(plan, row, int(placeholders[row]), int(wanted[row]),
                           "image placeholder (token id against the plan's image row)")  # fmt: skip
        if not wanted.any():
            return None
        bounds = np.concatenate([[0], np.cumsum(lens)])
        out = []
        for i in np.nonzero(np.add.reduceat(wanted.astype(np.int64), bounds[:-1]) > 0)[0].tolist():
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            rows = feature[lo:hi][wanted[lo:hi]] - 1
            rid = int(plan.req_ids[i])
            held = self.rows.get(rid)
            if held is None or int(rows.max()) >= len(held):
                self._diverged(plan, lo, int(rows.max()) + 1, 0 if held is None else len(held),
                               "image feature rows held for the request", rid)  # fmt: skip
            out.append(held[torch.from_numpy(rows).to(held.device)])
        return torch.cat(out)

    def keep(self, live) -> None:
        for rid in [r for r in self.rows if r not in live]:
            del self.rows[rid]

    def _diverged(self, plan, row, expected, found, what, rid=-1) -> NoReturn:
        raise StateDivergence(
            step_id=plan.step_id, stage=self.stage, request_id=rid, expected=expected,
            found=found, what=f"{what}, step row {row}", check="mirror",
            found_by=f"stage {self.stage}, before computing",
        )  # fmt: skip
