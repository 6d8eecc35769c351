"""The body of ``POST /v1/files``: ``multipart/form-data`` parsed as it arrives
(python-multipart's streaming parser, in worker threads), its file part written straight
to the store (`trio_llm.store.files.FileWriter`), within its limits and its deadline.

Every limit is answered as soon as it is passed, not when the body ends, and the
connection is then closed (`trio_llm.api.http.connection_guard`):

- the file part: ``--max-file-size`` (413 ``file_too_large``);
- everything else (boundaries, part headers, the ``purpose`` value, a preamble or an
  epilogue): `MULTIPART_ALLOWANCE` bytes (413 ``request_too_large``); a part has at most
  `MAX_PART_HEADERS` header lines of at most `MAX_PART_HEADER_BYTES` each, ``purpose`` at
  most `MAX_FIELD_BYTES` (400);
- a part other than ``file`` and ``purpose``, or either of them twice: 400 naming it, as
  soon as the part's headers are read;
- the deadline (408 ``request_timeout``): nothing for ``--request-body-timeout`` seconds,
  or the body not in within ``--request-body-timeout`` seconds plus one second per
  ``--upload-min-rate`` bytes received (the time the server spends writing excluded). A
  client that drips holds its connection about ``--request-body-timeout`` seconds; one
  that keeps a connection for longer pays at least ``--upload-min-rate`` bytes a second
  for it, and a file of ``--max-file-size`` has ``max / rate`` seconds more.

Nothing but the current part's headers and the ``purpose`` value is held in memory.
"""

from __future__ import annotations

from contextlib import aclosing

import trio
from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from trio_llm.api.http.body_reading import CLIENT_CLOSED_REQUEST
from trio_llm.api.http.errors import APIError, bad_request
from trio_llm.store.files import UPLOAD_PURPOSES, FileWriter

#: Bytes an upload's body may have besides the file's own (boundaries, part headers,
#: the ``purpose`` value, a preamble and an epilogue).
MULTIPART_ALLOWANCE = 64 * 1024
#: Longest value of the ``purpose`` field (bytes).
MAX_FIELD_BYTES = 1024
#: Most header lines of one part, and the longest one (bytes, without its CRLF).
MAX_PART_HEADERS = 8
MAX_PART_HEADER_BYTES = 4096
#: The parts an upload has (OpenAI's fields): the file, and what it is for.
FIELDS = ("file", "purpose")
#: Most characters of a client's field name repeated in an error.
_NAME_SHOWN = 100


def multipart_boundary(content_type: str | None) -> bytes:
    """The boundary of a ``multipart/form-data`` content type.

    Raises:
        APIError: 400 for another content type, or one without a boundary.
    """
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data" or not options.get(b"boundary"):
        raise bad_request(
            "POST /v1/files takes a multipart/form-data body with the fields `file` and `purpose`"
        )
    return options[b"boundary"]


class MultipartUpload:
    """One upload's body as python-multipart parses it: the ``file`` part goes to
    ``writer``, the ``purpose`` value is kept (short), any other part is refused.

    Blocking (`feed` writes to disk): run `feed` in a worker thread.

    Args:
        writer: where the file's contents go (its ``max_bytes`` is the file's limit).
        boundary: the body's multipart boundary.

    Raises:
        APIError: 400 for a boundary the parser does not take (longer than 256 bytes).
    """

    def __init__(self, writer: FileWriter, boundary: bytes) -> None:
        self.writer = writer
        self.filename: str | None = None
        self.purpose: bytes | None = None
        self.ended = False
        self.received = 0
        self._seen: set[str] = set()
        self._headers: dict[bytes, bytes] = {}
        self._header_name = b""
        self._header_value = b""
        self._part: str | None = None
        self._value = b""
        callbacks = {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value_piece,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }
        try:
            self.parser = MultipartParser(
                boundary,
                callbacks,  # type: ignore[arg-type]
                max_header_count=MAX_PART_HEADERS,
                max_header_size=MAX_PART_HEADER_BYTES,
            )
        except FormParserError as exc:
            raise bad_request(f"the multipart/form-data boundary is not usable: {exc}") from None

    def _part_begin(self) -> None:
        self._headers, self._header_name, self._header_value = {}, b"", b""
        self._part, self._value = None, b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]  # at most MAX_PART_HEADER_BYTES (the parser)

    def _header_value_piece(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header_name.lower()] = self._header_value
        self._header_name, self._header_value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        shown = name[:_NAME_SHOWN]
        if name not in FIELDS:
            if not name:
                raise bad_request("a part of the upload has no name (Content-Disposition)")
            message = (
                f"the form field `{shown}` is not supported by this server: "
                "an upload has the fields `file` and `purpose`"
            )
            raise bad_request(message, shown.split("[", 1)[0])
        if name in self._seen:
            raise bad_request(f"the upload has more than one `{name}` part", name)
        self._seen.add(name)
        self._part = name
        if name == "file":
            try:
                self.filename = options.get(b"filename", b"").decode("utf-8")
            except UnicodeDecodeError:
                raise bad_request("the file's name is not valid UTF-8", "file") from None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part == "file":
            self.writer.write(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise bad_request(f"the form field `{self._part}` is too long", self._part)

    def _part_end(self) -> None:
        if self._part == "purpose":
            self.purpose = self._value

    def _end(self) -> None:
        self.ended = True

    def feed(self, chunk: bytes) -> None:
        """Parse (and write) one chunk of the body (blocking).

        Raises:
            APIError: 400 for a malformed body or a part refused; 413 when the body's
                bytes besides the file pass `MULTIPART_ALLOWANCE`.
            FileTooLarge: the file part passed the writer's ``max_bytes``.
            OSError: the file could not be written.
        """
        self.received += len(chunk)
        try:
            self.parser.write(chunk)
        except FormParserError as exc:
            raise bad_request(f"the multipart/form-data body is malformed: {exc}") from None
        if self.received - self.writer.nbytes > MULTIPART_ALLOWANCE:
            raise APIError(
                413,
                "the upload's form fields, part headers and boundaries take more than "
                f"{MULTIPART_ALLOWANCE} bytes besides the file",
                code="request_too_large",
                headers={"Connection": "close"},
            )

    def fields(self) -> tuple[str, str]:
        """The file's name and purpose, once the body has ended.

        Raises:
            APIError: 400 without a ``file`` part (or a body cut short), without a
                ``purpose`` or with one that is not `UPLOAD_PURPOSES`.
        """
        if not self.ended or self.filename is None:
            raise bad_request("the upload has no `file` part (or it was cut short)", "file")
        allowed = ", ".join(repr(p) for p in UPLOAD_PURPOSES)
        if self.purpose is None:
            raise bad_request(f"the form field `purpose` is required: one of {allowed}", "purpose")
        purpose = self.purpose.decode("utf-8", "replace")
        if purpose not in UPLOAD_PURPOSES:
            raise bad_request(f"purpose must be one of {allowed}, not {purpose!r}", "purpose")
        return self.filename, purpose


def _too_slow(stall: float, min_rate: int, *, stalled: bool) -> APIError:
    """The 408 of an upload past its deadline (``stalled``: nothing came for ``stall`` s)."""
    if stalled:
        message = f"the upload stalled for {stall:g} s (--request-body-timeout)"
    else:
        message = (
            f"the upload arrived slower than {min_rate} bytes/s on average after its first "
            f"{stall:g} s (--upload-min-rate, --request-body-timeout)"
        )
    return APIError(408, message, code="request_timeout", headers={"Connection": "close"})


async def receive_upload(
    request: Request, upload: MultipartUpload, *, stall: float, min_rate: int
) -> None:
    """Feed ``request``'s body to ``upload`` as it arrives, within the upload's deadline
    (module doc): each chunk within ``stall`` seconds of the last, the whole body within
    ``stall + received / min_rate`` seconds, not counting the time spent in `feed`.

    Raises:
        APIError: 408 (``Connection: close``) past either deadline; 499 when the client
            left; what `MultipartUpload.feed` raises.
    """
    start = trio.current_time()
    async with aclosing(request.stream()) as chunks:
        while True:
            stalled_at = trio.current_time() + stall
            due_at = start + stall + upload.received / min_rate
            try:
                with trio.fail_at(min(stalled_at, due_at)):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except trio.TooSlowError:
                raise _too_slow(stall, min_rate, stalled=stalled_at <= due_at) from None
            except ClientDisconnect:
                raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the request") from None
            if chunk:
                began = trio.current_time()
                await trio.to_thread.run_sync(upload.feed, chunk)
                start += trio.current_time() - began  # the server's own time
