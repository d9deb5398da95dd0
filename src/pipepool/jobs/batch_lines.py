"""The lines of a batch file, OpenAI's Batch API format (also ``vllm run-batch``'s).

An input line is ``{"custom_id", "method": "POST", "url", "body"}``; an output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. A request
that was answered (any HTTP status) has ``response`` and ``error: null``; a line that could
not be sent at all (not JSON, a field missing, an unknown url, a repeated custom_id) has
``response: null`` and ``error: {"code", "message"}``, as OpenAI writes them.

Torch-free and server-free: the server's Batch API and ``pipepool run-batch`` both read and
write lines through this module.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import InvalidInputError

__all__ = [
    "ENDPOINTS",
    "LINE_ENVELOPE_BYTES",
    "BatchRequest",
    "FileCheck",
    "LineChecker",
    "LineError",
    "LineResult",
    "LongLine",
    "WrittenLines",
    "answer_line",
    "check_file",
    "count_inputs",
    "numbered_lines",
    "read_lines",
]

# The routes a batch line may call: the model-running routes of OpenAI's, vLLM's and Cohere's
# APIs that this server answers.
ENDPOINTS = ("/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/classify", "/v1/embed", "/v2/embed")
# vLLM's encoding formats whose answer is bytes, not JSON (``server/encoding.py``).
_BINARY_FORMATS = ("bytes", "bytes_only")
# Fields whose list length is the number of engine inputs a body asks for (``count_inputs``).
_INPUT_FIELDS = ("input", "texts", "documents", "text_2", "inputs", "images")
DUPLICATE = "duplicate_custom_id"
# Errors of a whole file named in a failed batch's ``errors``: enough to fix the file by,
# few enough to read.
MAX_FILE_ERRORS = 100
_YIELD_EVERY = 256  # lines read between two turns of the event loop (``read_lines``)


@dataclass(frozen=True)
class BatchRequest:
    """One input line that can be sent: its line number (1-based, counting every line of the
    file), its custom_id (unique in the file), and what to POST where."""

    line: int
    custom_id: str
    url: str  # one of ENDPOINTS
    body: dict[str, Any]

    def __post_init__(self) -> None:
        assert self.line >= 1 and self.url in ENDPOINTS, (self.line, self.url)


@dataclass(frozen=True)
class LineError:
    """One input line that cannot be sent, and why (OpenAI's ``code`` and ``message``).
    ``custom_id`` is None where the line has none (not JSON, or not a string there)."""

    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def output(self) -> bytes:
        """Its output line (``response`` null, ``error`` set), newline-terminated."""
        error = {"code": self.code, "message": self.message}
        return _line({"id": _id("batch_req"), "custom_id": self.custom_id, "response": None,
                      "error": error})  # fmt: skip

    def batch_error(self) -> dict[str, Any]:
        """As an entry of a failed batch's ``errors.data``."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class LineResult:
    """A finished line: its input line number and its output line, for the output file
    (``ok``: answered 2xx) or the error file (a server batch; run-batch writes both to one)."""

    line: int
    ok: bool
    text: bytes  # one JSON line, newline-terminated
    tokens: int = 0  # prompt tokens its answer reports (``prompt_tokens``)


# Where an answer's usage says how many prompt tokens it read: every route's answer ends with
# it ("usage": {"prompt_tokens": N, ...}; Cohere's /v1/embed and /v2/embed: "billed_units":
# {"input_tokens": N}).
_TOKENS = re.compile(rb'"(?:prompt_tokens|input_tokens)":(\d+)')
_USAGE_TAIL = 512


def prompt_tokens(body: bytes) -> int:
    """The prompt tokens an answer reports in its usage (0 where it reports none), read from
    its last bytes: an answer of thousands of floats is not parsed for it."""
    found = _TOKENS.search(body, max(0, len(body) - _USAGE_TAIL))
    return int(found[1]) if found else 0


def answer_line(custom_id: str, status_code: int, body: bytes, is_json: bool) -> bytes:
    """The output line of a request that was answered: ``body`` is the route's answer as
    sent, spliced in as it is when it is one line of JSON (the route's own bytes: no parse and
    re-encode of a response of thousands of floats), else carried as a string."""
    response = {"status_code": status_code, "request_id": _id("req"), "body": None}
    head = {"id": _id("batch_req"), "custom_id": custom_id, "response": response}
    if not (is_json and body and b"\n" not in body and b"\r" not in body):
        response["body"] = body.decode("utf-8", errors="replace")
        return _line({**head, "error": None})
    # {"id":...,"custom_id":...,"response":{"status_code":...,"request_id":...,"body":BODY},
    # "error":null}: the encoded object up to its body's null, the body, and the rest.
    text = json.dumps(head, ensure_ascii=True, separators=(",", ":"))
    assert text.endswith(',"body":null}}'), text
    return text[: -len("null}}")].encode() + body + b'},"error":null}\n'


@dataclass(frozen=True)
class LongLine:
    """A line longer than the reader's ``max_line_bytes``: its first bytes (where a custom_id
    is looked for) and its length; the rest was skipped unread into memory."""

    head: bytes
    size: int


# A line's room beyond its request body: its custom_id, method and url. A line longer than a
# request body may be plus this is refused unread (``LongLine``).
LINE_ENVELOPE_BYTES = 64 << 10
_HEAD_BYTES = 4096  # of a long line, kept to find its custom_id
_SKIP_BYTES = 1 << 20  # read at a time past a long line's head
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


def numbered_lines(
    file: BinaryIO, max_line_bytes: int | None = None
) -> Iterator[tuple[int, bytes | LongLine]]:
    """(line number, line) for each line of ``file`` that is not blank, numbered from 1 over
    every line. Read as it goes: a file of any size takes a line's memory, and a line longer
    than ``max_line_bytes`` (None: no bound) comes as a ``LongLine``, its bulk never held."""
    limit = -1 if max_line_bytes is None else max_line_bytes + 1
    number = 0
    while raw := file.readline(limit):
        number += 1
        if limit > 0 and len(raw) == limit and not raw.endswith(b"\n"):
            size = len(raw)
            head = raw[:_HEAD_BYTES]
            del raw
            while (rest := file.readline(_SKIP_BYTES)) and not rest.endswith(b"\n"):
                size += len(rest)
            yield number, LongLine(head, size + len(rest))
        elif raw.strip():
            yield number, raw


async def read_lines(
    path: Path,
    checker: LineChecker,
    skip: Callable[[BatchRequest | LineError], bool],
    *,
    max_line_bytes: int | None = None,
) -> AsyncIterator[BatchRequest | LineError]:
    """The checked lines of a batch file, those ``skip`` keeps out left out, read as they are
    asked for (a line longer than ``max_line_bytes`` unparsed: ``LineChecker``). Every line
    goes through ``checker`` (a repeated custom_id is found whether the first line with it is
    skipped or not); the event loop gets a turn now and then."""
    with open(path, "rb") as file:
        for count, (number, raw) in enumerate(numbered_lines(file, max_line_bytes), start=1):
            item = checker.check(number, raw)
            if not skip(item):
                yield item
            if count % _YIELD_EVERY == 0:
                await asyncio.sleep(0)


class LineChecker:
    """Turns input lines into BatchRequests or LineErrors, in file order: it remembers the
    custom_ids seen, so that a repeated one is refused (the first line with it runs). With
    ``endpoint`` (a server batch), a line for another supported route is an error too."""

    def __init__(self, endpoint: str | None = None) -> None:
        self.endpoint = endpoint
        self._seen: set[str] = set()

    def check(self, line: int, raw: bytes | LongLine) -> BatchRequest | LineError:
        if isinstance(raw, LongLine):
            return self._too_long(line, raw)
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            why = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
            return LineError(line, None, "invalid_json_line", f"line {line} is not JSON: {why}")
        if not isinstance(value, dict):
            return LineError(line, None, "invalid_json_line", f"line {line} is not a JSON object")
        custom_id = value.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return _missing(line, None, "custom_id", "a non-empty string")
        if custom_id in self._seen:
            return LineError(
                line, custom_id, DUPLICATE,
                f"line {line}: custom_id {custom_id!r} is used by an earlier line; each "
                "request needs a custom_id of its own", param="custom_id",
            )  # fmt: skip
        self._seen.add(custom_id)
        return self._request(line, custom_id, value)

    def _too_long(self, line: int, raw: LongLine) -> LineError:
        """A line too long to be a request this server takes, refused unparsed; named by the
        custom_id its first bytes give (a repeat of an earlier one gets none)."""
        found = _CUSTOM_ID.search(raw.head)
        custom_id = None
        if found is not None:
            try:
                custom_id = json.loads(b'"' + found[1] + b'"')
            except ValueError:
                custom_id = None
        if custom_id in self._seen or not custom_id:
            custom_id = None
        else:
            self._seen.add(custom_id)
        return LineError(
            line, custom_id, "line_too_large",
            f"line {line} is {raw.size} bytes, more than a request may be (--max-body-bytes "
            "and its line's envelope); it was not read", param="body",
        )  # fmt: skip

    def _request(self, line: int, custom_id: str, value: dict) -> BatchRequest | LineError:
        method, url, body = value.get("method"), value.get("url"), value.get("body")
        if method != "POST":
            return _missing(line, custom_id, "method", '"POST"')
        if not isinstance(url, str) or url not in ENDPOINTS:
            return LineError(
                line, custom_id, "invalid_url",
                f"line {line}: url {url!r} is not a route a batch can call; use one of "
                f"{', '.join(ENDPOINTS)}", param="url",
            )  # fmt: skip
        if self.endpoint is not None and url != self.endpoint:
            return LineError(
                line, custom_id, "mismatched_url",
                f"line {line}: url {url} does not match the batch's endpoint {self.endpoint}; "
                "every request of a batch calls its endpoint", param="url",
            )  # fmt: skip
        if not isinstance(body, dict):
            return _missing(line, custom_id, "body", "a JSON object (the request's body)")
        if body.get("encoding_format") in _BINARY_FORMATS:
            return LineError(
                line, custom_id, "invalid_value",
                f"line {line}: encoding_format {body['encoding_format']} answers with raw "
                "bytes, which an output line (JSON) cannot hold; use base64",
                param="body.encoding_format",
            )  # fmt: skip
        return BatchRequest(line, custom_id, url, body)


@dataclass(frozen=True)
class FileCheck:
    """What validating a whole batch file found: the number of requests (non-blank lines) and
    the errors that fail the batch (empty when it may run)."""

    total: int
    errors: list[dict[str, Any]]  # entries of the batch's ``errors.data``


def check_file(
    lines: Iterable[tuple[int, bytes | LongLine]], endpoint: str, max_requests: int
) -> FileCheck:
    """Validate a server batch's input file before it runs, as OpenAI does: a batch fails
    whole when it has more than ``max_requests`` requests, when a line calls another route than
    ``endpoint``, or when no line at all is a request (not a batch file). Other bad lines only
    fail themselves when the batch runs."""
    checker = LineChecker(endpoint)
    total = sendable = 0
    errors: list[dict[str, Any]] = []
    for line, raw in lines:
        total += 1
        checked = checker.check(line, raw)
        if isinstance(checked, BatchRequest):
            sendable += 1
        elif checked.code == "mismatched_url" and len(errors) < MAX_FILE_ERRORS:
            errors.append(checked.batch_error())
        elif checked.code not in ("invalid_json_line", "mismatched_url"):
            sendable += 1  # a request that fails alone (its answer says why)
    if total > max_requests:
        message = (
            f"the file has {total} requests; a batch may hold at most {max_requests} "
            "(--max-batch-requests): split it into several batches"
        )
        errors.insert(0, {"code": "too_many_requests", "message": message, "param": None,
                          "line": None})  # fmt: skip
    elif sendable == 0 and not errors:
        what = "is empty" if total == 0 else "has no line that is a JSON object"
        message = f"the file {what}: a batch file has one request object per line"
        errors.append({"code": "invalid_file", "message": message, "param": None, "line": None})
    return FileCheck(total, errors)


class WrittenLines:
    """The lines an output file of an interrupted run holds, to resume it: ``skip(item)``
    says, for each checked input line in file order, whether its output line is there
    already. Keyed by custom_id; the lines that fail without one (not JSON) and the repeats
    of a custom_id are written in input order as they are met, so the first so many of them
    are the ones written."""

    def __init__(self) -> None:
        self.count = 0  # output lines in the file
        self._done: set[str] = set()
        self._repeats: Counter[str] = Counter()  # custom_id -> its repeats written
        self._anonymous = 0  # lines written with no custom_id

    @classmethod
    def of_output(cls, path: Path) -> WrittenLines:
        """Read ``path`` (an output file), first cutting off a torn last line (one a kill cut
        short). Raises InvalidInputError if it holds a line that is not an output line: a
        file this command did not write is not overwritten."""
        written = cls()
        _cut_torn_tail(path)
        with open(path, "rb") as file:
            for number, raw in numbered_lines(file):
                assert isinstance(raw, bytes), "read with no bound"
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = None
                if not (isinstance(value, dict) and "custom_id" in value and "error" in value):
                    raise InvalidInputError(
                        f"{path} line {number} is not a batch output line: is it the output "
                        "of another command? Name a new output file, or remove this one"
                    )
                written._add(value)
        return written

    def skip(self, item: BatchRequest | LineError) -> bool:
        custom_id = item.custom_id
        if custom_id is None:
            if self._anonymous:
                self._anonymous -= 1
                return True
            return False
        if isinstance(item, LineError) and item.code == DUPLICATE:
            if self._repeats[custom_id]:
                self._repeats[custom_id] -= 1
                return True
            return False
        return custom_id in self._done

    def _add(self, value: dict[str, Any]) -> None:
        self.count += 1
        custom_id, error = value["custom_id"], value.get("error")
        if not isinstance(custom_id, str):
            self._anonymous += 1
        elif isinstance(error, dict) and error.get("code") == DUPLICATE:
            self._repeats[custom_id] += 1
        else:
            self._done.add(custom_id)


def _cut_torn_tail(path: Path) -> None:
    """Drop what follows the last newline of ``path`` (lines are written whole, each ending
    in one: anything after the last is a line cut short)."""
    with open(path, "r+b") as file:
        end = file.seek(0, 2)
        position = end
        while position > 0:
            step = min(1 << 16, position)
            file.seek(position - step)
            block = file.read(step)
            newline = block.rfind(b"\n")
            if newline >= 0:
                position = position - step + newline + 1
                break
            position -= step
        if position != end:
            file.truncate(position)


def count_inputs(body: dict[str, Any]) -> int:
    """About how many engine inputs a request body holds (its longest list of inputs, or 1):
    what a line weighs in the window of lines in flight."""
    sizes = [len(v) for k in _INPUT_FIELDS if isinstance(v := body.get(k), list)]
    return max([1, *sizes])


def _missing(line: int, custom_id: str | None, field: str, what: str) -> LineError:
    return LineError(
        line, custom_id, "missing_required_parameter" if field != "method" else "invalid_method",
        f"line {line}: {field} must be {what}", param=field,
    )  # fmt: skip


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _line(value: dict[str, Any]) -> bytes:
    # ASCII: a custom_id or an error message quoting one may hold a lone surrogate, which UTF-8
    # cannot encode; escaped, every line is valid JSON and valid UTF-8.
    return json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode() + b"\n"
