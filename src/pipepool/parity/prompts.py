"""The built-in prompt set of ``pipepool parity``: the published reproducer of
docs/design.md §1 plus prompts of mixed lengths up to the model's limit, so that small token
budgets always chunk."""

from __future__ import annotations

from collections.abc import Callable

# The five prompts of the published reproducer (docs/design.md §1), in its order: the order decides
# which requests share a step, and the bug showed with exactly this mix.
REPRODUCER_PROMPTS: tuple[str, ...] = (
    "A",
    "A short sentence for embedding.",
    "Mixed-length pooling request " * 9,
    "A substantially longer pooling request " * 31,
    "tail",
)

# Targets for the mixed-length prompts, as fractions of max_model_len. The longest reaches the
# limit itself (the last KV block, the last position); the others land at lengths that are not
# multiples of the usual budgets, so chunks end mid-block.
LENGTH_FRACTIONS: tuple[float, ...] = (1.0, 0.55, 0.3, 0.12)

# Varied prose rather than one repeated phrase, so that no two chunks see the same tokens.
_FILLER_TEXT = (
    "Pipeline parallelism splits a model into consecutive stages, and every stage keeps its "
    "own record of how far each request has progressed. Long prompts are fed through the "
    "stages in chunks whenever the token budget of a step is smaller than the prompt. "
    "Positions, sequence lengths and cache slots of the next chunk all follow from that "
    "record, so a stage that forgets to advance it computes the wrong thing without any "
    "warning. Embedding models are used for search, clustering, deduplication and "
    "retrieval-augmented generation; a vector that is slightly off ranks documents in a "
    "different order, and nobody notices until the results look strange. The reference is "
    "the same checkpoint run in one piece, one prompt at a time, with no padding and no "
    "batching. A two-line fix once restored a cosine similarity of 0.9999999999999998 "
    "after it had fallen to 0.26 on a prompt of 157 tokens!"
)
_FILLER = _FILLER_TEXT.split()


def builtin_prompts(count_tokens: Callable[[str], int], max_model_len: int) -> list[str]:
    """The reproducer prompts that fit in ``max_model_len``, then one filler prompt per
    ``LENGTH_FRACTIONS`` target, each as long as fits in its target (special tokens included;
    the longest is exactly ``max_model_len`` with common tokenizers).

    ``count_tokens(text)`` must return the engine's token count for ``text`` (any number larger
    than ``max_model_len`` for a text that does not fit).
    """
    prompts = [p for p in REPRODUCER_PROMPTS if count_tokens(p) <= max_model_len]
    seen = {count_tokens(p) for p in prompts}
    for k, fraction in enumerate(LENGTH_FRACTIONS):
        target = max(1, int(max_model_len * fraction))
        text = _longest_within(count_tokens, target, offset=17 * k)
        n = count_tokens(text) if text else 0
        if text and n not in seen:  # a tiny limit can make two targets collapse into one
            prompts.append(text)
            seen.add(n)
    return prompts


def _longest_within(count_tokens: Callable[[str], int], target: int, offset: int) -> str:
    """The longest run of filler words, starting at word ``offset``, that tokenizes to at most
    ``target`` tokens (binary search: the count grows with the number of words)."""

    def text(n: int) -> str:
        return " ".join(_FILLER[(offset + i) % len(_FILLER)] for i in range(n))

    lo, hi = 0, target + 1  # every word is at least one token, so target + 1 words never fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(text(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    best = text(lo)
    # The next word may be several tokens; fill the gap one short word at a time, so that
    # the longest prompt reaches the limit exactly.
    n = count_tokens(best) if best else 0
    while best and n < target:
        longer = best + " a"
        m = count_tokens(longer)
        if not n < m <= target:
            break
        best, n = longer, m
    return best


# The built-in images of a dual encoder's parity run: (height, width, mode). Landscape and
# portrait, one smaller than any crop, a square, and the modes an RGB conversion changes.
IMAGE_SHAPES: tuple[tuple[int, int, str], ...] = (
    (240, 320, "RGB"),
    (300, 180, "RGBA"),
    (224, 224, "L"),
    (20, 25, "RGB"),
    (97, 64, "P"),
)


def builtin_images() -> list:
    """PIL images of ``IMAGE_SHAPES``: smooth random pixels (noise upsampled) from a fixed
    seed, the same on every run."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    images = []
    for height, width, mode in IMAGE_SHAPES:
        coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 4), np.uint8)
        image = Image.fromarray(coarse, "RGBA").resize((width, height), Image.Resampling.BILINEAR)
        images.append(image if mode == "RGBA" else image.convert("RGB").convert(mode))
    return images
