"""The gateway's HTTP edge (pdctl.gateway.edge) against clients on raw sockets, as an attacker would send.

Each limit has a test: the request head's size and header count (431), the head and body timeouts (408), the
connection cap (503 with Retry-After) and the keep-alive timeout; and normal requests, streams and large but
allowed heads still work. Timeouts are short here (0.5 s) and the bounds to see their effect generous: these check
behaviour, never speed.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from pdctl.gateway.app import create_app
from pdctl.gateway.edge import RETRY_AFTER_S, EdgeLimits, attach_limits, connection_cap
from pdctl.gateway.server import edge_limits
from tests.fakes.gateway_harness import KEY, FakeProc, GatewayThread, make_settings, wait_for
from tests.gateway.test_app import CHAT, workers

__all__ = ["workers"]  # the module fixture this module borrows

SHORT = EdgeLimits(header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=0.5)
#: How long a test waits for a timeout of 0.5 s to show (a loaded 2-core machine, never a speed check).
PATIENCE_S = 15.0


def _gateway(workers: tuple[FakeProc, FakeProc], limits: EdgeLimits) -> GatewayThread:
    p, d = workers
    g = GatewayThread(make_settings([p.url], [d.url]))
    attach_limits(g.server.config, limits)  # read by each connection as it opens
    g.server.config.timeout_keep_alive = (
        3600  # uvicorn's own, far above the limits': only theirs can close a connection
    )
    return g


@pytest.fixture(scope="module")
def gw(workers: tuple[FakeProc, FakeProc]) -> Iterator[GatewayThread]:
    g = _gateway(workers, SHORT)
    yield g
    g.stop()


def _connect(g: GatewayThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", g.port), timeout=PATIENCE_S)


def _read_to_close(s: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (a timeout fails the test)."""
    out = b""
    while True:
        try:
            piece = s.recv(65536)
        except ConnectionResetError:
            return out
        if not piece:
            return out
        out += piece


def _read_one(s: socket.socket) -> bytes:
    """One response with a ``content-length``, leaving the connection open."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += s.recv(65536)
    _, headers, body = _status(raw)
    head = raw[: len(raw) - len(body)]
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    return head + body


def _status(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _get(path: str = "/health", extra: bytes = b"", keep_alive: bool = False) -> bytes:
    conn = b"" if keep_alive else b"connection: close\r\n"
    return b"GET %s HTTP/1.1\r\nhost: gw\r\n%s%s\r\n" % (path.encode(), conn, extra)


def _post_head(length: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer %s\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % (KEY.encode(), length)
    )


def test_a_one_mib_header_line_gets_431_and_the_connection_closes(gw: GatewayThread) -> None:
    with _connect(gw) as s:
        try:
            s.sendall(_get(extra=b"x-big: " + b"a" * (1 << 20) + b"\r\n"))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway may answer and close before it read everything; the answer is still there
        status, headers, body = _status(_read_to_close(s))
    assert status == 431
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "headers_too_large"


def test_twenty_thousand_headers_get_431(gw: GatewayThread) -> None:
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(20_000))
    with _connect(gw) as s:
        try:
            s.sendall(_get(extra=many))
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _status(_read_to_close(s))[0] == 431


def test_more_headers_than_the_count_allows_get_431_even_when_small(gw: GatewayThread) -> None:
    """101 short header lines are far below 60 KiB: the count refuses them, 100 in all pass."""

    def lines(n: int) -> bytes:  # besides host and connection
        return b"".join(b"x-h%d: v\r\n" % i for i in range(n))

    with _connect(gw) as s:
        s.sendall(_get(extra=lines(SHORT.max_headers - 1)))
        assert _status(_read_to_close(s))[0] == 431
    with _connect(gw) as s:
        s.sendall(_get(extra=lines(SHORT.max_headers - 2)))
        assert _status(_read_to_close(s))[0] == 200


def test_a_large_head_below_the_limit_is_served(gw: GatewayThread) -> None:
    big = b"x-big: " + b"a" * (SHORT.max_header_bytes - 1024) + b"\r\n"
    with _connect(gw) as s:
        s.sendall(_get(extra=big))
        status, _, body = _status(_read_to_close(s))
    assert status == 200, body
    # and the same size arriving in small pieces (counted per read, not per request)
    with _connect(gw) as s:
        data = _get(extra=big)
        for i in range(0, len(data), 4096):
            s.sendall(data[i : i + 4096])
        assert _status(_read_to_close(s))[0] == 200


def test_a_half_open_request_is_closed_after_the_header_timeout(gw: GatewayThread) -> None:
    """The request line and one header, never finished: 408 and a close, as nginx's client_header_timeout."""
    socks = [_connect(gw) for _ in range(20)]
    try:
        for s in socks:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n")
        for s in socks:
            status, headers, _ = _status(_read_to_close(s))
            assert status == 408 and headers["connection"] == "close"
    finally:
        for s in socks:
            s.close()


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(gw: GatewayThread) -> None:
    with _connect(gw) as s:
        assert _read_to_close(s) == b""


def test_a_stalled_body_gets_408_and_a_close(gw: GatewayThread) -> None:
    body = json.dumps(CHAT).encode()
    with _connect(gw) as s:
        s.sendall(_post_head(len(body)) + body[:10])
        status, headers, payload = _status(_read_to_close(s))
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(payload)["error"]["code"] == "request_timeout"


def test_a_slow_body_that_keeps_coming_is_not_cut(workers: tuple[FakeProc, FakeProc]) -> None:
    """The body timeout is between two reads (nginx's client_body_timeout), not for the whole body."""
    g = _gateway(workers, dataclasses.replace(SHORT, body_timeout_s=2.0))
    try:
        body = json.dumps(CHAT).encode()
        with _connect(g) as s:
            s.sendall(_post_head(len(body)))
            for i in range(0, len(body), len(body) // 6 + 1):
                time.sleep(0.4)  # 2.4 s and more in all, above the timeout; each gap well below it
                s.sendall(body[i : i + len(body) // 6 + 1])
            raw = _read_one(s)
        assert _status(raw)[0] == 200, raw
    finally:
        g.stop()


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(gw: GatewayThread) -> None:
    with _connect(gw) as s:
        s.sendall(_get(keep_alive=True))
        assert _status(_read_one(s))[0] == 200
        s.sendall(_get(keep_alive=True))  # still open at once: keep-alive works
        assert _status(_read_one(s))[0] == 200
        assert _read_to_close(s) == b""  # then closed by the gateway, with nothing more said


def test_connections_over_the_cap_get_503_with_retry_after(workers: tuple[FakeProc, FakeProc]) -> None:
    g = _gateway(workers, EdgeLimits(max_connections=4))
    held: list[socket.socket] = []
    try:
        for _ in range(4):
            s = _connect(g)
            s.sendall(_get(keep_alive=True))  # answered: accepted and counted
            assert _status(_read_one(s))[0] == 200
            held.append(s)
        with _connect(g) as extra:
            extra.sendall(_get())
            status, headers, body = _status(_read_to_close(extra))
        assert status == 503
        assert headers["retry-after"] == str(RETRY_AFTER_S) and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        held.pop().close()

        def served() -> bool:
            with _connect(g) as s:
                s.sendall(_get())
                return _status(_read_to_close(s))[0] == 200

        assert wait_for(served, timeout=PATIENCE_S), "a connection closed frees its place"
    finally:
        for s in held:
            s.close()
        g.stop()


def test_normal_requests_and_streams_pass_the_edge(gw: GatewayThread) -> None:
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"x-pad": "p" * 40_000})
        assert r.status_code == 200, r.text
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) > 2
        for _ in range(3):  # the same keep-alive connection, request after request
            assert c.get("/health").status_code == 200


def test_the_settings_reach_the_gateways_server_with_this_process_share() -> None:
    settings = make_settings(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    g = dataclasses.replace(
        settings.gateway, max_header_bytes=4096, max_headers=20, header_timeout_s=3.0, body_timeout_s=4.0,
        max_connections=10, keepalive_timeout_s=7.5,
    )  # fmt: skip
    app = create_app(dataclasses.replace(settings, gateway=g, process=(1, 3)), KEY)
    assert edge_limits(app) == EdgeLimits(4096, 20, 3.0, 4.0, 3, 7.5)  # 10 connections on 3 processes: 4, 3, 3
    shares = [EdgeLimits.of(g, (i, 3)).max_connections for i in range(3)]
    assert shares == [4, 3, 3]


def test_the_connection_cap_stays_within_the_file_descriptor_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(100) == 100  # raised to fit when it does not already
    cap = connection_cap(10**9)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert 1 <= cap < 10**9 and cap * 3 < soft


def test_the_edge_answers_a_plain_client_as_httpx_sees_it(gw: GatewayThread) -> None:
    """What an ordinary HTTP client gets for an oversized head: a 431 it can read, not a reset."""
    r = httpx.get(gw.url + "/health", headers={"x-big": "a" * (SHORT.max_header_bytes + 1)}, timeout=PATIENCE_S)
    assert r.status_code == 431
