"""The upstream channel: base-URL convention, key, retries before the first byte, G12, G13, /v1/models."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from pdctl.gateway.upstream import upstream_url
from tests.fakes.gateway_harness import KEY, UPSTREAM_KEY, FakeProc, GatewayThread, make_settings

CHAT = {"model": "gpt-up", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


def test_base_url_convention() -> None:
    assert upstream_url("https://taotoken.net/api", "/chat/completions") == (
        "https://taotoken.net/api/v1/chat/completions"
    )
    assert (
        upstream_url("https://api.openai.com/v1", "/chat/completions") == "https://api.openai.com/v1/chat/completions"
    )
    assert upstream_url("https://api.openai.com/v1/", "/models") == "https://api.openai.com/v1/models"
    assert upstream_url("https://open.bigmodel.cn/api/paas/v4", "/completions") == (
        "https://open.bigmodel.cn/api/paas/v4/completions"
    )
    assert upstream_url("http://127.0.0.1:9000", "/models") == "http://127.0.0.1:9000/v1/models"


def _start(
    procs: tuple[list[FakeProc], list[GatewayThread]], spec: dict, **kw: object
) -> tuple[FakeProc, GatewayThread, FakeProc]:
    fakes, gws = procs
    worker = FakeProc("fake_pd_worker.py", {})
    fakes.append(worker)
    up = FakeProc("fake_upstream.py", {"prefix": "/api/v1", "key": UPSTREAM_KEY, "models": ["gpt-up"], **spec})
    fakes.append(up)
    g = GatewayThread(
        make_settings([worker.url], [worker.url], upstream=up.url + "/api", **kw), upstream_key=UPSTREAM_KEY
    )
    gws.append(g)
    return up, g, worker


def _chat(g: GatewayThread) -> httpx.Response:
    """POST ``CHAT`` (a non-local model: the upstream's) to the gateway."""
    with g.client() as c:
        return c.post("/v1/chat/completions", json=CHAT)


def _completion_calls(up: FakeProc) -> list[dict[str, Any]]:
    """The completion requests the fake upstream saw (its log has the /models calls too)."""
    return [e for e in up.log() if e["path"].endswith("completions")]


def test_upstream_serves_non_local_models_with_upstream_key(procs: tuple) -> None:
    up, g, worker = _start(procs, {})
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(**CHAT)
    assert chat.choices[0].message.content == "up up up "
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**CHAT, stream=True))
    assert text == "up up up "
    comp = client.completions.create(model="gpt-up", prompt="x", max_tokens=3)
    assert comp.choices[0].text == "up up up "
    calls = _completion_calls(up)
    assert [e["path"] for e in calls] == ["/api/v1/chat/completions"] * 2 + ["/api/v1/completions"]
    assert all(e["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}" for e in calls)
    assert worker.completions() == []
    ids = {m.id for m in client.models.list().data}
    assert ids == {"tiny", "gpt-up"}
    r = _chat(g)
    assert r.headers["x-pd-path"] == "upstream"


def test_retries_before_first_byte_with_fresh_ids(procs: tuple) -> None:
    up, g, _ = _start(procs, {"script": [{"status": 503}, {"reset": True}, {"status": 200}]})
    with g.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "upreq"})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    ids = [e["headers"]["x-request-id"] for e in _completion_calls(up)]
    assert ids == ["upreq", "upreq-retry1", "upreq-retry2"]
    assert g.metric("pdctl_retries_total", leg="upstream") == 2


def test_retries_bounded_by_max_retries(procs: tuple) -> None:
    up, g, _ = _start(procs, {"script": [{"status": 502}]}, max_retries=1)
    r = _chat(g)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    assert len(_completion_calls(up)) == 2


def test_g12_upstream_429_retry_after_passed_on(procs: tuple) -> None:
    up, g, _ = _start(procs, {"script": [{"status": 429, "retry_after": "7"}, {"status": 200}]})
    r = _chat(g)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "7"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(_completion_calls(up)) == 1


def test_short_retry_after_is_honoured(procs: tuple) -> None:
    up, g, _ = _start(procs, {"script": [{"status": 429, "retry_after": "0"}, {"status": 200}]})
    r = _chat(g)
    assert r.status_code == 200
    assert len(_completion_calls(up)) == 2


def test_g13_upstream_401_is_502_and_key_not_leaked(procs: tuple, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    up, g, _ = _start(procs, {"key": "sk-some-other-key-000000"})
    r = _chat(g)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_auth_error"
    assert UPSTREAM_KEY not in r.text and KEY not in r.text
    assert len(_completion_calls(up)) == 1
    logs = "\n".join(rec.getMessage() for rec in caplog.records)
    assert UPSTREAM_KEY not in logs and KEY not in logs
    assert UPSTREAM_KEY not in g.metrics_text()


def test_models_answer_when_upstream_is_down(procs: tuple) -> None:
    up, g, _ = _start(procs, {})
    up.kill()
    with g.client() as c:
        r = c.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["tiny"]
    r = _chat(g)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
