"""``pipepool parity``: the correctness report of docs/design.md §3, runnable on any model.

Runs every (PP degree, token budget, pooling) over the same prompts and compares each
request's raw vector (each token's vector for ALL) with a reference: Hugging Face
transformers / sentence-transformers on the same weights, or the engine with PP=1 and no
chunking.
"""

from .compare import Row
from .prompts import REPRODUCER_PROMPTS, builtin_prompts
from .reference import REFERENCES, ParityError
from .report import ParityReport
from .settings import (
    DEFAULT_BUDGETS,
    DEFAULT_PPS,
    MIN_COSINE_16BIT,
    MIN_COSINE_FP32,
    MIN_COSINE_INT8,
    Sweep,
    default_min_cosine,
)
from .sweep import run_parity

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_PPS",
    "MIN_COSINE_16BIT",
    "MIN_COSINE_FP32",
    "MIN_COSINE_INT8",
    "REFERENCES",
    "REPRODUCER_PROMPTS",
    "ParityError",
    "ParityReport",
    "Row",
    "Sweep",
    "builtin_prompts",
    "default_min_cosine",
    "run_parity",
]
