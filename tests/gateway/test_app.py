"""The gateway's core: auth, the PD two-leg protocol (non-stream and stream), errors, metrics, the openai SDK.

Workers are tests/fakes/fake_pd_worker.py processes; the gateway runs on a thread (tests/fakes/gateway_harness.py).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from pdctl.gateway.settings import LocalModel
from tests.conftest import REPO
from tests.fakes.gateway_harness import KEY, FakeProc, GatewayThread, make_settings, wait_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[FakeProc, FakeProc]]:
    p = FakeProc("fake_pd_worker.py", {"role": "prefill"})
    d = FakeProc("fake_pd_worker.py", {"role": "decode", "chunks": 5})
    yield p, d
    p.kill()
    d.kill()


@pytest.fixture(scope="module")
def gw(workers: tuple[FakeProc, FakeProc]) -> Iterator[GatewayThread]:
    p, d = workers
    g = GatewayThread(make_settings([p.url], [d.url]))
    yield g
    g.stop()


def _by_id(fake: FakeProc, rid: str) -> list[dict]:
    return [e for e in fake.completions() if e["headers"].get("x-request-id", "").startswith(rid)]


def test_two_leg_non_stream_protocol(gw: GatewayThread, workers: tuple[FakeProc, FakeProc]) -> None:
    p, d = workers
    with gw.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={**CHAT, "stream_options": {"include_usage": True}, "min_tokens": 2},
            headers={"x-request-id": "nsreq1"},
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "nsreq1"
    assert r.headers["x-pd-path"] == "disagg"
    assert r.headers["x-pd-prefill"] == "prefill" and r.headers["x-pd-decode"] == "decode"
    assert float(r.headers["x-pd-prefill-ms"]) > 0
    assert r.json()["choices"][0]["message"]["content"].startswith("tok")
    [leg1] = _by_id(p, "nsreq1")
    [leg2] = _by_id(d, "nsreq1")
    b1, b2 = leg1["body"], leg2["body"]
    assert b1["max_tokens"] == 1 and b1["stream"] is False
    assert "stream_options" not in b1 and "min_tokens" not in b1
    assert b1["kv_transfer_params"]["do_remote_decode"] is True
    # leg 2: the client's body plus prefill's params verbatim
    assert b2["max_tokens"] == 5 and b2["min_tokens"] == 2
    assert b2["kv_transfer_params"]["remote_engine_id"] == "fake-engine"
    assert b2["kv_transfer_params"]["remote_request_id"] == "cmpl-nsreq1-0"
    # the client's key never goes to the workers
    assert "authorization" not in leg1["headers"] and "authorization" not in leg2["headers"]


def test_stream_relays_sse_with_done_and_usage(gw: GatewayThread, workers: tuple[FakeProc, FakeProc]) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with gw.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-pd-path"] == "disagg"
        raw = b"".join(r.iter_raw())
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    usage = json.loads(events[-2][6:])
    assert usage["usage"]["completion_tokens"] == 5
    assert len(events) == 5 + 2


def test_stream_is_not_buffered(workers: tuple[FakeProc, FakeProc]) -> None:
    p, _ = workers
    slow = FakeProc("fake_pd_worker.py", {"role": "decode", "chunks": 6, "chunk_delay": 0.5})
    g = GatewayThread(make_settings([p.url], [slow.url]))
    try:
        with (
            g.client() as c,
            c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 6, "stream": True}) as r,
        ):
            it = r.iter_raw()
            first = next(it)
            # one token in hand, five still to come: decode has not finished (its entry says so)
            assert first.startswith(b"data: {") and first.count(b"data: ") == 1, first
            [entry] = slow.completions()
            assert entry["finished"] is False
            rest = b"".join(it)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert rest.count(b"data: {") == 5, rest
        # the same entry, read again once the stream ended, has moved on: the first chunk left before the end
        assert wait_for(lambda: slow.completions()[0]["finished"] is True, timeout=10), slow.completions()
    finally:
        g.stop()
        slow.kill()


def test_openai_sdk_chat_and_completions(gw: GatewayThread) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content == "tok tok tok "
    comp = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert comp.choices[0].text == "tok tok "
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok " * 4
    assert chunks[-1].choices[0].finish_reason == "length"
    cchunks = list(client.completions.create(model="tiny", prompt="hi", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in cchunks) == "tok " * 3
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_openai_sdk_errors_parse(gw: GatewayThread) -> None:
    bad = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.code == "invalid_api_key"
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert br.value.param == "max_tokens"


@pytest.mark.parametrize("auth", [None, "Basic dXNlcjpwYXNz", "Bearer sk-wrong", "Bearer", f"bearer{KEY}"])
def test_x1_bad_authorization_is_401(gw: GatewayThread, workers: tuple[FakeProc, FakeProc], auth: str | None) -> None:
    p, _ = workers
    before = len(p.completions())
    headers = {"authorization": auth} if auth else {}
    for path, method in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET")):
        r = httpx.request(method, gw.url + path, json=CHAT, headers=headers, timeout=10)
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert set(err) == {"message", "type", "param", "code"}
        assert KEY not in r.text
    assert len(p.completions()) == before
    # liveness and metrics need no key
    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200


def test_x1_compare_digest_in_source() -> None:
    src = (REPO / "pdctl" / "gateway" / "keys.py").read_text()
    assert "hmac.compare_digest" in src and "sha256" in src
    assert "digest in self._digests" not in src  # the early-exit anti-pattern
    from pdctl.gateway.keys import KeyEntry, KeyRing, hash_key

    one, two = (KeyEntry(n, bytes.fromhex(hash_key(k))) for n, k in (("one", "sk-one-aaaaaaaaaaaa"),
                                                                     ("two", "sk-two-bbbbbbbbbbbb")))  # fmt: skip
    ring = KeyRing((one, two))
    assert ring.identify(b"Bearer sk-two-bbbbbbbbbbbb") == two and ring.identify(b"bearer sk-one-aaaaaaaaaaaa") == one
    assert ring.identify(b"Bearer sk-one-aaaaaaaaaaa") is None and ring.identify(b"Basic sk-one-aaaaaaaaaaaa") is None
    assert ring.identify(None) is None and KeyRing(()).identify(b"Bearer x") is None


def test_x4_only_gateway_routes(gw: GatewayThread) -> None:
    with gw.client() as c:
        for path in ("/invocations", "/pause", "/abort_requests", "/version", "/detokenize", "/v1/messages/batches"):
            r = c.post(path, json={})
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found"
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nest"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
        (b'{"model": "tiny", "model": "x", "messages": []}', "duplicate"),
        (b'{"model": "tiny", "temperature": NaN, "messages": [{"role": "user", "content": "a"}]}', "NaN"),
        (b'{"model": "tiny", "messages": [{"role": "user"', "invalid JSON"),
        (b'"just a string"', "object"),
        (b'{"model": "tiny", "messages": [' + b"[" * 100 + b"]" * 100 + b"]}", "nested"),
    ],
)
def test_x6_bad_json_is_400(gw: GatewayThread, raw: bytes, fragment: str) -> None:
    with gw.client() as c:
        r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment.lower() in err["message"].lower()
    assert "Traceback" not in r.text


def test_x5_body_limit_413_without_reading(gw: GatewayThread) -> None:
    big = b"x" * (2 << 20)
    with gw.client() as c:
        r = c.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"

        def slow_body() -> Iterator[bytes]:
            for _ in range(40):
                yield b"y" * 65536

        # chunked upload without Content-Length: counted while reading, refused once over the limit
        r = c.post("/v1/chat/completions", content=slow_body(), headers={"content-type": "application/json"})
        assert r.status_code == 413
    # Content-Length 10^12 with a body that never comes: answered at once from the header
    import socket

    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
            + KEY.encode()
            + b"\r\ncontent-type: application/json\r\ncontent-length: 1000000000000\r\n\r\n{"
        )
        data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 413")


def test_g11_limits_checked_before_any_worker_call(gw: GatewayThread, workers: tuple[FakeProc, FakeProc]) -> None:
    p, d = workers
    before = (len(p.completions()), len(d.completions()))
    cases = [
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": -3}, "max_tokens"),
        ({**CHAT, "max_tokens": 4096}, "max_tokens"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({**CHAT, "messages": [{"role": "user", "content": "word " * 20000}], "max_tokens": 100}, "messages"),
        ({**CHAT, "n": 1000}, "n"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"messages": CHAT["messages"]}, "model"),
    ]
    with gw.client() as c:
        for body, param in cases:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert (len(p.completions()), len(d.completions())) == before


def test_metrics_and_request_log(gw: GatewayThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="pdctl.gateway.access")
    before = gw.metric("pdctl_requests_total", path="disagg", status="200")
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "metricsreq"})
    assert r.status_code == 200
    assert wait_for(lambda: gw.metric("pdctl_requests_total", path="disagg", status="200") == before + 1)
    text = gw.metrics_text()
    for name in (
        "pdctl_ttft_seconds_bucket",
        "pdctl_tpot_seconds_bucket",
        'pdctl_leg_seconds_count{leg="prefill"}',
        'pdctl_leg_seconds_count{leg="handoff"}',
        'pdctl_leg_seconds_count{leg="first_chunk"}',
        'pdctl_in_flight{instance="decode",role="decode"}',
        "pdctl_rejected_total",
    ):
        assert name in text, name
    assert KEY not in text
    lines = [r.getMessage() for r in caplog.records if "metricsreq" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    for part in (
        "path=disagg",
        "prefill=prefill",
        "decode=decode",
        "status=200",
        "model=tiny",
        "kv_engine=fake-engine",
        "kv_blocks=2",
        "kv_remote=127.0.0.1:",
    ):
        assert part in line, (part, line)
    assert KEY not in line


def test_generated_request_id_reaches_both_legs(gw: GatewayThread, workers: tuple[FakeProc, FakeProc]) -> None:
    p, d = workers
    with gw.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    rid = r.headers["x-request-id"]
    assert rid.startswith("pdctl-")
    assert len(_by_id(p, rid)) == 1 and len(_by_id(d, rid)) == 1


def test_ready_and_models_survive_dead_worker(workers: tuple[FakeProc, FakeProc]) -> None:
    p, _ = workers
    d = FakeProc("fake_pd_worker.py", {"role": "decode"})
    g = GatewayThread(make_settings([p.url], [d.url]))
    try:
        assert wait_for(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200)
        d.kill()
        assert wait_for(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 503)
        with g.client() as c:
            assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
            r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "server_overloaded"
    finally:
        g.stop()


def test_docs_cover_settings_metrics_and_case_mapping() -> None:
    import re

    from pdctl.config import GatewayConfig, file_keys
    from pdctl.gateway.metrics import GatewayMetrics

    doc = (REPO / "docs" / "gateway.md").read_text()
    for name in file_keys(GatewayConfig):
        assert f"`gateway.{name}`" in doc, name
    for metric in GatewayMetrics().registry.collect():
        shown = metric.name + ("_total" if metric.type == "counter" else "")
        assert f"`{shown}`" in doc, shown
    # every test the case table names exists in the file it names
    named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", doc)
    assert len(named) > 20, "the case table names its tests as `tests/<path>.py::test_name`"
    for file, test in named:
        assert f"def {test}(" in (REPO / file).read_text(), (file, test)


class _BlackHole:
    """A TCP listener that accepts connections and never answers: a worker hung while loading."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.conns.append(self.sock.accept()[0])

    def close(self) -> None:
        # close() alone leaves accept() blocked in its thread; shutdown() makes it fail, so the thread ends.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(5)
        assert not self.thread.is_alive()
        for c in [*self.conns, self.sock]:
            c.close()


def test_listens_before_the_first_probe_when_the_models_are_known() -> None:
    """With config.toml (model names known) the gateway listens at once and /ready stays false until a probe
    answers; with settings.json alone it must learn the models first, so it listens after that first round."""
    p, d = _BlackHole(), _BlackHole()
    cases = [
        ((LocalModel("tiny", 2048),), [None, None]),  # listening while the probes still wait for an answer
        ((), [False, False]),  # listening only after the first round timed out (probes time out after 2 s)
    ]
    try:
        for models, healthy in cases:
            g = GatewayThread(make_settings([p.url], [d.url], models=models, health_interval_s=1.0))
            try:
                r = httpx.get(g.url + "/ready", timeout=10)
                assert r.status_code == 503
                assert [i["healthy"] for i in r.json()["instances"]] == healthy, models
            finally:
                g.stop()
    finally:
        p.close()
        d.close()
