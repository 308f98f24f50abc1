"""Per-user API keys: the keys file, its reload, and the lookup of a request's key in constant time.

The keys file (``gateway.keys_file``, JSON, written by ``pdctl keys add``) never holds a key, only its
SHA-256 digest; an entry may instead name an environment variable that holds the key::

    {"keys": [
      {"name": "alice", "sha256": "<64 hex>", "requests_per_minute": 60, "tokens_per_minute": 200000,
       "max_concurrency": 4, "models": ["qwen"], "upstream": false},
      {"name": "ci", "env": "PDCTL_CI_KEY"}
    ]}

``models`` (default: every model) lists the model names the key may use; ``upstream`` (default true) whether
it may reach the upstream channel. Limits are per key, on top of ``gateway.rate_limit``. The key in
``$gateway.api_key_env`` is named ``default`` (the one key without a keys file; with one, the operator's key
for ``pdctl verify``/``bench`` when the variable is set, so ``default`` is reserved).

:class:`KeyRing` is what the gateway asks: :meth:`KeyRing.identify` hashes the bearer token and compares it
with every digest (``hmac.compare_digest``, no early exit); :meth:`KeyRing.reload` re-reads the file
(SIGHUP, or :meth:`KeyRing.reload_if_changed` on a timer) and keeps the old keys when the new file is bad.
Limiters survive a reload for names whose limits did not change.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.config import Key, RateLimitConfig, file_keys
from pdctl.errors import ConfigError, PdctlError
from pdctl.gateway.ratelimit import RateLimiter

__all__ = [
    "DEFAULT_NAME",
    "KeyEntry",
    "KeyRing",
    "add_key",
    "hash_key",
    "load_keys",
    "new_key",
    "revoke_key",
]

DEFAULT_NAME = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_LIMITS = file_keys(RateLimitConfig)  # the same keys and checks as gateway.rate_limit
_FIELDS = ("name", "sha256", "env", "models", "upstream", *_LIMITS)
log = logging.getLogger("pdctl.gateway")


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One client key: its name (the metric label), digest, limits and what it may use."""

    name: str
    digest: bytes
    limits: RateLimitConfig = field(default_factory=RateLimitConfig)
    models: tuple[str, ...] | None = None
    upstream: bool = True

    def may_use(self, model: str) -> bool:
        """Whether ``models`` allows ``model`` (no list: every model)."""
        return self.models is None or model in self.models


def hash_key(key: str) -> str:
    """The hex SHA-256 digest stored for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh high-entropy key (256 bits), OpenAI-style ``sk-`` prefix."""
    return "sk-pdctl-" + secrets.token_urlsafe(32)


def _err(path: Path, text: str, key: str, message: str, hint: str | None = None) -> ConfigError:
    return ConfigError(path.name, key, message, line=_line(text, key), hint=hint)


def _line(text: str, key: str) -> int | None:
    """Line of ``keys[i]`` or ``keys[i].field``: the i-th element's span in the array, then the field in it."""
    m = re.match(r"keys\[(\d+)\](?:\.(\w+))?$", key)
    start = text.find("[", text.find('"keys"'))
    if m is None or start < 0:
        return None
    decoder = json.JSONDecoder()
    pos = start + 1
    for i in range(int(m.group(1)) + 1):
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            _, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if i < int(m.group(1)):
            pos = end
    at = text.find(f'"{m.group(2)}"', pos, end) if m.group(2) else pos
    return text.count("\n", 0, at if at >= 0 else pos) + 1


def _limit(path: Path, text: str, key: str, spec: Key, value: Any) -> int | None:
    if value is None:
        return None
    checked: int | None = spec.check(value)
    if checked is None:
        raise _err(path, text, key, f"expected {spec.expected}, got {json.dumps(value)}", "or leave it out (unlimited)")
    return checked


def load_keys(path: Path, environ: Mapping[str, str] | None = None, need_env: bool = True) -> tuple[KeyEntry, ...]:
    """The entries of the keys file; :class:`ConfigError` naming file, line and key for anything wrong.

    ``need_env`` False: an ``env`` entry whose variable is not set is accepted (editing the file elsewhere).
    """
    env = os.environ if environ is None else environ
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), None, "keys file not found",
                          hint=f"create it with `pdctl keys add NAME --file {path}`") from None  # fmt: skip
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), None, f"cannot read the keys file: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(path.name, None, f"invalid JSON: {exc.msg}", line=exc.lineno, column=exc.colno) from None
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list) or set(data) - {"keys"}:
        raise ConfigError(path.name, None, 'expected {"keys": [...]} at the top level', line=1,
                          hint="`pdctl keys add NAME` writes a valid file")  # fmt: skip
    out: list[KeyEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(data["keys"]):
        at = f"keys[{i}]"
        if not isinstance(item, dict):
            raise _err(path, text, at, "expected an object with at least name and sha256")
        unknown = sorted(set(item) - set(_FIELDS))
        if unknown:
            raise _err(path, text, f"{at}.{unknown[0]}", "unknown key", f"known keys: {', '.join(_FIELDS)}")
        name = item.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _err(path, text, f"{at}.name", f"expected a name of letters, digits, '_.-' (got {json.dumps(name)})",
                       "the name labels metrics and logs, so it must not be the key itself")  # fmt: skip
        if name == DEFAULT_NAME:
            raise _err(path, text, f"{at}.name", f"{DEFAULT_NAME!r} is reserved for the key in gateway.api_key_env",
                       "pick another name")  # fmt: skip
        if name in seen:
            raise _err(path, text, f"{at}.name", f"duplicate name {name!r}", "each key needs its own name")
        seen.add(name)
        digest = _digest(path, text, at, item, env, need_env)
        models = item.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise _err(path, text, f"{at}.models", "expected a list of model names", "or leave it out (every model)")
        upstream = item.get("upstream", True)
        if not isinstance(upstream, bool):
            raise _err(path, text, f"{at}.upstream", f"expected true or false, got {json.dumps(upstream)}")
        limits = RateLimitConfig(
            **{k: _limit(path, text, f"{at}.{k}", spec, item.get(k)) for k, spec in _LIMITS.items()}
        )
        out.append(KeyEntry(name, digest, limits, None if models is None else tuple(models), upstream))
    return tuple(out)


def _digest(path: Path, text: str, at: str, item: Mapping[str, Any], env: Mapping[str, str], need_env: bool) -> bytes:
    if ("sha256" in item) == ("env" in item):
        raise _err(path, text, at, "give exactly one of sha256 (the key's digest) or env (a variable holding it)",
                   "`pdctl keys add NAME` stores a digest")  # fmt: skip
    if "sha256" in item:
        value = item["sha256"]
        if not isinstance(value, str) or not _HEX.match(value.lower()):
            raise _err(path, text, f"{at}.sha256", "expected 64 hex digits (the SHA-256 of the key, never the key)",
                       "`pdctl keys add NAME` prints a new key and stores its digest")  # fmt: skip
        return bytes.fromhex(value)
    var = item["env"]
    if not isinstance(var, str) or not re.match(r"^[A-Z_][A-Z0-9_]*$", var):
        raise _err(path, text, f"{at}.env", "expected the NAME of an environment variable",
                   "never the key itself: put the key in the variable")  # fmt: skip
    value = env.get(var, "")
    if not value and need_env:
        raise _err(path, text, f"{at}.env", f"environment variable {var} is not set",
                   f"export {var}=<key> in the gateway's environment")  # fmt: skip
    return hashlib.sha256(value.encode()).digest()


class KeyRing:
    """The keys the gateway accepts and each key's limiter; ``path`` None: a fixed set (one key, or tests).

    ``fixed``: entries kept across reloads (the ``default`` key from the environment). ``share``: this gateway
    process's index and the number of processes (``gateway.workers``); each limiter enforces its share.
    """

    def __init__(
        self,
        entries: tuple[KeyEntry, ...],
        path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        fixed: tuple[KeyEntry, ...] = (),
        share: tuple[int, int] = (0, 1),
    ) -> None:
        self.path = path
        self.clock = clock
        self.fixed = fixed
        self.share = share
        self.entries: tuple[KeyEntry, ...] = ()
        self.limiters: dict[str, RateLimiter] = {}
        self._mtime = self._stat()
        self._set(entries)

    @classmethod
    def single(cls, key: str) -> KeyRing:
        """One key named :data:`DEFAULT_NAME`, no limits of its own (the recipe's single-key setup)."""
        return cls((), fixed=(_default(key),))

    @classmethod
    def from_file(cls, path: Path, default_key: str | None = None, share: tuple[int, int] = (0, 1)) -> KeyRing:
        """The keys of ``path``, reloadable, plus ``default_key`` (named :data:`DEFAULT_NAME`) when given."""
        return cls(load_keys(path), path, fixed=(_default(default_key),) if default_key else (), share=share)

    @property
    def per_user(self) -> bool:
        """Whether the keys come from a keys file (then no client key is the upstream key)."""
        return self.path is not None

    def _set(self, entries: tuple[KeyEntry, ...]) -> None:
        entries = self.fixed + entries
        old = {e.name: e for e in self.entries}
        limiters: dict[str, RateLimiter] = {}
        for e in entries:
            kept = self.limiters.get(e.name)
            limiters[e.name] = (
                kept
                if kept is not None and old[e.name].limits == e.limits
                else RateLimiter(e.limits, self.clock, self.share)
            )
        self.entries = entries
        self.limiters = limiters

    def _stat(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def identify(self, header: bytes | None) -> KeyEntry | None:
        """The entry whose key the ``Authorization: Bearer`` header carries; every digest is compared."""
        if not header:
            return None
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip()).digest()
        found: KeyEntry | None = None
        for e in self.entries:
            if hmac.compare_digest(digest, e.digest):
                found = e
        return found

    def reload(self) -> bool:
        """Re-read the keys file; on error log it (no key in it) and keep the current keys. True if replaced."""
        if self.path is None:
            return False
        self._mtime = self._stat()
        try:
            entries = load_keys(self.path)
        except PdctlError as exc:
            log.error("keys file not reloaded, the previous keys stay in force: %s", exc)
            return False
        self._set(entries)
        log.info("keys reloaded from %s: %d key(s)", self.path, len(entries))
        return True

    def reload_if_changed(self) -> bool:
        """:meth:`reload` when the file's mtime or size changed since the last load."""
        if self.path is None or self._stat() == self._mtime:
            return False
        return self.reload()


def _default(key: str) -> KeyEntry:
    return KeyEntry(DEFAULT_NAME, hashlib.sha256(key.encode()).digest())


# ------------------------------------------------------------------------------ editing the file


def _read_raw(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    load_keys(path, need_env=False)
    return list(json.loads(path.read_text(encoding="utf-8"))["keys"])


def _write_raw(path: Path, items: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"keys": items}, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def add_key(path: Path, name: str, limits: RateLimitConfig, models: tuple[str, ...] | None, upstream: bool) -> str:
    """Add a key named ``name`` to ``path`` (created 0600 if missing); returns the key, stored only as a digest."""
    items = _read_raw(path)
    if not _NAME.match(name):
        raise PdctlError(f"invalid key name {name!r}", hint="letters, digits and '_.-', up to 64 characters")
    if any(i.get("name") == name for i in items):
        raise PdctlError(f"{path}: a key named {name!r} exists", hint=f"`pdctl keys revoke {name}` first, or pick "
                         "another name")  # fmt: skip
    key = new_key()
    item: dict[str, Any] = {"name": name, "sha256": hash_key(key)}
    item.update({k: v for k in _LIMITS if (v := getattr(limits, k)) is not None})
    if models is not None:
        item["models"] = list(models)
    if not upstream:
        item["upstream"] = False
    items.append(item)
    _write_raw(path, items)
    return key


def revoke_key(path: Path, name: str) -> None:
    """Remove the key named ``name``; a running gateway drops it on its next reload (within a second)."""
    items = _read_raw(path)
    kept = [i for i in items if i.get("name") != name]
    if len(kept) == len(items):
        names = ", ".join(str(i.get("name")) for i in items) or "none"
        raise PdctlError(f"{path}: no key named {name!r}", hint=f"keys in the file: {names}")
    _write_raw(path, kept)
