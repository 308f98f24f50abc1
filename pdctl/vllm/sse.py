"""Reading Server-Sent Events as a client does (the WHATWG event-stream rules), in one place.

* :class:`SSEParser`  -- incremental: :meth:`~SSEParser.feed` bytes as they arrive, get the ``data`` of
  each event they completed; :meth:`~SSEParser.close` at the end of the stream (``pdctl bench``)
* :func:`sse_events`  -- a whole body at once, strictly: what a browser's EventSource would dispatch
  (the N1 invariant's reading of what a client got)

Lines end in CRLF, LF or CR (a CRLF split across two chunks counts once); ``data`` lines of one event are
joined by LF, one leading space after the colon is dropped; comments (``:`` lines, vLLM's and proxies'
keep-alive pings) and other fields are skipped. ``[DONE]`` is an ordinary payload here: what it means is
the caller's business. The gateway's relay (``pdctl.gateway.relay``) does not parse events at all.
"""

from __future__ import annotations

import re

__all__ = ["SSEParser", "sse_events"]

_EOL = re.compile(rb"\r\n|\r|\n")


class SSEParser:
    """Incremental Server-Sent Events parser: feed bytes, get the ``data`` payloads of complete events.

    ``errors`` is how a payload's bytes are decoded from UTF-8 (``"replace"``, or ``"strict"`` to raise
    UnicodeDecodeError).
    """

    def __init__(self, errors: str = "replace") -> None:
        self._errors = errors
        self._buf = b""
        self._data: list[bytes] | None = None
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[str]:
        """Add received bytes; return the payloads of the events they completed."""
        if not chunk:
            return []
        if self._skip_lf and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._skip_lf = False
        buf = self._buf + chunk if self._buf else chunk
        # Most streams use LF only: bytes.split is the fast path; CR or CRLF take the regex.
        lines = buf.split(b"\n") if b"\r" not in buf else _EOL.split(buf)
        self._buf = lines.pop()
        # A CR at the very end: the next chunk may begin with the LF of this CRLF.
        self._skip_lf = not self._buf and buf.endswith(b"\r")
        out: list[str] = []
        for line in lines:
            self._line(line, out)
        return out

    def close(self) -> list[str]:
        """End of stream, leniently: also dispatch a last event that was not followed by a blank line."""
        out: list[str] = []
        if self._buf:
            line, self._buf = self._buf, b""
            self._line(line, out)
        self._line(b"", out)
        return out

    def _line(self, line: bytes, out: list[str]) -> None:
        if line.startswith(b"data:"):
            value = line[5:]
            if self._data is None:
                self._data = []
            self._data.append(value[1:] if value.startswith(b" ") else value)
        elif not line:
            if self._data is not None:
                out.append(b"\n".join(self._data).decode("utf-8", errors=self._errors))
                self._data = None
        elif line == b"data":  # a field name alone: the empty value
            self._data = [*(self._data or []), b""]


def sse_events(data: bytes) -> list[str]:
    """The ``data`` of each event a client's EventSource would dispatch from a whole body.

    An event still open when the body ends is discarded. Raises UnicodeDecodeError on bytes that are not
    UTF-8, anywhere in the body.
    """
    data.decode("utf-8")
    return SSEParser(errors="strict").feed(data)
