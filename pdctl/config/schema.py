"""How a config key is declared: once, as the metadata of its dataclass field.

:class:`Key` is one key's declaration (its checker, the expected text of its errors, where it ends up: a vLLM
flag, an environment variable, the gateway, the supervisor or only ``pdctl check``; its docs row);
:func:`key` makes the dataclass field that carries it, :func:`section` a field holding a sub-table.
:func:`keys_of`, :func:`sections_of` and :func:`file_keys` read the declarations back, in field order, for the
loader (:mod:`pdctl.config.loader`), the plan's flags, ``check``'s key table and docs/config.md.

The checkers (``as_int``, ``as_str``, ``as_choice``, ...) take a raw value from the file and return it
converted, or None when it is not valid; :func:`parse_endpoint` and :func:`parse_listen` split the two address
forms the files use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal
from urllib.parse import urlsplit

KeyKind = Literal["argv", "env", "gateway", "supervisor", "check"]


@dataclass(frozen=True, slots=True)
class Key:
    """One configuration key, declared once as the metadata of its dataclass field (see :func:`key`).

    The loader reads it (``check`` returns the value or None when invalid; ``expected`` goes in the error),
    the plan puts it on the command line (``flag``; left out when the value is None or ``omit``; a false
    ``negatable`` bool becomes ``--no-…``) or names its environment variable (``env``), ``check`` describes
    where it ends up (``use``), and docs/config.md shows ``type``, ``default`` and ``doc``
    (tests/config/test_config_docs.py holds the two in step). ``emit`` False: the plan places the flag itself
    (``--model``, positional for ``vllm serve``). ``in_file`` False: a field with a flag but no key (the port
    comes from routing's endpoint). ``name``: the key in the file when it is not the field's name. ``into``:
    the fields a checked tuple fills, in order (``gateway.listen`` → ``listen_host``, ``listen_port``).
    ``beside_file``: a relative path is made relative to the folder of the file that sets it, when loaded.
    A sub-table (``gateway.rate_limit``) is a field declared with :func:`section`.

    Declared as::

        max_num_seqs: int | None = key(
            None, as_int(1), "an integer >= 1", use="argv", flag="--max-num-seqs", type="integer",
            default="vLLM's", doc="`--max-num-seqs`",
        )
    """

    check: Callable[[Any], Any]
    expected: str
    use: KeyKind
    type: str = ""
    default: str = ""
    doc: str = ""
    flag: str | None = None
    env: str | None = None
    omit: Any = None
    negatable: bool = False
    emit: bool = True
    in_file: bool = True
    name: str = ""
    into: tuple[str, ...] = ()
    beside_file: bool = False

    def file_key(self, field_name: str) -> str:
        """The key's name in the file."""
        return self.name or field_name


def key(
    value: Any,
    check: Callable[[Any], Any],
    expected: str,
    *,
    use: KeyKind,
    factory: Callable[[], Any] | None = None,
    default: str | None = None,
    **spec: Any,
) -> Any:
    """A dataclass field declaring a config key: its Python default (``value``, or ``factory``) and :class:`Key`.

    ``default`` is the docs' default column; unset, it is ``value`` as TOML in backticks.
    """
    shown = default if default is not None else f"`{_toml_value(value)}`"
    meta = {"key": Key(check, expected, use, default=shown, **spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=value, metadata=meta)


def section(cls: type) -> Any:
    """A dataclass field holding a sub-table whose keys ``cls`` declares (``gateway.rate_limit``)."""
    return field(default_factory=cls, metadata={"section": cls})


def keys_of(cls: type) -> dict[str, Key]:
    """The declared keys of a config dataclass, in field order."""
    return {f.name: f.metadata["key"] for f in fields(cls) if "key" in f.metadata}


def sections_of(cls: type) -> dict[str, type]:
    """The sub-tables of a config dataclass (fields declared with :func:`section`), by key."""
    return {f.name: f.metadata["section"] for f in fields(cls) if "section" in f.metadata}


def file_keys(cls: type) -> dict[str, Key]:
    """The keys a file may set in a ``cls`` table, by dotted name (``rate_limit.max_concurrency``), in field order."""
    out = {spec.file_key(name): spec for name, spec in keys_of(cls).items() if spec.in_file}
    for name, sub in sections_of(cls).items():
        out.update({f"{name}.{k}": spec for k, spec in file_keys(sub).items()})
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def as_int(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int | None]:
    def check(v: Any) -> int | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            return None
        return int(v)

    return check


def as_num(lo_exclusive: float | None = None, hi: float | None = None) -> Callable[[Any], float | None]:
    def check(v: Any) -> float | None:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return None
        if (lo_exclusive is not None and v <= lo_exclusive) or (hi is not None and v > hi):
            return None
        return float(v)

    return check


def as_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def as_str(v: Any) -> str | None:
    return str(v) if isinstance(v, str) and v != "" else None


def as_choice(*options: str) -> Callable[[Any], str | None]:
    return lambda v: v if isinstance(v, str) and v in options else None


def as_int_list(v: Any) -> tuple[int, ...] | None:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        return None
    return tuple(int(x) for x in v)


def as_str_list(v: Any) -> tuple[str, ...] | None:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        return None
    return tuple(v)


def as_table(v: Any) -> dict[str, Any] | None:
    return dict(v) if isinstance(v, Mapping) else None


def as_str_map(v: Any) -> dict[str, str] | None:
    if not isinstance(v, Mapping):
        return None
    out: dict[str, str] = {}
    for k, x in v.items():
        if isinstance(x, bool):
            out[str(k)] = "1" if x else "0"
        elif isinstance(x, str | int | float):
            out[str(k)] = str(x)
        else:
            return None
    return out


def as_listen(v: Any) -> tuple[str, int] | None:
    try:
        return parse_listen(v) if isinstance(v, str) else None
    except ValueError:
        return None


def as_http_url(v: Any) -> str | None:
    if not isinstance(v, str):
        return None
    parts = urlsplit(v)
    return v.rstrip("/") if parts.scheme in ("http", "https") and parts.hostname else None


def as_endpoints(v: Any) -> tuple[str, ...] | None:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
        return None
    for item in items:
        try:
            parse_endpoint(item)
        except ValueError:
            return None
    return tuple(items)


def parse_endpoint(url: str) -> tuple[str, int]:
    """``http://127.0.0.1:8100`` -> ``("127.0.0.1", 8100)``; raises ValueError when it is not one."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname, port


def parse_listen(value: str) -> tuple[str, int]:
    """``0.0.0.0:8000`` -> ``("0.0.0.0", 8000)``; raises ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(value)
    return host.strip("[]") or "0.0.0.0", int(port)
