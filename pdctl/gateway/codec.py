"""JSON bodies on the gateway's request path: what it sends to the workers and the upstream, and the prefill's
answer, through msgspec's C codec (a dependency of vLLM's too) instead of the standard library's ``json``.

What the encoder writes differently from ``json.dumps(body, separators=(",", ":"))``, with the same values:
non-ASCII text as UTF-8 instead of ``\\u`` escapes, floats in their shortest form (``1e-7``, not ``1e-07``).
Where msgspec cannot write what ``json`` would (a string with a lone surrogate) the body goes through ``json``.
Non-finite floats never reach it: msgspec would write them as ``null`` and ``json`` as ``Infinity``, and the
client's body refuses them at the door (:func:`pdctl.gateway.request.parse_body`).

The client's own body is not decoded here: it needs the standard library's hooks for duplicate keys and the
``NaN``/``Infinity`` constants, which msgspec has no way to report. The measured difference is in
docs/performance.md, "CPU per chunk and per request".
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

__all__ = ["decode", "encode"]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def encode(body: Any) -> bytes:
    """``body`` as compact JSON."""
    try:
        return _encode(body)
    except (UnicodeEncodeError, msgspec.EncodeError, TypeError):
        return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """A worker's JSON answer; ``ValueError`` when it is not JSON (also for a number out of a float's range)."""
    return _decode(data)
