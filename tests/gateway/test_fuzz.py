"""F1: Hypothesis against the gateway's HTTP API, with simulator workers and a fake upstream behind it.

Generated requests mix valid and broken parts: methods and paths, ``Authorization`` forms, JSON bodies
whose fields have the right or a wrong type or range, raw bytes (invalid UTF-8, deep nesting, NaN,
duplicate keys, huge numbers), content types; on chat, completions and the agent routes ``/v1/responses`` and
``/v1/messages``. For every answer: no 5xx, every 4xx in the route's shape (OpenAI's ``{"error": {"message",
"type", "param", "code"}}`` with string-or-null ``param``/``code``; on ``/v1/messages`` Anthropic's ``{"type":
"error", "error": {"type", "message"}}``), every 200 a complete answer (N1; an agent stream ends with its own
final event or one error event), no key in any body (N5). At the end the gateway's counters balance (N1) and
the workers are idle (N2). All of it twice: with every request on both legs (``routing.pd_mode = "always"``), and
under ``"adaptive"`` with a threshold low enough that short prompts go to the decode alone and longer ones take
both legs (both paths must have been taken).

``PDCTL_FUZZ_EXAMPLES=2000 pytest tests/gateway/test_fuzz.py`` runs a longer search (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.config.settings import PdMode
from pdctl.gateway.settings import LocalModel
from pdctl.testing import SimProcess, start_sim
from pdctl.testing.invariants import (
    ClientTally,
    check_n1,
    check_n2,
    check_n5,
    client_outcome,
    gateway_outcomes,
)
from tests.fakes.gateway_harness import KEY, UPSTREAM_KEY, FakeProc, GatewayThread, make_settings

EXAMPLES = int(os.environ.get("PDCTL_FUZZ_EXAMPLES", "150"))
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
#: The events that end each agent stream (a Responses stream cut by max_output_tokens ends incomplete, as vLLM 0.33).
AGENT_END = {RESPONSES: (b"event: response.completed", b"event: response.incomplete"),
             MESSAGES: (b"event: message_stop",)}  # fmt: skip
MAX_MODEL_LEN = 2048
#: Under adaptive: prompts of up to this many uncached tokens go to the decode alone (fuzzed prompts span it).
LOCAL_MAX_UNCACHED = 16


class Stack:
    """Simulator prefill + decode, a fake upstream, the gateway; plus what the fuzzer saw."""

    def __init__(self, tmp: Path, pd_mode: PdMode = "always") -> None:
        self.sims: list[SimProcess] = []
        self.fakes: list[FakeProc] = []
        self.gw: GatewayThread | None = None
        args = ["--max-model-len", str(MAX_MODEL_LEN)]
        self.sims.append(start_sim(args, str(tmp), name="prefill", role="kv_producer"))
        self.sims.append(start_sim(args, str(tmp), name="decode", role="kv_consumer"))
        self.fakes.append(FakeProc("fake_upstream.py", {"key": UPSTREAM_KEY, "models": ["up-model"]}))
        settings = make_settings(
            [self.sims[0].url], [self.sims[1].url], upstream=self.fakes[0].url,
            models=(LocalModel("sim-model", MAX_MODEL_LEN),), max_body_bytes=64 * 1024, max_retries=0,
        )  # fmt: skip
        routing = dataclasses.replace(settings.routing, pd_mode=pd_mode, local_max_uncached_tokens=LOCAL_MAX_UNCACHED)
        self.pd_mode = pd_mode
        self.gw = GatewayThread(dataclasses.replace(settings, routing=routing), upstream_key=UPSTREAM_KEY)
        self.client = httpx.Client(base_url=self.gw.url, timeout=60)
        self.tally = ClientTally()
        self.bodies: dict[str, bytes] = {}
        self.completions = 0

    def close(self) -> None:
        self.client.close()
        if self.gw is not None:
            self.gw.stop()
        for f in self.fakes:
            f.kill()
        for s in self.sims:
            s.stop(grace_s=2.0)


@pytest.fixture(scope="module", params=["always", "adaptive"])
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("fuzz-gateway"), request.param)
    try:
        yield s
    finally:
        s.close()


# ------------------------------------------------------------------------------------------- strategies

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=60)


def maybe_wrong(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a valid value, sometimes any JSON value (wrong type or range)."""
    return st.one_of(good, good, good, json_values)


messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": words}),
    min_size=1, max_size=3,
)  # fmt: skip
max_tokens = st.one_of(st.integers(1, 24), st.integers(-3, 0), st.sampled_from([MAX_MODEL_LEN, 10**9, 2**63]))


@st.composite
def completion_bodies(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(maybe_wrong(st.sampled_from(["sim-model", "sim-model", "up-model", "nope"])))}
    if chat:
        if draw(st.integers(0, 9)):
            body["messages"] = draw(maybe_wrong(messages))
    elif draw(st.integers(0, 9)):
        body["prompt"] = draw(maybe_wrong(st.one_of(words, st.lists(st.integers(0, 2000), min_size=1, max_size=8))))
    for name, strategy in (
        ("max_tokens", max_tokens),
        ("stream", st.booleans()),
        ("n", st.integers(-1, 70)),
        ("temperature", st.floats(0, 2)),
        ("stop", st.lists(st.text(max_size=4), max_size=3)),
        ("stream_options", st.fixed_dictionaries({"include_usage": st.booleans()})),
        ("seed", st.integers(0, 2**31)),
    ):
        if draw(st.booleans()):
            body[name] = draw(maybe_wrong(strategy))
    if draw(st.integers(0, 4)) == 0:
        body.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=2)))
    return body


@st.composite
def agent_bodies(draw: st.DrawFn, messages_api: bool) -> dict[str, Any]:
    """A ``/v1/messages`` or ``/v1/responses`` body, fields sometimes missing or of a wrong type."""
    body: dict[str, Any] = {"model": draw(maybe_wrong(st.sampled_from(["sim-model", "sim-model", "nope"])))}
    if messages_api:
        if draw(st.integers(0, 9)):
            body["messages"] = draw(maybe_wrong(st.lists(st.fixed_dictionaries({
                "role": st.sampled_from(["user", "assistant"]),
                "content": st.one_of(words, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}),
                                                     min_size=1, max_size=2))}), min_size=1, max_size=3)))  # fmt: skip
        fields = [("max_tokens", max_tokens), ("system", words)]
    else:
        if draw(st.integers(0, 9)):
            body["input"] = draw(maybe_wrong(st.one_of(words, messages)))
        fields = [("max_output_tokens", max_tokens), ("instructions", words)]
    fields += [("stream", st.booleans()), ("temperature", st.floats(0, 2))]
    if messages_api and draw(st.integers(0, 9)):
        body["max_tokens"] = draw(st.integers(1, 16))  # usually present: it is required
    for name, strategy in fields:
        if draw(st.booleans()):
            body[name] = draw(maybe_wrong(strategy))
    return body


raw_bodies = st.sampled_from(
    [
        b"",
        b"{",
        b"\xff\xfe{}",
        b'{"model": "sim-model", "prompt": "a\xc3"}',
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 3000 + b"1" + b"}" * 3000,
        b'{"model": "sim-model", "prompt": "x", "max_tokens": NaN}',
        b'{"model": "sim-model", "model": "up-model", "prompt": "x"}',
        b'{"model": "sim-model", "prompt": "x", "max_tokens": 1e999999}',
        b'{"model": "sim-model", "prompt": "x", "max_tokens": 123456789012345678901234567890}',
        b"null",
        b'"just a string"',
        b"x" * (70 * 1024),
    ]
) | st.binary(max_size=200)

auth_headers = st.one_of(
    *[st.just(f"Bearer {KEY}")] * 6,
    st.none(),
    st.sampled_from(["Bearer", f"bearer{KEY}", f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer  {KEY}"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip),
)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["completions", "chat", "completions", "chat", "raw", "other", "responses",
                                 "messages"]))  # fmt: skip
    headers: dict[str, str] = {}
    auth = draw(auth_headers)
    if auth is not None:
        headers["authorization"] = auth
    if draw(st.booleans()):
        headers["content-type"] = draw(st.sampled_from(["application/json", "text/plain", "application/x-www-form"]))
    if kind == "other":
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
        path = draw(st.sampled_from(["/v1/models", "/health", "/ready", "/metrics", "/v1/completions",
                                     "/invocations", "/pause", "/abort_requests", "/tokenize", "/v1/embeddings",
                                     "/v1/chat/completions", "/../etc/passwd", "/v1/models/sim-model"]))  # fmt: skip
        return {"method": method, "path": path, "headers": headers, "content": None, "stream": False}
    path = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}.get(kind, "/v1/completions")
    if kind == "raw":
        path = draw(st.sampled_from([path, RESPONSES, MESSAGES]))
        return {"method": "POST", "path": path, "headers": headers, "content": draw(raw_bodies), "stream": False}
    if kind in ("responses", "messages"):
        body = draw(agent_bodies(kind == "messages"))
    else:
        body = draw(completion_bodies(kind == "chat"))
    content = json.dumps(body).encode()
    return {
        "method": "POST",
        "path": path,
        "headers": headers,
        "content": content,
        "stream": body.get("stream") is True,
    }


#: Prompts on either side of LOCAL_MAX_UNCACHED (about four characters a token).
prompt_texts = st.one_of(
    st.text("abcdefgh ", min_size=1, max_size=4 * LOCAL_MAX_UNCACHED - 8),
    st.text("abcdefgh ", min_size=8 * LOCAL_MAX_UNCACHED, max_size=40 * LOCAL_MAX_UNCACHED),
)


@st.composite
def valid_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed request for the local model on any generating route, streamed or not, short or long."""
    kind = draw(st.sampled_from(["completions", "chat", RESPONSES, MESSAGES]))
    text, n, stream = draw(prompt_texts), draw(st.integers(1, 16)), draw(st.booleans())
    body: dict[str, Any] = {"model": "sim-model", "stream": stream}
    if kind == "completions":
        body.update(prompt=text, max_tokens=n)
    elif kind == RESPONSES:
        body.update(input=text, max_output_tokens=n)
    else:
        body.update(messages=[{"role": "user", "content": text}], max_tokens=n)
    if stream and kind in ("completions", "chat") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    path = {"completions": "/v1/completions", "chat": CHAT}.get(kind, kind)
    return {"method": "POST", "path": path, "headers": {"authorization": f"Bearer {KEY}"},
            "content": json.dumps(body).encode(), "stream": stream}  # fmt: skip


# -------------------------------------------------------------------------------------------------- tests


FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(FUZZ, max_examples=EXAMPLES)
@given(req=requests())
def test_gateway_never_5xx_and_errors_are_openai_shaped(stack: Stack, req: dict[str, Any]) -> None:
    _send(stack, req)


@settings(FUZZ, max_examples=max(EXAMPLES // 3, 10))
@given(req=valid_requests())
def test_valid_requests_complete_on_the_path_the_mode_allows(stack: Stack, req: dict[str, Any]) -> None:
    r = _send(stack, req)
    assert r.status_code == 200, (req["path"], r.status_code, r.text[:300])
    paths = {"disagg", "local"} if stack.pd_mode == "adaptive" else {"disagg"}
    assert r.headers["x-pd-path"] in paths, r.headers


def _send(stack: Stack, req: dict[str, Any]) -> httpx.Response:
    """One fuzzed request through the stack, its answer checked and counted in the stack's tally."""
    r = stack.client.request(req["method"], req["path"], headers=req["headers"], content=req["content"])
    label = f"{req['method']} {req['path']}"
    assert r.status_code < 500, (label, r.status_code, r.text[:500])
    assert KEY.encode() not in r.content and UPSTREAM_KEY.encode() not in r.content
    completion = req["path"] in ("/v1/completions", CHAT)
    if completion or req["path"] in AGENT_END:
        stack.completions += 1
        stack.bodies[f"response {stack.completions}"] = r.content
    if req["path"] in AGENT_END and req["method"] == "POST":
        _check_agent_answer(req["path"], r)
        return r
    if r.status_code >= 400:
        out = client_outcome(r.status_code, r.content, stream=False)
        assert out.violation is None, (label, r.status_code, out.violation, r.text[:300])
        if r.status_code in (401,):
            assert json.loads(r.content)["error"]["code"] == "invalid_api_key"
    elif completion:
        stream = r.headers.get("content-type", "").startswith("text/event-stream")
        out = client_outcome(r.status_code, r.content, stream=stream)
        assert out.violation is None, (label, out.violation, r.text[:300])
    if completion and req["method"] == "POST":
        stack.tally.record(client_outcome(r.status_code, r.content, stream=req["stream"] and r.status_code == 200))
    return r


def _check_agent_answer(path: str, r: httpx.Response) -> None:
    """An agent route's answer: its API's error shape, or a complete message/response (N1)."""
    stream = r.headers.get("content-type", "").startswith("text/event-stream")
    if r.status_code >= 400:
        err = json.loads(r.content)
        if path == MESSAGES:
            assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, r.text[:300]
            assert isinstance(err["error"]["type"], str) and isinstance(err["error"]["message"], str)
        else:
            out = client_outcome(r.status_code, r.content, stream=False)
            assert out.violation is None, (path, out.violation, r.text[:300])
    elif stream:
        ended = any(end in r.content for end in AGENT_END[path])
        failed = r.content.count(b"event: error")
        assert ended != bool(failed) and failed <= 1, (path, r.text[-500:])
    else:
        obj = json.loads(r.content)
        assert obj.get("type") == "message" if path == MESSAGES else obj.get("object") == "response", r.text[:300]


def test_after_fuzzing_counters_balance_and_workers_idle(stack: Stack) -> None:
    """After fuzzing (its own examples, plus the fuzz test's where it ran first on the same module stack): nothing
    lost, nothing left running, no key leaked."""

    @settings(FUZZ, max_examples=max(EXAMPLES // 5, 10), database=None)
    @given(req=st.one_of(requests(), valid_requests()))
    def fuzz(req: dict[str, Any]) -> None:
        _send(stack, req)

    fuzz()
    assert stack.gw is not None
    outcomes = gateway_outcomes(stack.gw.metrics_text())
    n1 = check_n1(outcomes)
    assert n1.ok, n1.detail
    assert outcomes is not None and outcomes.accepted >= stack.tally.sent > 0
    print("fuzz statuses:", dict(stack.tally.statuses), dict(outcomes.by_status))
    if stack.pd_mode == "adaptive":
        local, disagg = (stack.gw.metric("pdctl_pd_decisions_total", path=p) for p in ("local", "disagg"))
        assert local > 0 and disagg > 0, (local, disagg)
    n2 = check_n2({"prefill": stack.sims[0].url, "decode": stack.sims[1].url}, timeout_s=35)
    assert n2.ok, n2.detail
    logs = [Path(s.log_path) for s in stack.sims]
    n5 = check_n5(
        [KEY, UPSTREAM_KEY],
        files=logs,
        texts=stack.bodies,
        all_cmdlines=True,
        exclude_pids=[f.proc.pid for f in stack.fakes],
    )  # the fake upstream gets its key on argv
    assert n5.ok, n5.detail
