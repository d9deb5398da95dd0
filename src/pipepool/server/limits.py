"""What one request may ask of the server, and the 400 that answers a request asking for more:
an OpenAI error body naming the limit and the flag that sets it.

- inputs per request (``--max-inputs-per-request``): texts, pairs or token lists, every route;
- tokens per request (``--max-tokens-per-request``): all inputs (or pairs) together, after
  truncation; ``/tokenize`` and ``/detokenize`` count theirs too;
- tokens of one input embedded whole with ``long_inputs="chunk"`` (``--max-chunked-tokens``),
  which a request cannot raise; ``/tokenize`` counts a text up to it (or max_model_len, if
  larger) and refuses a longer one.

The body size (``--max-body-bytes``, 413) is checked before any of these, by ``guards``.

A text's token count exists only once it is tokenised, so texts are first held to the bound in
characters the engine uses (``MAX_CHARS_PER_TOKEN`` per token). An embedding request goes to
the engine with its token budget (``request_budget``, ``intake.token_budget``): one bounded in
advance (every input cut or refused at a known length L, and its inputs × L within the limit)
is enqueued as it is tokenised; any other is counted on the engine's own token slices, and
refused as soon as its count passes a limit, before anything of it is enqueued (each text
tokenised once). Pairs are tokenised by the engine in one piece and enqueued at once: a pair
request not bounded in advance is counted then, and cancelled at once if over (at most a step
of its work done).

Every function here runs on a tokenising thread (``AsyncEngine.run``) unless it says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..api.engine import Engine
from ..api.engine_info import EngineInfo
from ..config import check_long_inputs
from ..core.submission import Submission
from ..intake.inputs import MAX_CHARS_PER_TOKEN
from ..intake.token_budget import InputOverBudgetError, TokenBudget, TokenBudgetError
from .errors import APIError
from .front import AnySubmission
from .settings import ServerSettings


def check_input_count(settings: ServerSettings, n: int, param: str) -> None:
    """400 when a request has more inputs than ``--max-inputs-per-request`` (on the loop)."""
    limit = settings.max_inputs_per_request
    if n > limit:
        raise APIError(
            400,
            f"the request has {n} inputs; this server takes at most {limit} per request "
            "(--max-inputs-per-request): send them in several requests",
            param=param,
            code="too_many_inputs",
        )


def longest_input(settings: ServerSettings, info: EngineInfo) -> int:
    """Tokens of the longest single input the server takes whole: chunked up to
    ``--max-chunked-tokens``, or max_model_len where that is larger."""
    return max(settings.max_chunked_tokens, info.max_model_len)


def check_text_lengths(
    settings: ServerSettings,
    info: EngineInfo,
    texts: Sequence,
    param: str,
    *,
    listed: bool = True,
) -> None:
    """400 for a text too long in characters to be within ``longest_input`` tokens, before
    anything tokenises it (token-id inputs are not looked at). ``listed``: the field ``param``
    holds a list (errors name the text by its index)."""
    longest = longest_input(settings, info)
    max_chars = longest * MAX_CHARS_PER_TOKEN
    for i, text in enumerate(texts):
        if isinstance(text, str) and len(text) > max_chars:
            raise APIError(
                400,
                f"{_item(param, i, listed)} has {len(text)} characters, more than the "
                f"{max_chars} that {longest} tokens allow ({MAX_CHARS_PER_TOKEN} per token); this "
                f"server takes at most {longest} tokens of one input (--max-chunked-tokens, or "
                "max_model_len where larger)",
                param=param,
                code="context_length_exceeded",
            )


def check_token_counts(
    settings: ServerSettings,
    info: EngineInfo,
    lengths: np.ndarray,
    *,
    first: int,
    counted_before: int,
    inputs: int,
    param: str,
    listed: bool = True,
) -> int:
    """The tokens counted so far, with ``lengths`` (inputs ``first`` onwards of ``inputs``):
    400 if one of them is longer than ``longest_input`` or the request's total passes
    ``--max-tokens-per-request``. ``listed`` as for ``check_text_lengths``."""
    longest = longest_input(settings, info)
    over = np.flatnonzero(lengths > longest)
    if len(over):
        i = int(over[0])
        raise _input_too_long(param, first + i, int(lengths[i]), longest, listed)
    total = counted_before + int(lengths.sum())
    if total > settings.max_tokens_per_request:
        counted = first + len(lengths)
        raise too_many_tokens(settings, total, param, counted if counted < inputs else None)
    return total


def too_many_tokens(
    settings: ServerSettings, counted: int, param: str, complete: int | None = None
) -> APIError:
    """The 400 for a request over ``--max-tokens-per-request``; ``complete``: the inputs
    counted, where counting stopped before the last."""
    limit = settings.max_tokens_per_request
    has = f"{counted} tokens" + (f" in its first {complete} inputs" if complete else "")
    return APIError(
        400,
        f"the request has {has}; this server takes at most {limit} tokens per request "
        "(--max-tokens-per-request): send fewer or shorter inputs per request",
        param=param,
        code="too_many_tokens",
    )


def request_budget(settings: ServerSettings, info: EngineInfo) -> TokenBudget:
    """The token budget of one request (``--max-tokens-per-request``; one input at most
    ``longest_input``), which the engine counts on the slices it tokenises."""
    return TokenBudget(settings.max_tokens_per_request, longest_input(settings, info))


def over_budget(
    settings: ServerSettings, exc: TokenBudgetError | InputOverBudgetError, param: str
) -> APIError:
    """The 400 of an engine call refused by its ``request_budget``, worded as
    ``check_token_counts`` words it (the flag that sets the limit named)."""
    if isinstance(exc, TokenBudgetError):
        return too_many_tokens(settings, exc.counted, param, exc.complete)
    return _input_too_long(param, exc.index or 0, exc.tokens, exc.limit, listed=True)


def bounded_embedding(
    settings: ServerSettings, inputs: list, options: dict[str, Any], param: str = "input"
) -> Callable[[Engine], AnySubmission]:
    """``Engine.submit(inputs, **options)`` within the limits, for ``AsyncEngine.run``;
    ``param``: the request field that holds the inputs, which the errors name. Each text is
    tokenised once, by the engine, which counts the request's budget on those tokens."""

    def submit(engine: Engine) -> AnySubmission:
        d = engine.info
        policy = check_long_inputs(options.get("long_inputs") or engine.config.long_inputs)
        if policy == "chunk":  # the engine bounds no chunked text: held to ours before tokenising
            check_text_lengths(settings, d, inputs, param)
        try:
            return engine.submit(
                inputs, **{**options, "long_inputs": policy}, budget=request_budget(settings, d)
            )
        except (TokenBudgetError, InputOverBudgetError) as exc:
            raise over_budget(settings, exc, param) from None

    return submit


def bounded_scoring(
    settings: ServerSettings,
    n: int,
    truncate_prompt_tokens: int | None,
    submit: Callable[[Engine], Submission],
    param: str,
) -> Callable[[Engine], Submission]:
    """``submit`` (``n`` pairs or texts to score) within ``--max-tokens-per-request``, for
    ``AsyncEngine.run``: scored inputs are truncated or refused at max_model_len, never
    chunked; a call not bounded by that in advance is cancelled if its count is over. A
    ColBERT or BGE-M3 model's pairs (a query and a document each, scored before
    ``submit`` returns) are always counted."""

    def run(engine: Engine) -> Submission:
        each = _tokens_per_input(engine.info, truncate_prompt_tokens, "truncate")
        assert each is not None, "a scored input is never chunked"
        submission = submit(engine)
        if n * each <= settings.max_tokens_per_request and not submission.done():
            return submission
        total = int(submission.num_tokens.sum())  # filled in as it was enqueued
        if total > settings.max_tokens_per_request:
            submission.cancel()
            raise too_many_tokens(settings, total, param)
        return submission

    return run


def _tokens_per_input(d: EngineInfo, truncate: Any, policy: str) -> int | None:
    """The most tokens any one input can have after the engine's truncation or refusal;
    None when inputs are chunked (no bound but ours). A bad ``truncate`` is the engine's to
    refuse: it gets max_model_len here."""
    if isinstance(truncate, int) and not isinstance(truncate, bool) and truncate >= 1:
        return min(truncate, d.max_model_len)
    if truncate == -1 or policy != "chunk":
        return d.max_model_len
    return None


def _input_too_long(param: str, index: int, tokens: int, longest: int, listed: bool) -> APIError:
    return APIError(
        400,
        f"{_item(param, index, listed)} has {tokens} tokens; this server takes at most "
        f"{longest} tokens of one input, chunked or not (--max-chunked-tokens, or "
        "max_model_len where larger)",
        param=param,
        code="context_length_exceeded",
    )


def _item(param: str, index: int, listed: bool) -> str:
    return f"{param} {index}" if listed else param
