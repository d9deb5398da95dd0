"""An upload's multipart form, read as it arrives: the file part straight to disk, a megabyte at
a time off the event loop, the text fields kept (each a few bytes), anything else refused by
name. A file of any size takes about ``FLUSH_BYTES`` of memory.

FastAPI's ``UploadFile`` would spool the file to a temporary file of its own (another copy,
on another disk) before the route could look at the form; this reads it once, into the
store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header

from .errors import APIError

__all__ = ["FLUSH_BYTES", "FormSpec", "ReceivedForm", "receive_form"]

# File bytes gathered before one write to disk: few writes, little memory.
FLUSH_BYTES = 1 << 20
_MAX_FIELD_BYTES = 1024  # a text field's value (purpose, expires_after[seconds]...)


@dataclass(frozen=True)
class FormSpec:
    """What a form may hold: one file part named ``file_field`` of at most ``max_file_bytes``
    (``too_large()`` the error past it), and text fields named in ``text_fields``."""

    file_field: str
    text_fields: frozenset[str]
    max_file_bytes: int
    too_large: Callable[[], APIError]


@dataclass
class ReceivedForm:
    """A form as read: its text fields, and the file's name and size (written to the sink)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # None: no file part came
    size: int = 0


async def receive_form(
    content_type: str,
    chunks: AsyncIterator[bytes],
    spec: FormSpec,
    write: Callable[[bytes], Awaitable[None]],
) -> ReceivedForm:
    """Parse a multipart/form-data body from ``chunks``, handing the file's bytes to ``write``
    in pieces of about ``FLUSH_BYTES``. Raises a 400 ``APIError`` naming what is wrong (not
    multipart, an unknown or repeated field, a field too long), or ``spec.too_large()``."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise _bad(None, "the upload must be multipart/form-data with a boundary")
    reader = _PartReader(spec)
    parser = MultipartParser(boundary, reader.callbacks())  # type: ignore[arg-type]
    async for chunk in chunks:
        try:
            parser.write(chunk)
        except APIError:
            raise
        except Exception as exc:  # the parser's own errors: a malformed body
            raise _bad(None, f"the multipart body is malformed: {exc}") from exc
        if len(reader.pending) >= FLUSH_BYTES:
            await _flush(reader, write)
    if not reader.ended:
        raise _bad(None, "the multipart body ends before its closing boundary")
    await _flush(reader, write)
    return reader.form


async def _flush(reader: _PartReader, write: Callable[[bytes], Awaitable[None]]) -> None:
    if reader.pending:
        data = bytes(reader.pending)
        reader.pending.clear()
        await write(data)


class _PartReader:
    """The parser's callbacks: which part is being read, and where its bytes go."""

    def __init__(self, spec: FormSpec) -> None:
        self.spec = spec
        self.form = ReceivedForm()
        self.pending = bytearray()  # file bytes not yet handed to the writer
        self.ended = False
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._part: str | None = None  # the field being read
        self._value = bytearray()  # a text field's value

    def callbacks(self) -> dict[str, Callable]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self._header_name.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _begin(self) -> None:
        self._headers, self._part = {}, None
        self._value.clear()

    def _header_end(self) -> None:
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        disposition, options = parse_options_header(self._headers.get(b"content-disposition"))
        if disposition != b"form-data" or b"name" not in options:
            raise _bad(None, "a part of the form has no Content-Disposition: form-data; name=")
        name = options[b"name"].decode("utf-8", errors="replace")
        if name == self.spec.file_field:
            if self.form.filename is not None:
                raise _bad(name, f"the form holds more than one {name!r} part; send one file")
            filename = options.get(b"filename", b"")
            self.form.filename = filename.decode("utf-8", errors="replace")
        elif name in self.spec.text_fields:
            if name in self.form.fields:
                raise _bad(name, f"the form holds {name!r} twice; send it once")
        else:
            known = ", ".join(sorted({self.spec.file_field, *self.spec.text_fields}))
            raise _bad(name, f"unknown form field {name!r}: this route takes {known}")
        self._part = name

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._part == self.spec.file_field:
            self.form.size += end - start
            if self.form.size > self.spec.max_file_bytes:
                raise self.spec.too_large()
            self.pending.extend(data[start:end])
        else:
            self._value.extend(data[start:end])
            if len(self._value) > _MAX_FIELD_BYTES:
                raise _bad(self._part, f"{self._part} is longer than {_MAX_FIELD_BYTES} bytes")

    def _part_end(self) -> None:
        if self._part is not None and self._part != self.spec.file_field:
            try:
                self.form.fields[self._part] = self._value.decode("utf-8")
            except UnicodeDecodeError:
                raise _bad(self._part, f"{self._part} is not UTF-8 text") from None

    def _end(self) -> None:
        self.ended = True


def _bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")
