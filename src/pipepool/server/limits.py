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

Checks run on the event loop; the engine calls they return run on a tokenising thread
(``AsyncEngine.perform``), as do the functions that say so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..api.engine import Engine
from ..api.engine_info import EngineInfo
from ..core.priority import current_client, is_background
from ..core.submission import Submission
from ..intake.inputs import MAX_CHARS_PER_TOKEN, valid_texts
from ..intake.token_budget import InputOverBudgetError, TokenBudget, TokenBudgetError
from .errors import APIError
from .front import AnySubmission, AsyncEngine, EngineCall
from .joined_calls import Joinable
from .settings import ServerSettings

T = TypeVar("T")


def check_input_count(settings: ServerSettings, n: int, param: str) -> None:
    """400 when a request has more inputs than ``--max-inputs-per-request``."""
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


def embedding_call(
    settings: ServerSettings,
    front: AsyncEngine,
    inputs: list,
    options: dict[str, Any],
    param: str = "input",
    *,
    add_special_tokens: bool = True,
    counted: Callable[[Engine], Any] | None = None,
) -> EngineCall:
    """An embedding request's engine work within the limits (on the loop), for ``front``'s
    model: its inputs checked (``check_inputs``, ``check_input_count``; a text's characters
    where the engine bounds no length: chunked, or without the special tokens), then
    ``Engine.submit(inputs, **options)`` with the request's token budget, each text tokenised
    once, by the engine, which counts the budget on those tokens; ``add_special_tokens``
    false: texts as their ``plain_token_ids``. ``counted``: instead, a call that waits for
    its own outputs (sparse and multi-vector outputs, late chunking), which tokenises and
    computes in one go: its outputs' ``num_tokens`` are held to ``--max-tokens-per-request``
    once it is done (a request over the limit is answered 400 then, its work done for
    nothing). ``param``: the request field that holds the inputs, which the errors name."""
    check_inputs(settings, inputs, param)
    check_input_count(settings, len(inputs), param)
    if counted is not None:
        return EngineCall(inputs, call=_counted(settings, counted, param))
    engine = front.engine
    plain = not add_special_tokens and isinstance(inputs[0], str)
    # The engine refuses a policy that is none (InvalidInputError: a 400).
    policy = options.get("long_inputs") or engine.config.long_inputs
    if plain or policy == "chunk":  # the engine bounds neither: held to ours before tokenising
        check_text_lengths(settings, engine.info, inputs, param)
    budget = request_budget(settings, engine.info)

    def submit(engine: Engine) -> AnySubmission:
        texts = plain_token_ids(engine, inputs, param) if plain else inputs
        try:
            return engine.submit(texts, **{**options, "long_inputs": policy}, budget=budget)
        except (TokenBudgetError, InputOverBudgetError) as exc:
            raise over_budget(settings, exc, param) from None

    joinable = len(inputs) == 1 and isinstance(inputs[0], str) and not plain and policy != "chunk"
    join = _join(options, policy, budget) if joinable else None
    return EngineCall(inputs, submit=submit, join=join)


def _join(options: dict[str, Any], policy: str, budget: TokenBudget) -> Joinable | None:
    """How a one-text request's call joins others (``joined_calls``): those with the same
    options, policy and budget, of the same client; each text held to what the request's own
    budget allows one text (any over it refuses the joined call, and its request's own call
    says why)."""
    try:
        key = (tuple(sorted(options.items())), policy, budget, current_client(), is_background())
        hash(key)
    except TypeError:  # an option's value is a list, say: the request calls alone
        return None
    each = budget.per_call if budget.per_input is None else min(budget.per_call, budget.per_input)

    def submit_joined(engine: Engine, texts: list) -> Submission:
        joined = TokenBudget(each * len(texts), each)
        submission = engine.submit(texts, **{**options, "long_inputs": policy}, budget=joined)
        assert isinstance(submission, Submission), "only chunked inputs combine windows"
        return submission

    return Joinable(key, submit_joined)


def _counted(settings: ServerSettings, call: Callable[[Engine], T], param: str):
    """``call``, its outputs' ``num_tokens`` held to ``--max-tokens-per-request``."""

    def counted(engine: Engine) -> T:
        out = call(engine)
        total = int(sum(out.num_tokens))  # type: ignore[attr-defined]
        if total > settings.max_tokens_per_request:
            raise too_many_tokens(settings, total, param)
        return out

    return counted


def check_inputs(settings: ServerSettings, inputs: list, param: str = "input") -> None:
    """400 for an empty input list, and for token ids unless the server was told to take
    them (``--allow-token-ids``): ids of another tokenizer would give wrong vectors silently."""
    if not inputs:
        raise APIError(400, f"{param} is empty: send at least one text", param=param)
    if isinstance(inputs[0], str) or settings.allow_token_ids:
        return
    raise APIError(
        400,
        "this server takes text, not token ids: ids are read as this model's own token ids, "
        "and ids from another tokenizer give wrong vectors without any error. LangChain's "
        "OpenAIEmbeddings sends OpenAI tokenizer ids unless you pass "
        "check_embedding_ctx_length=False; set that (or send text). If these are ids of this "
        "model's tokenizer, start the server with --allow-token-ids.",
        param="input",
        code="token_ids_not_allowed",
    )


def plain_token_ids(engine: Engine, texts: list[str], param: str = "input") -> list[np.ndarray]:
    """Token ids of texts without the special tokens the model adds ([CLS], [SEP], BOS...):
    vLLM's ``add_special_tokens: false`` (on a tokenising thread). The model's default prompt
    stays in front of each: it is text the model expects, not a special token. Texts checked
    as the engine checks them (empty, lone surrogates), errors naming ``param``."""
    texts = valid_texts(texts, param=param)
    name = engine.info.default_prompt_name
    prefix = engine.info.prompts[name] if name is not None else ""
    return [engine.tokenizer.encode_plain(prefix + text) for text in texts]


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
