"""Simulated KV cache: deterministic bytes, the prefill-side store with leases, the NIXL-like side channel
(a real asyncio TCP server and client), and ExampleConnector-style shared-storage files.

KV bytes of a prompt are a hash chain over its token ids seeded by ``--sim-seed`` and the ``--model`` string,
so position *i* depends on every token before it (as real attention KV does), expanded to
``per_token_bytes`` = ``2·L·kv_heads·head_dim·dtype_bytes·kv_scale`` (at least 16) bytes per token.

Side-channel wire format (one TCP connection per pull; every message is one JSON line, ``\\n``-terminated)::

    C: {"op": "handshake", "engine_id": E, "compat_hash": H}
    S: {"ok": true, "engine_id": E', "compat_hash": H'}            (or closes: handshake_setup_failed)
    C: {"op": "read", "request_id": R, "start_token": K}
    S: {"ok": true, "num_tokens": N, "nbytes": B}  followed by B raw bytes
       {"ok": false, "error": "..."}                               (unknown or expired request)
    C: {"op": "done", "request_id": R}                              (decode finished reading: free the blocks)
    S: {"ok": true}

A malformed line closes that connection only; the listener keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HeldKV",
    "KVPullError",
    "KVStore",
    "SideChannelServer",
    "compat_hash",
    "compute_kv",
    "context_state",
    "next_state",
    "pull_kv",
    "read_shared",
    "shared_folder",
    "write_shared",
]

_MAX_LINE = 1 << 16


def compute_kv(seed: int, model: str, token_ids: Sequence[int], per_token: int, start: int = 0) -> bytes:
    """KV bytes of ``token_ids[start:]`` (the chain still runs over the whole prefix)."""
    h = _chain_start(seed, model)
    reps = per_token // 32 + 1
    out = bytearray()
    for i, tok in enumerate(token_ids):
        h = next_state(h, tok)
        if i >= start:
            out += (h * reps)[:per_token]
    return bytes(out)


def _chain_start(seed: int, model: str) -> bytes:
    return hashlib.blake2b(f"{seed}:{model}".encode(), digest_size=32).digest()


def next_state(state: bytes, tok: int) -> bytes:
    """The KV chain one token further: what :func:`compute_kv` computes for the token after ``state``'s."""
    return hashlib.blake2b(state + tok.to_bytes(4, "little"), digest_size=32).digest()


def context_state(seed: int, model: str, token_ids: Sequence[int], per_token: int, data: bytes) -> bytes:
    """What the engine's next token depends on, given the prompt's KV bytes ``data`` as it holds them.

    Intact KV gives the chain's last value, the same whether a token was in the prompt or generated (each
    generated token then advances it with :func:`next_state`), so a request re-issued with the tokens generated
    so far appended to its prompt continues token for token, as a causal model does. Corrupted KV gives a digest
    of the bytes held: another output."""
    h = _chain_start(seed, model)
    reps = per_token // 32 + 1
    view = memoryview(data)
    if len(data) != per_token * len(token_ids):
        return hashlib.sha256(data).digest()
    for i, tok in enumerate(token_ids):
        h = next_state(h, tok)
        if view[i * per_token : (i + 1) * per_token] != (h * reps)[:per_token]:
            return hashlib.sha256(data).digest()
    return h


def compat_hash(model: str, dtype: str, kv_heads: int, head_dim: int, layers: int) -> str:
    """What NIXL's handshake compares: version, the model string as passed, dtype and KV shape."""
    text = f"vllm-0.32.0|{model}|{dtype}|{kv_heads}|{head_dim}|{layers}|FLASH_ATTN|auto|pull"
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(slots=True)
class HeldKV:
    """KV a prefill keeps for a decode to pull."""

    request_id: str
    data: bytes
    num_tokens: int
    block_ids: list[int]
    expires_at: float


class KVStore:
    """Prefill-side KV held per request until pulled (``done``) or until its lease expires."""

    def __init__(
        self,
        block_size: int,
        on_expire: Callable[[HeldKV], None] | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self._held: dict[str, HeldKV] = {}
        self._next_block = 1
        self._on_expire = on_expire
        self._on_release = on_release

    def hold(self, request_id: str, data: bytes, num_tokens: int, lease_s: float) -> HeldKV:
        """Keep ``data`` for ``lease_s`` seconds (wall clock) and give it block ids."""
        nblocks = max(1, -(-num_tokens // self.block_size))
        blocks = list(range(self._next_block, self._next_block + nblocks))
        self._next_block += nblocks
        held = HeldKV(request_id, data, num_tokens, blocks, time.monotonic() + lease_s)
        self._held[request_id] = held
        return held

    def get(self, request_id: str) -> HeldKV | None:
        """The held KV of ``request_id`` if still leased."""
        return self._held.get(request_id)

    def release(self, request_id: str) -> bool:
        """Free the blocks of ``request_id``; False if it was not held."""
        freed = self._held.pop(request_id, None) is not None
        if freed and self._on_release is not None:
            self._on_release()  # an idle engine takes no step that would refresh its KV gauge
        return freed

    @property
    def held_tokens(self) -> int:
        """Tokens of KV currently held for remote decodes."""
        return sum(h.num_tokens for h in self._held.values())

    def expire(self, now: float | None = None) -> list[HeldKV]:
        """Release every lease that ran out; returns them."""
        now = time.monotonic() if now is None else now
        gone = [h for h in self._held.values() if h.expires_at <= now]
        for h in gone:
            del self._held[h.request_id]
            if self._on_expire is not None:
                self._on_expire(h)
        return gone

    async def expire_loop(self, period_s: float = 0.25) -> None:
        """Run ``expire`` forever."""
        while True:
            await asyncio.sleep(period_s)
            self.expire()


class SideChannelServer:
    """The prefill's side-channel listener serving ``KVStore`` contents."""

    def __init__(
        self,
        store: KVStore,
        engine_id: str,
        compat: str,
        *,
        corrupt: Callable[[], bool] = lambda: False,
        drop_handshake: Callable[[], bool] = lambda: False,
        on_message: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self._welcome = {"ok": True, "engine_id": engine_id, "compat_hash": compat}  # every handshake's answer
        self._corrupt = corrupt
        self._drop_handshake = drop_handshake
        self._on_message = on_message
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = any free port); returns the bound port."""
        self._server = await asyncio.start_server(self._handle, host, port, limit=_MAX_LINE)
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, KeyError, TypeError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = json.loads(await reader.readline())
        if hello.get("op") != "handshake":
            return
        if self._on_message is not None:
            self._on_message("handshake")
        if self._drop_handshake():
            return
        await _send(writer, self._welcome)
        while True:
            line = await reader.readline()
            if not line:
                return
            msg = json.loads(line)
            op = msg.get("op")
            rid = str(msg.get("request_id"))
            if op == "read":
                held = self.store.get(rid)
                if held is None:
                    await _send(writer, {"ok": False, "error": f"no KV held for request {rid}"})
                    continue
                per_token = len(held.data) // max(1, held.num_tokens)
                start = max(0, min(int(msg.get("start_token", 0)), held.num_tokens))
                data = held.data[start * per_token :]
                if data and self._corrupt():
                    data = _flip(data)
                await _send(writer, {"ok": True, "num_tokens": held.num_tokens - start, "nbytes": len(data)})
                writer.write(data)
                await writer.drain()
            elif op == "done":
                self.store.release(rid)
                await _send(writer, {"ok": True})
            else:
                return


def _flip(data: bytes) -> bytes:
    """Corrupt a few bytes spread over the payload."""
    buf = bytearray(data)
    step = max(1, len(buf) // 7)
    for i in range(0, len(buf), step):
        buf[i] ^= 0xA5
    return bytes(buf)


async def _send(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
    await writer.drain()


class KVPullError(Exception):
    """A failed pull; ``kind`` is NIXL's failure type (``handshake_setup_failed``, ``transfer_failed``, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class PullResult:
    """Bytes read from a prefill and how long the handshake took."""

    data: bytes
    num_tokens: int
    remote_engine_id: str
    handshake_s: float


async def pull_kv(
    host: str,
    port: int,
    request_id: str,
    start_token: int,
    engine_id: str,
    compat: str,
    *,
    expected_engine_id: str | None = None,
    timeout_s: float = 30.0,
) -> PullResult:
    """Handshake with a prefill's side channel, read ``request_id``'s KV from ``start_token``, free it."""
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=_MAX_LINE), timeout_s)
    except (TimeoutError, OSError) as e:
        raise KVPullError("handshake_setup_failed", f"cannot connect to tcp://{host}:{port}: {e}") from None
    try:
        await _send(writer, {"op": "handshake", "engine_id": engine_id, "compat_hash": compat})
        try:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
        except (TimeoutError, OSError):
            line = b""
        if not line:
            raise KVPullError("handshake_setup_failed", "side channel closed during the handshake")
        hello = json.loads(line)
        remote_engine = str(hello.get("engine_id"))
        if hello.get("compat_hash") != compat:
            raise KVPullError("handshake_failed", f"NIXL compatibility hash mismatch: {hello.get('compat_hash')}")
        if expected_engine_id is not None and remote_engine != expected_engine_id:
            raise KVPullError("handshake_failed", f"Remote NIXL agent engine ID mismatch: {remote_engine}")
        handshake_s = time.monotonic() - t0
        await _send(writer, {"op": "read", "request_id": request_id, "start_token": start_token})
        head = json.loads(await asyncio.wait_for(reader.readline(), timeout_s) or b"{}")
        if not head.get("ok"):
            raise KVPullError("transfer_failed", str(head.get("error", "read refused")))
        data = await asyncio.wait_for(reader.readexactly(int(head["nbytes"])), timeout_s)
        await _send(writer, {"op": "done", "request_id": request_id})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.readline(), timeout_s)
        return PullResult(data, int(head["num_tokens"]), remote_engine, handshake_s)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        raise KVPullError("transfer_failed", f"{type(e).__name__}: {e}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def shared_folder(root: str, token_ids: Sequence[int]) -> str:
    """ExampleConnector's folder for a prompt: md5 of its token ids."""
    digest = hashlib.md5(",".join(map(str, token_ids)).encode(), usedforsecurity=False).hexdigest()
    return os.path.join(root, digest)


def write_shared(root: str, token_ids: Sequence[int], data: bytes) -> str:
    """Save a prompt's KV under ``root`` (atomic rename); returns the folder."""
    folder = shared_folder(root, token_ids)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "kv.bin")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return folder


def read_shared(root: str, token_ids: Sequence[int]) -> bytes | None:
    """The saved KV of a prompt, or None."""
    path = os.path.join(shared_folder(root, token_ids), "kv.bin")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None
