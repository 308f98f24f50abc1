"""The chunk-by-chunk relay of a worker's (or the upstream's) response to the client, SSE or whole.

The relay forwards each chunk as it arrives, decode's bytes as they are (no re-framing); the chunk holding a
stream's final event goes out with the end of the response in one write when the worker's body is already
complete (never by waiting for it). Per chunk it only counts ``data:`` occurrences (a C-level
``bytes.count``) and keeps a short tail; usage and ``[DONE]`` are read from that tail at the end. The agent
routes end differently (:data:`END_EVENTS`: ``response.completed``, ``response.incomplete`` or ``response.failed``
for Responses, ``message_stop`` for Anthropic Messages, none followed by ``[DONE]``); their end is looked for in each
chunk, since a Responses stream's last event carries the whole response and may be longer than the tail. It reads
any :class:`Body` (a worker's :class:`pdctl.vllm.transport.Response`, or the upstream's adapter), whose failures are
:class:`pdctl.vllm.transport.TransportError`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdctl.gateway.direct import ClientSocket, client_socket
from pdctl.gateway.errors import ApiError, Wire, error_event
from pdctl.gateway.record import RequestRecord
from pdctl.vllm.transport import TransportError

if TYPE_CHECKING:
    pass

__all__ = ["END_EVENTS", "Body", "Kept", "RelayResult", "relay"]

ASGISend = Any
_TAIL = 4096
#: A partial event held back longer than this goes out as it is: a worker or upstream that never sends a blank
#: line costs neither unbounded memory nor a rescan of an ever longer buffer per piece.
MAX_PENDING = 1 << 20
#: A migratable stream keeps at most this many pieces as received; older ones are folded into one summary event
#: (:func:`pdctl.gateway.migration.summary_event`: ids, token ids, finish, usage), all a continuation needs.
KEEP_PIECES = 256
_KEEP_TAIL = 32
_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_PROMPT_IDS = b'"prompt_token_ids":['
#: A choice's ``token_ids``, as vLLM's ``return_token_ids`` writes it (after ``finish_reason``, so after a comma).
_TOKEN_IDS = re.compile(rb',\s*"token_ids"\s*:\s*\[[0-9,\s]*\]')
#: The events that end a stream, per wire. A Responses stream ends with one of the three terminal events of
#: OpenAI's Responses API: vLLM 0.33 ends a reply cut by ``max_output_tokens`` with ``response.incomplete``
#: (``vllm/entrypoints/openai/responses/serving.py``), 0.32 with ``response.completed`` either way.
END_EVENTS: dict[Wire, tuple[bytes, ...]] = {
    "openai": (b"[DONE]",),
    "responses": (b"event: response.completed", b"event: response.incomplete", b"event: response.failed"),
    "anthropic": (b"event: message_stop",),
}


class Body(Protocol):
    """A response body to relay: whole, or piece by piece (``b""`` at its end). A body may also have
    ``at_end()``: True when everything has arrived and been read (:class:`pdctl.vllm.transport.Response` has it), so
    the relay sends the stream's last chunk and the end of the response in one write."""

    async def read(self) -> bytes: ...

    async def chunk(self) -> bytes: ...


@dataclass(slots=True)
class RelayResult:
    """What a relay saw."""

    first_chunk_at: float | None = None
    last_chunk_at: float | None = None
    events: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    done: bool = False
    error: ApiError | None = None
    direct: int = 0
    """Pieces written on the direct path (:mod:`pdctl.gateway.direct`), not through ASGI's ``send``."""


@dataclass(slots=True)
class Kept:
    """A migratable stream's events (:mod:`pdctl.gateway.migration` reads them if it breaks), and the prompt's
    token ids. The ids are there because the gateway asked vLLM for ``return_token_ids``: unless the client asked
    for them too, the client's copy of each event goes without them (the prompt's in the first event, each
    choice's ``token_ids``), as vLLM would have sent it. ``fold`` (:func:`pdctl.gateway.migration.summary_event`,
    handed in by whoever keeps a stream, so this module does not import migration) turns a long stream's older
    pieces into one event that reads back the same; without it every piece is kept."""

    show_prompt_ids: bool = False
    fold: Callable[[list[bytes], list[int] | None], bytes] | None = None
    events: list[bytes] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    _looked: int = 0

    def add(self, chunk: bytes) -> bytes:
        """Keep ``chunk`` (whole events); returns what the client gets of it."""
        if self.prompt_ids is None and self._looked < 4:  # vLLM sends them in its first event
            self._looked += 1
            i = chunk.find(_PROMPT_IDS)
            j = chunk.find(b"]", i) if i >= 0 else -1
            if j >= 0:
                try:
                    self.prompt_ids = json.loads(chunk[i + len(_PROMPT_IDS) - 1 : j + 1])
                except ValueError:
                    self.prompt_ids = None
                if not self.show_prompt_ids:
                    chunk = chunk[:i] + b'"prompt_token_ids":null' + chunk[j + 1 :]
        self.events.append(chunk)
        if self.fold is not None and len(self.events) >= KEEP_PIECES:
            self.events[:-_KEEP_TAIL] = [self.fold(self.events[:-_KEEP_TAIL], self.prompt_ids)]
        return chunk if self.show_prompt_ids else _TOKEN_IDS.sub(b"", chunk)


class _Stream:
    """A relayed stream's bookkeeping, piece by piece: events counted, a short tail kept (usage and the end are
    read from it at the end), a partial event held back until its blank line arrives, arrival times.

    :meth:`give` is the direct path's sink (:meth:`pdctl.vllm.transport.Response.forward`): it runs inside the worker
    connection's read callback and writes to the client's socket (:mod:`pdctl.gateway.direct`), or declines while
    the relay task holds a piece it has not written yet (``busy``) or the client's socket cannot take one.
    """

    __slots__ = ("busy", "copy", "direct", "end", "ended", "events", "first_at", "keep", "last_at", "out", "pending",
                 "tail")  # fmt: skip

    def __init__(
        self, wire: Wire, out: ClientSocket | None, keep: Kept | None = None, copy: list[bytes] | None = None
    ) -> None:
        self.end = None if wire == "openai" else END_EVENTS[wire]
        self.ended = False
        self.events = 0
        self.tail = b""
        self.pending = b""  # an event split across pieces, held until its blank line arrives
        self.first_at: float | None = None
        self.last_at = 0.0
        self.out = out
        self.busy = False
        self.direct = 0
        self.keep = keep
        self.copy = copy

    def take(self, chunk: bytes) -> bytes:
        """Account for ``chunk``; returns the whole events ready to go out (maybe ``b""``)."""
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.events += chunk.count(b"data:")
        tail = self.tail
        if self.end is not None and not self.ended:
            seen = tail[-32:] + chunk
            self.ended = any(end in seen for end in self.end)
        self.tail = (tail + chunk)[-_TAIL:] if len(chunk) < _TAIL else chunk[-_TAIL:]
        if self.pending:
            chunk = self.pending + chunk
            self.pending = b""
        if not chunk.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
            # Every blank line contains one of these pairs, whatever mix of CR, LF and CRLF the worker uses.
            cut = max(_end_of(chunk, b"\n\n"), _end_of(chunk, b"\r\n\r\n"), _end_of(chunk, b"\r\r"),
                      _end_of(chunk, b"\n\r"))  # fmt: skip
            chunk, self.pending = chunk[:cut], chunk[cut:]
            if len(self.pending) > MAX_PENDING:
                chunk, self.pending = chunk + self.pending, b""
        if self.keep is not None and chunk:
            chunk = self.keep.add(chunk)
        if self.copy is not None and chunk:
            self.copy.append(chunk)
        return chunk

    def give(self, chunk: bytes) -> bool:
        out = self.out
        if self.busy or out is None or not out.writable():
            return False
        ready = self.take(chunk)
        if ready:
            out.write(ready)
            self.direct += 1
        return True


async def relay(
    ex: RequestRecord, resp: Body, stream: bool, first_timeout_s: float | None = None, keep: Kept | None = None
) -> RelayResult:
    """Forward a 200 response to the client; a failure after headers ends with one SSE error event, or, with
    ``keep`` (a migratable stream: the events forwarded are kept there), leaves the response open for the caller
    to continue or end.

    Streams: ``first_timeout_s`` bounds the wait for the first chunk; every later wait is bounded by the
    client's read timeout (an idle timeout, as nginx's ``proxy_read_timeout``). A body that can
    :meth:`~pdctl.vllm.transport.Response.forward` under a server with a direct path (:mod:`pdctl.gateway.direct`)
    goes to the client from the worker connection's read callback, from its first piece on (after it when
    ``first_timeout_s`` is given); this task then wakes for the end, a failure, or a piece the client's socket
    could not take at once.
    """
    out = RelayResult()
    if not stream:
        try:
            data = await resp.read()
        except TransportError as exc:
            if exc.kind == "timeout":
                raise ApiError(504, "the worker did not finish in time", code="upstream_timeout") from None
            raise ApiError(502, f"the worker failed mid-response ({exc.kind})", code="upstream_error") from None
        out.first_chunk_at = out.last_chunk_at = time.monotonic()
        m = _COMPLETION_TOKENS.search(data)
        out.completion_tokens = int(m.group(1)) if m else None
        m = _PROMPT_TOKENS.search(data)
        out.prompt_tokens = int(m.group(1)) if m else None
        out.done = True
        if ex.transcript is not None:
            ex.transcript.append(data)
        await ex.respond(200, data)
        return out
    await ex.start(200, b"text/event-stream; charset=utf-8")
    send = ex.send
    read = resp.chunk
    forward = getattr(resp, "forward", None)
    st = _Stream(ex.wire, client_socket(send) if forward is not None else None, keep, ex.transcript)
    last_events = END_EVENTS[ex.wire]
    at_end = getattr(resp, "at_end", None)
    final = b""  # the stream's last events, when its whole body is in: sent with the body's end, in one write
    forwarding = False
    try:
        if first_timeout_s is not None:
            # The first token waits for the KV handoff: its own deadline (kv_transfer.timeout_ms).
            chunk = await asyncio.wait_for(read(), timeout=first_timeout_s)
        else:
            if st.out is not None and forward is not None:
                # From the first piece on: the first token then costs no wake-up of this task, which under load
                # is a whole turn of the event loop.
                forward(st.give)
                forwarding = True
            chunk = await read()
        while chunk:
            chunk = st.take(chunk)
            if final:
                st.busy = True
                await send({"type": "http.response.body", "body": final, "more_body": True})
                final = b""
            if chunk:
                if at_end is not None and any(e in chunk for e in last_events) and at_end():
                    final = chunk  # the next read returns b"" at once: never a wait for the end
                else:
                    st.busy = True
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            st.busy = False
            if st.out is not None and forward is not None and not forwarding:
                forward(st.give)
                forwarding = True
            chunk = await read()
    except TimeoutError:
        out.error = ApiError(
            504, f"no first token within {first_timeout_s}s (the KV handoff deadline)", code="upstream_timeout"
        )
    except TransportError as exc:
        if exc.kind == "timeout":
            out.error = ApiError(504, "the worker stalled: no data within the read timeout", code="upstream_timeout")
        else:
            out.error = ApiError(502, f"the worker's stream broke ({exc.kind})", code="upstream_error")
    if forwarding:
        resp.forward(None)  # type: ignore[attr-defined]  # nothing reaches the client's socket after the end
    out.events = st.events
    out.direct = st.direct
    if st.first_at is not None:
        out.first_chunk_at = st.first_at
        out.last_chunk_at = st.last_at
    tail, pending = st.tail, st.pending
    out.done = (st.ended if st.end is not None else b"[DONE]" in tail) and not pending.strip()
    if out.error is None and not out.done:
        out.error = ApiError(502, "the worker's stream ended before its final event", code="upstream_error")
    counts = _COMPLETION_TOKENS.findall(tail)
    if counts:
        out.completion_tokens = int(counts[-1])
    else:
        out.completion_tokens = max(0, out.events - (1 if out.done else 0))
    if out.error is not None:
        # A partial event is never forwarded: the client sees whole events, then one error event.
        ex.error_code = out.error.code
        if keep is not None:
            if final:
                await send({"type": "http.response.body", "body": final, "more_body": True})
            return out
        await ex.body(final + error_event(out.error, ex.wire))
    else:
        await ex.body(final + pending)
    return out


def _end_of(data: bytes, sep: bytes) -> int:
    i = data.rfind(sep)
    return i + len(sep) if i >= 0 else 0
