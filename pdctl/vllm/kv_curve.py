"""CURVE on the KV events port (``routing.kv_events_curve``): the keys, read from the environment only, and the
server and client sides of a ZMQ socket.

vLLM 0.32's event publisher cannot set CURVE keys, so each worker publishes in plain text to a relay on its own
host (:mod:`pdctl.vllm.kv_relay`, on loopback) and the relay carries every message to the gateway over
CURVE: encrypted, and authenticated both ways (ZMQ RFC 26, https://rfc.zeromq.org/spec/26/; CurveZMQ,
http://curvezmq.org/). The gateway's socket is the CURVE server and admits only the deployment's client public
key(s), checked by a ZAP handler (pyzmq's ``zmq.auth``, https://pyzmq.readthedocs.io/en/latest/api/zmq.auth.html);
without one libzmq would admit any client that knows the server's public key.

The keys, Z85 text (``zmq.curve_keypair``), each in its own environment variable and never in argv, settings
files, logs or manifests (``pdctl keys kv-events`` makes them):

============================== ======================= =====================================================
variable                       read by                 what
============================== ======================= =====================================================
:data:`SERVER_SECRET_ENV`      the gateway             its secret key
:data:`CLIENT_PUBLIC_ENV`      the gateway             the client public key(s) it admits, comma-separated
:data:`CLIENT_SECRET_ENV`      each relay              the relays' secret key (the gateway derives the public
                                                       one from it when :data:`CLIENT_PUBLIC_ENV` is unset)
:data:`SERVER_PUBLIC_ENV`      each relay              the gateway's public key (derived from the secret one
                                                       when unset and :data:`SERVER_SECRET_ENV` is set)
============================== ======================= =====================================================
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdctl.errors import ConfigError

__all__ = [
    "CLIENT_PUBLIC_ENV",
    "CLIENT_SECRET_ENV",
    "ENV_NAMES",
    "SECRET_NAME",
    "SERVER_PUBLIC_ENV",
    "SERVER_SECRET_ENV",
    "ClientKeys",
    "ServerKeys",
    "client_keys",
    "env_file",
    "new_keys",
    "secret_manifest",
    "secure_client",
    "secure_server",
    "server_keys",
    "start_authenticator",
]

SERVER_SECRET_ENV = "PDCTL_KV_EVENTS_SERVER_SECRET"
SERVER_PUBLIC_ENV = "PDCTL_KV_EVENTS_SERVER_PUBLIC"
CLIENT_SECRET_ENV = "PDCTL_KV_EVENTS_CLIENT_SECRET"
CLIENT_PUBLIC_ENV = "PDCTL_KV_EVENTS_CLIENT_PUBLIC"
SECRET_NAME = "pdctl-kv-events"
"""The Kubernetes Secret holding the four variables (``pdctl keys kv-events --format k8s``), which the pods
rendered by ``pdctl render k8s`` refer to (``env.valueFrom.secretKeyRef``); the manifests never hold a key."""
ENV_NAMES = (SERVER_SECRET_ENV, SERVER_PUBLIC_ENV, CLIENT_SECRET_ENV, CLIENT_PUBLIC_ENV)
"""Every variable, in the order ``pdctl keys kv-events`` writes them."""

_HINT = (
    "make a set with `pdctl keys kv-events -o kv-events.env` (mode 0600) and load it into the environment of the "
    "gateway and of `pdctl up` (`set -a; . ./kv-events.env; set +a`), or with `--format k8s` as a Secret"
)


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """The gateway's side: its key pair and the client public keys it admits (all Z85 bytes)."""

    secret: bytes
    public: bytes
    clients: frozenset[bytes]


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """A relay's side: its key pair and the gateway's public key (all Z85 bytes)."""

    secret: bytes
    public: bytes
    server: bytes


def new_keys() -> dict[str, str]:
    """A fresh server and client key pair as the four variables (:data:`ENV_NAMES`)."""
    import zmq

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    values = (server_secret, server_public, client_secret, client_public)
    return {name: v.decode("ascii") for name, v in zip(ENV_NAMES, values, strict=True)}


def _key(env: Mapping[str, str], name: str) -> bytes | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if len(raw) != 40:  # the value itself is never quoted: it may be a secret
        raise ConfigError("environment", name, f"not a Z85 CURVE key (40 characters; this has {len(raw)})",
                          hint=_HINT)  # fmt: skip
    from zmq.utils import z85

    try:
        z85.decode(raw)
    except (ValueError, KeyError, IndexError):
        raise ConfigError("environment", name, "not a Z85 CURVE key (a character outside Z85's alphabet)",
                          hint=_HINT) from None  # fmt: skip
    return raw.encode("ascii")


def _need(env: Mapping[str, str], name: str) -> bytes:
    value = _key(env, name)
    if value is None:
        raise ConfigError("environment", name, "not set, and routing.kv_events_curve is true", hint=_HINT)
    return value


def _public(secret: bytes) -> bytes:
    import zmq

    return zmq.curve_public(secret)


def server_keys(env: Mapping[str, str] | None = None) -> ServerKeys:
    """The gateway's keys from ``env`` (default: the process environment); a :class:`ConfigError` naming the
    variable when one is missing or malformed."""
    env = os.environ if env is None else env
    secret = _need(env, SERVER_SECRET_ENV)
    listed = [k.strip() for k in env.get(CLIENT_PUBLIC_ENV, "").split(",") if k.strip()]
    clients = [v for k in listed if (v := _key({CLIENT_PUBLIC_ENV: k}, CLIENT_PUBLIC_ENV)) is not None]
    if not clients and (client_secret := _key(env, CLIENT_SECRET_ENV)) is not None:
        clients = [_public(client_secret)]
    if not clients:
        raise ConfigError("environment", CLIENT_PUBLIC_ENV, "not set (nor CLIENT_SECRET to derive it from), and "
                          "routing.kv_events_curve is true: the gateway would admit no relay", hint=_HINT)  # fmt: skip
    return ServerKeys(secret, _public(secret), frozenset(clients))


def client_keys(env: Mapping[str, str] | None = None) -> ClientKeys:
    """A relay's keys from ``env`` (default: the process environment); a :class:`ConfigError` naming the variable
    when one is missing or malformed."""
    env = os.environ if env is None else env
    secret = _need(env, CLIENT_SECRET_ENV)
    server = _key(env, SERVER_PUBLIC_ENV)
    if server is None:
        server_secret = _key(env, SERVER_SECRET_ENV)
        if server_secret is None:
            raise ConfigError("environment", SERVER_PUBLIC_ENV, "not set, and routing.kv_events_curve is true",
                              hint=_HINT)  # fmt: skip
        server = _public(server_secret)
    return ClientKeys(secret, _public(secret), server)


def secure_server(sock: Any, keys: ServerKeys) -> None:
    """Make ``sock`` (before it binds) a CURVE server with the gateway's keys."""
    import zmq

    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def secure_client(sock: Any, keys: ClientKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the gateway."""
    import zmq

    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server)


class _Admitted:
    """pyzmq's credentials provider: a client public key is admitted when it is one of the deployment's."""

    def __init__(self, clients: frozenset[bytes]) -> None:
        self.clients = clients
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.clients:
            return True
        self.refused += 1
        if self.refused == 1:  # once: a scanner must not flood the log
            logging.getLogger("pdctl.gateway").warning(
                "KV events: a CURVE client with a key that is none of %s's refused; later ones are not logged",
                CLIENT_PUBLIC_ENV)  # fmt: skip
        return False


def start_authenticator(ctx: Any, keys: ServerKeys) -> Any:
    """Start the ZAP handler of ``ctx`` (a ``zmq.Context`` or ``zmq.asyncio.Context``) that admits ``keys.clients``
    only, on a thread; the caller stops it (``.stop()``) before it terminates the context, and binds its CURVE
    server socket (:func:`secure_server`) only after this returned."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=logging.getLogger("pdctl.zmq.auth"))
    auth.start()
    auth.configure_curve_callback("*", _Admitted(keys.clients))
    return auth


def env_file(keys: Mapping[str, str]) -> str:
    """``keys`` (:func:`new_keys`) as an environment file: ``NAME='value'`` lines, for ``set -a; . ./file`` (Z85
    has ``$``, ``&``, ``(`` and more that a shell reads, but no quote)."""
    lines = ["# pdctl KV events CURVE keys (routing.kv_events_curve). Secret: keep this file mode 0600.",
             "# The gateway needs the SERVER_SECRET and CLIENT_PUBLIC lines, each worker host's relays the",
             "# CLIENT_SECRET and SERVER_PUBLIC lines."]  # fmt: skip
    return "\n".join([*lines, *(f"{name}='{keys[name]}'" for name in ENV_NAMES)]) + "\n"


def secret_manifest(keys: Mapping[str, str], namespace: str | None = None) -> str:
    """``keys`` as the Kubernetes Secret :data:`SECRET_NAME` that ``pdctl render k8s`` refers to."""
    meta = [f"  name: {SECRET_NAME}"] + ([f"  namespace: {namespace}"] if namespace else [])
    data = [f'  {name}: "{keys[name]}"' for name in ENV_NAMES]
    head = ["apiVersion: v1", "kind: Secret", "metadata:", *meta, "type: Opaque", "stringData:"]
    return "\n".join([*head, *data]) + "\n"
