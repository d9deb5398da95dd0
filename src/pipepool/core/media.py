"""What a vision-language prompt carries besides its token ids (torch-free).

Per token (``MEDIA_COLUMNS``): its M-RoPE position on the temporal, height and width axes, and
which row of its request's image features replaces its embedding (1-based; 0: a text token).
The rows travel with the plan to every stage (``StepPlan.media``): positions come from the
plan, never from a stage's own counters (docs/design.md §1), and every stage hashes the rows
it applied into its digest. Per request: its images (``ImageInput``), sent once with its
first chunk to the first stage, which runs the vision tower on them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# pos_t, pos_h, pos_w, feature row + 1 (0: text)
MEDIA_COLUMNS = 4
FEATURE_ROW = 3


def no_media() -> np.ndarray:
    return np.empty((0, MEDIA_COLUMNS), dtype=np.int64)


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: its patches' pixel values ``[patches, values]`` float32, in the
    order the vision tower reads them, and its patch grid (temporal, height, width)."""

    pixels: np.ndarray
    grid: tuple[int, int, int]


def text_media(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Media rows of text-only chunks ``starts[i]:ends[i]``: position p on every axis (M-RoPE
    of a prompt without images is the 1-D position), no feature row."""
    lens = ends - starts
    positions = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
    media = np.zeros((len(positions), MEDIA_COLUMNS), dtype=np.int64)
    media[:, :3] = positions[:, None]
    return media
