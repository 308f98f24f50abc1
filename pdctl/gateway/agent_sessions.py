"""Agent sessions: who a request belongs to (the agents' own headers), and where a session's prompt cache breaks.

**Identity** (:func:`identify`). Coding agents name their session themselves: Claude Code sends
``x-claude-code-session-id`` (and ``x-claude-code-agent-id`` / ``x-claude-code-parent-agent-id`` for sub-agents),
Codex ``session-id`` (some versions a ``session_id`` / ``conversation_id`` body field; vLLM's Responses request has
``session_id``), OpenCode ``x-session-id`` / ``x-parent-session-id``; NVIDIA Dynamo maps the same headers
(docs/agents/session-ids.md in ai-dynamo/dynamo). The first present wins, in :data:`SESSION_HEADERS` order, then the
body (:func:`session_hint`: a Responses ``conversation``, Anthropic's ``metadata.user_id``).
Session ids break routing ties, go to the access log and ``pdctl trace``, never to a metric label. Each is capped:
printable ASCII without spaces or ``=``, at most :data:`MAX_ID` characters (a longer one is cut and a hash of the
whole appended, so two long ids still differ).

**Cache breaks** (:class:`CacheBreaks`). Per session (a bounded LRU), the previous turn's prompt, cut into the parts
of the chat vLLM renders (the tools, the leading system message, each message, a trailing system message), each part
hashed. A new turn is compared part by part: the first part that differs is where the session's cache breaks
(``system``, ``tools``, ``message[n]``, ``trailing_system``), the tokens before it are reused (exact ids where known:
the common prefix of the previous and the new prompt's ids; else the new prompt's tokens in proportion to the
matching characters). ``none``: the new prompt begins with the whole previous one. The location set is small and
fixed (:data:`LOCATIONS`), so it can label a metric.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "LOCATIONS",
    "MAX_ID",
    "MAX_SESSION_CHARS",
    "SESSION_HEADERS",
    "Break",
    "CacheBreaks",
    "Identity",
    "cap_id",
    "identify",
    "session_hint",
]

#: Session headers, in the order they are read (the first present wins).
SESSION_HEADERS = (b"x-session-id", b"x-claude-code-session-id", b"session-id", b"session_id")
#: Longest session id kept as sent.
MAX_ID = 128
Location = Literal["none", "system", "tools", "message", "trailing_system"]
#: Where a session's cache can break (a metric's label values).
LOCATIONS: tuple[Location, ...] = ("none", "system", "tools", "message", "trailing_system")


def cap_id(value: str | bytes | None) -> str | None:
    """``value`` safe for a log field: printable ASCII other than space and ``=`` (others become ``_``), at most
    :data:`MAX_ID` characters (a longer one: its start, ``~`` and 16 hex digits of its SHA-256). None: empty."""
    if value is None:
        return None
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    if not raw:
        return None
    text = "".join(chr(b) if 0x21 <= b <= 0x7E and b != 0x3D else "_" for b in raw[: MAX_ID + 1])
    if len(raw) > MAX_ID:
        text = text[: MAX_ID - 17] + "~" + hashlib.sha256(raw).hexdigest()[:16]
    return text


@dataclass(frozen=True, slots=True)
class Identity:
    """A request's session, and its agent within it (a sub-agent names its parent)."""

    session: str
    agent: str | None = None
    parent: str | None = None

    def log_fields(self) -> str:
        """Access-log fields (``session=... agent=... parent=...``)."""
        out = f"session={self.session}"
        if self.agent:
            out += f" agent={self.agent}"
        if self.parent:
            out += f" parent={self.parent}"
        return out


#: A session id longer than this is kept as its digest: the same session still sticks, and 65,536 of them cost
#: kilobytes each at most, not what a client chose to send.
MAX_SESSION_CHARS = 128


def _bounded(session: str) -> str:
    if len(session) <= MAX_SESSION_CHARS:
        return session
    return "blake2b:" + hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def session_hint(body: Mapping[str, Any], header: str | None = None) -> str | None:
    """The request's session, for tie-breaks: the ``x-session-id`` header, else a Responses ``conversation`` (a
    string or ``{"id": ...}``), else Anthropic's ``metadata.user_id`` (Claude Code puts its session there); one
    longer than :data:`MAX_SESSION_CHARS` as its digest."""
    if header:
        return _bounded(header)
    conv = body.get("conversation")
    if isinstance(conv, dict):
        conv = conv.get("id")
    if isinstance(conv, str) and conv:
        return _bounded(conv)
    meta = body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, dict) else None
    return _bounded(user) if isinstance(user, str) and user else None


def identify(header: Callable[[bytes], bytes | None], body: Mapping[str, Any]) -> Identity | None:
    """The session of a request from its headers (``header(name)``: the value or None), else its body."""
    session = next((v for n in SESSION_HEADERS if (v := cap_id(header(n))) is not None), None)
    if session is None:
        for name in ("session_id", "conversation_id"):
            value = body.get(name)
            if isinstance(value, str) and (session := cap_id(value)) is not None:
                break
    if session is None:
        session = cap_id(session_hint(body))
    if session is None:
        return None
    agent = cap_id(header(b"x-claude-code-agent-id"))
    parent = cap_id(header(b"x-claude-code-parent-agent-id")) or cap_id(header(b"x-parent-session-id"))
    return Identity(session, agent, parent)


@dataclass(frozen=True, slots=True)
class Break:
    """How a turn's prompt compares with its session's previous turn."""

    location: Location
    where: str
    """The part, in the terms of the request: ``system``, ``tools``, ``message[3]``, ``trailing_system``, ``-``."""
    reused_tokens: int
    prompt_tokens: int

    def log_fields(self) -> str:
        """Access-log fields."""
        return f"cache_break={self.where} reused_tokens={self.reused_tokens}"


def _parts(parts: Sequence[tuple[str, str, str]]) -> list[tuple[str, Location, int, int]]:
    """(name, location, hash, characters) of :func:`pdctl.gateway.conversation.prompt_parts`' parts."""
    last_other = max((i for i, p in enumerate(parts) if p[1] not in ("system", "tools")), default=-1)
    out: list[tuple[str, Location, int, int]] = []
    for i, (name, role, text) in enumerate(parts):
        location: Location = "message"
        if role == "tools":
            location = "tools"
        elif role == "system" and name == "message[0]":
            location = "system"
        elif role == "system" and i > last_other:
            location = "trailing_system"
        out.append((name if location != "system" else "system", location, hash(text), len(text)))
    return out


@dataclass(slots=True)
class _Turn:
    parts: list[tuple[str, Location, int, int]]
    ids: tuple[int, ...] | None


class CacheBreaks:
    """Per session, the previous turn's prompt parts (and token ids), at most ``capacity`` sessions (LRU)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._last: OrderedDict[str, _Turn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def observe(
        self, session: str, prompt: Sequence[tuple[str, str, str]], prompt_tokens: int,
        ids: Sequence[int] | None = None,
    ) -> Break | None:  # fmt: skip
        """Compare this turn (its :func:`pdctl.gateway.conversation.prompt_parts`) with ``session``'s previous one
        (None: its first turn here), then remember this one."""
        parts = _parts(prompt)
        turn = _Turn(parts, tuple(ids) if ids is not None else None)
        prev = self._last.pop(session, None)
        self._last[session] = turn
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
        if prev is None:
            return None
        same = 0
        location: Location
        while same < min(len(prev.parts), len(parts)) and prev.parts[same][2] == parts[same][2]:
            same += 1
        if same == len(prev.parts):
            where, location = "-", "none"
        else:
            where, location = prev.parts[same][0], prev.parts[same][1]
            if location == "message" and same < len(parts) and parts[same][1] == "trailing_system":
                location = "trailing_system"  # a system turn appended where the conversation went on before
        if prev.ids is not None and turn.ids is not None:
            reused = 0
            for a, b in zip(prev.ids, turn.ids, strict=False):
                if a != b:
                    break
                reused += 1
        else:
            chars = sum(p[3] for p in parts) or 1
            reused = prompt_tokens * sum(p[3] for p in parts[:same]) // chars
        return Break(location, where, min(reused, prompt_tokens), prompt_tokens)
