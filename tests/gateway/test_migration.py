"""Mid-stream migration (:mod:`pdctl.gateway.migration`) on simulator workers: a decode that dies after a few
streamed tokens (``--sim-fault crash-mid-stream``) and the stream that continues elsewhere, token for token."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.gateway.migration import Sent, _Rewriter, continuation_body, eligible, read_sent
from pdctl.gateway.relay import Kept
from pdctl.testing import SimProcess, start_sim
from pdctl.vllm.promtext import metric_value, samples
from tests.fakes.gateway_harness import GatewayThread, make_settings, wait_for

ARGS = ["--max-model-len", "1024", "--sim-profile", "fast"]
CRASH = ("--sim-fault", "crash-mid-stream:5")
PROMPT = "the gateway continues a broken stream " * 6
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture
def sims() -> Iterator[list[SimProcess]]:
    started: list[SimProcess] = []
    yield started
    for s in started:
        s.stop()


def _sim(
    sims: list[SimProcess], tmp_path: Path, name: str, role: str, *extra: str, port: int | None = None
) -> SimProcess:
    s = start_sim([*ARGS, *extra], str(tmp_path), name=name, model="sim-model", role=role, port=port)
    sims.append(s)
    return s


def _gateway(prefill: list[SimProcess], decode: list[SimProcess], **gateway: Any) -> GatewayThread:
    settings = make_settings([p.url for p in prefill], [d.url for d in decode], models=())
    settings = replace(settings, gateway=replace(settings.gateway, **gateway))
    g = GatewayThread(settings)
    assert wait_for(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200, timeout=20)
    return g


def _stream(g: GatewayThread, endpoint: str, body: dict[str, Any]) -> tuple[httpx.Headers, list[Any]]:
    """The stream's events (JSON objects, then ``"[DONE]"``), each whole; asserts the SSE framing."""
    with g.client() as c, c.stream("POST", endpoint, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"\n\n")
    events: list[Any] = []
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block
        data = block[6:]
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return r.headers, events


def _text(events: list[Any], chat: bool) -> str:
    out = ""
    for ev in events:
        if isinstance(ev, dict):
            for ch in ev.get("choices") or ():
                out += (ch.get("delta") or {}).get("content") or "" if chat else ch.get("text") or ""
    return out


def _check_one_answer(events: list[Any], chat: bool, prompt_tokens: int, tokens: int) -> None:
    """One continuous answer: one id, one finish, one usage block counting all of it, then [DONE]."""
    assert events[-1] == "[DONE]"
    body = [e for e in events if isinstance(e, dict)]
    assert not any("error" in e for e in body)
    assert len({e["id"] for e in body}) == 1
    assert {e["object"] for e in body} == {"chat.completion.chunk" if chat else "text_completion"}
    assert sum(1 for e in body for ch in e["choices"] if ch.get("finish_reason")) == 1
    (usage,) = [e["usage"] for e in body if e.get("usage")]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, tokens)
    assert usage["total_tokens"] == prompt_tokens + tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_decode_death_mid_stream_continues_on_the_other_decode(
    sims: list[SimProcess], tmp_path: Path, chat: bool, caplog: pytest.LogCaptureFixture
) -> None:
    p = _sim(sims, tmp_path, "prefill", "kv_producer")
    d0 = _sim(sims, tmp_path, "decode0", "kv_consumer", *CRASH)
    d1 = _sim(sims, tmp_path, "decode1", "kv_consumer")
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": 24, "temperature": 0,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    body.update({"messages": MESSAGES} if chat else {"prompt": PROMPT})
    g = _gateway([p], [d0, d1])
    try:
        broken = None
        with caplog.at_level(logging.INFO, logger="pdctl.gateway.access"):
            for _ in range(2):  # the pool alternates: one of the first two streams lands on the crashing decode
                headers, events = _stream(g, endpoint, body)
                if headers["x-pd-decode"] == "decode-0":
                    broken = events
                    break
            # (the access line is written after the response's end: wait for it while capturing)
            assert wait_for(
                lambda: any("migrations=1 migrated=decode:decode-1" in r.getMessage() for r in caplog.records)
            )
        assert broken is not None
        assert g.metric("pdctl_migrations_total", target="decode", outcome="ok") == 1
        _, reference = _stream(g, endpoint, body)  # decode-0 is gone: uninterrupted, on decode-1
        prompt_tokens = next(e for e in reference if isinstance(e, dict) and e.get("usage"))["usage"]["prompt_tokens"]
        _check_one_answer(broken, chat, prompt_tokens, 24)
        assert _text(broken, chat) == _text(reference, chat)
        assert not any("prompt_token_ids" in e and e["prompt_token_ids"] for e in broken if isinstance(e, dict))
        # The gateway asked for the ids, the client did not: its events carry none, as vLLM's would.
        for events in (broken, reference):
            assert not any("token_ids" in c for e in events if isinstance(e, dict) for c in e.get("choices") or ())
        assert g.metric("pdctl_stream_errors_total", reason="upstream_error") == 0
    finally:
        g.stop()


def test_one_decode_continues_on_the_prefill_serving_it_whole(
    sims: list[SimProcess], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = _sim(sims, tmp_path, "prefill", "kv_producer")
    d = _sim(sims, tmp_path, "decode", "kv_consumer", *CRASH)
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    ref_p = _sim(sims, tmp_path, "ref", "kv_both")  # a fault-free worker serving the same request whole
    with httpx.Client(base_url=ref_p.url, timeout=30) as c:
        reference = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    g = _gateway([p], [d])
    try:
        with caplog.at_level(logging.INFO, logger="pdctl.gateway.access"):
            headers, events = _stream(g, "/v1/completions", body)
            assert wait_for(lambda: any("migrated=prefill:prefill" in r.getMessage() for r in caplog.records))
        assert headers["x-request-id"] and events[-1] == "[DONE]"
        assert _text(events, chat=False) == reference
        assert g.metric("pdctl_migrations_total", target="prefill", outcome="ok") == 1
        assert g.metric("pdctl_requests_total", path="disagg", status="200") == 1
    finally:
        g.stop()


def test_migration_off_ends_the_stream_with_one_error_event(sims: list[SimProcess], tmp_path: Path) -> None:
    p = _sim(sims, tmp_path, "prefill", "kv_producer")
    d = _sim(sims, tmp_path, "decode", "kv_consumer", *CRASH)
    g = _gateway([p], [d], migration_limit=0)
    try:
        _, events = _stream(g, "/v1/completions", {"model": "sim-model", "prompt": PROMPT, "max_tokens": 20})
        assert events[-1] != "[DONE]" and "error" in events[-1]
        assert sum(1 for e in events if isinstance(e, dict) and "error" in e) == 1
        assert g.metric("pdctl_migrations_total", target="prefill", outcome="ok") == 0
    finally:
        g.stop()


def test_no_target_left_ends_with_one_error_event(sims: list[SimProcess], tmp_path: Path) -> None:
    """The only decode dies and the prefill dies too: no target, the wait is bounded, one error event."""
    p = _sim(sims, tmp_path, "prefill", "kv_producer")
    # A CPU-paced decode (13 ms a step): the prefill is gone well before token 60.
    d = _sim(sims, tmp_path, "decode", "kv_consumer", "--sim-profile", "cpu-tiny", "--sim-fault", "crash-mid-stream:60")
    g = _gateway([p], [d], request_timeout_s=3.0)
    try:
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 80, "stream": True}
        with g.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            it = r.iter_raw()
            next(it)
            p.proc.kill()
            raw = b"".join(it)
        assert b"[DONE]" not in raw and raw.count(b'"error"') == 1
        assert g.metric("pdctl_migrations_total", target="-", outcome="no_target") == 1
    finally:
        g.stop()


def test_eligibility() -> None:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    assert eligible(comp, {"prompt": "x"}, True, 3)
    assert eligible(chat, {"messages": [], "response_format": {"type": "text"}}, True, 3)
    assert not eligible(comp, {"prompt": "x"}, False, 3)  # not streamed: retried whole before any byte
    assert not eligible(comp, {"prompt": "x"}, True, 0)
    assert not eligible("/v1/responses", {"input": "x"}, True, 3)
    assert not eligible("/v1/messages", {"messages": []}, True, 3)
    assert not eligible(chat, {"messages": [], "tools": [{"type": "function"}]}, True, 3)
    assert not eligible(chat, {"messages": [], "logprobs": True}, True, 3)
    assert not eligible(chat, {"messages": [], "response_format": {"type": "json_object"}}, True, 3)
    assert not eligible(comp, {"prompt": "x", "n": 2}, True, 3)
    assert not eligible(comp, {"prompt": ["a", "b"]}, True, 3)
    assert eligible(comp, {"prompt": "x", "logprobs": 5, "return_tokens_as_token_ids": True}, True, 3)


def test_sent_tokens_and_the_continuation_body() -> None:
    kept = [
        b'data: {"id":"chatcmpl-r","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"finish_reason":null}],"prompt_token_ids":[1,2,3]}\n\n',
        b'data: {"id":"chatcmpl-r","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":" a"},"finish_reason":null,"token_ids":[7]}]}\r\n\r\n'
        b'data: {"id":"chatcmpl-r","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":" b"},"finish_reason":null,"token_ids":[8,9]}]}\n\n',
    ]
    sent = read_sent(kept, None)
    assert (sent.response_id, sent.created, sent.prompt_ids, sent.tokens) == ("chatcmpl-r", 5, [1, 2, 3], [7, 8, 9])
    assert sent.complete and sent.finish_reason is None
    body = {"model": "m", "messages": [], "max_completion_tokens": 10, "temperature": 0, "min_tokens": 4,
            "tools": None, "chat_template_kwargs": {}}  # fmt: skip
    cont = continuation_body(body, sent)
    assert cont == {"model": "m", "temperature": 0, "prompt": [1, 2, 3, 7, 8, 9], "stream": True,
                    "return_token_ids": True, "stream_options": {"include_usage": True}, "max_tokens": 7,
                    "min_tokens": 1}  # fmt: skip
    assert "max_tokens" not in continuation_body({"model": "m"}, sent)  # vLLM's default: the rest of the context
    blind = read_sent([b'data: {"id":"x","choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'], [1])
    assert not blind.complete  # output without token ids: the tokens sent are unknown, no migration
    assert Sent().prompt_ids is None


@pytest.mark.parametrize("limit", [3, 0], ids=["migrates", "migration-off"])
def test_a_hung_decode_is_found_by_the_stall_timeout_not_the_request_timeout(
    sims: list[SimProcess], tmp_path: Path, limit: int
) -> None:
    """SIGSTOP of the decode serving a stream (a hang: /health no longer answers, the socket stays open): the
    stream continues elsewhere, or ends with an error event, once gateway.stall_timeout_s passes without a byte,
    well before request_timeout_s."""
    import os
    import signal
    import time

    slow = ("--sim-speed", "0.05")
    p = _sim(sims, tmp_path, "prefill", "kv_producer", *slow)
    decodes = [_sim(sims, tmp_path, f"decode{i}", "kv_consumer", *slow) for i in range(2)]
    g = _gateway([p], decodes, stall_timeout_s=1.0, request_timeout_s=120.0, migration_limit=limit)
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
    stopped: SimProcess | None = None
    try:
        _, reference = _stream(g, "/v1/completions", body)
        text, error, waited, struck = "", None, 0.0, 0.0
        with g.client() as c, c.stream("POST", "/v1/completions", json=body, timeout=120) as r:
            victim = decodes[int(r.headers["x-pd-decode"].rsplit("-", 1)[1])]
            events = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    error = ev["error"]
                    waited = time.monotonic() - struck
                    break
                text += "".join(ch.get("text") or "" for ch in ev.get("choices") or ())
                events += 1
                if events == 3:
                    os.kill(victim.proc.pid, signal.SIGSTOP)
                    stopped, struck = victim, time.monotonic()
            else:
                waited = time.monotonic() - struck
        assert stopped is not None
        assert waited < 20  # found by the 1 s stall timeout; the read timeout (request_timeout_s) is 120 s
        if limit:
            assert error is None and text == _text(reference, chat=False)
            assert g.metric("pdctl_migrations_total", target="decode", outcome="ok") == 1
        else:
            assert error is not None and error["code"] == "upstream_timeout"
    finally:
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        g.stop()


@pytest.mark.parametrize("client_asked", [False, True])
def test_the_clients_copy_has_token_ids_only_when_it_asked_and_the_kept_events_always(client_asked: bool) -> None:
    first = (b'data: {"id":"c","choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null,'
             b'"stop_reason":null,"prompt_token_ids":[1,2],"token_ids":[7]}]}\n\n')  # fmt: skip
    later = (
        b'data: {"id":"c","choices":[{"index":0,"text":"b","logprobs":null,"finish_reason":null,"token_ids":[8]}]}\n\n'
    )
    keep = Kept(show_prompt_ids=client_asked)
    out = [json.loads(keep.add(c)[6:]) for c in (first, later)]
    choices = [o["choices"][0] for o in out]
    assert [c.get("token_ids") for c in choices] == ([[7], [8]] if client_asked else [None, None])
    assert choices[0]["prompt_token_ids"] == ([1, 2] if client_asked else None)
    assert [c["text"] for c in choices] == ["a", "b"]
    sent = read_sent(keep.events, keep.prompt_ids)
    assert sent.tokens == [7, 8] and sent.prompt_ids == [1, 2]


# Prefill death during leg 1 (issue 36 item 2): retried on another prefill, served by decode (gateway.fallback),
# or a clear 503; never a hang, never an empty 200. The prefill's engine stalls (``--sim-fault stall``) so leg 1 is
# in flight when its process gets SIGKILL.


def _kill_mid_request(g: GatewayThread, victim: SimProcess, n: int = 1) -> list[httpx.Response]:
    import threading

    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    out: list[httpx.Response] = []

    def one() -> None:
        with g.client() as c:
            out.append(c.post("/v1/completions", json=body, timeout=30))

    def in_engine() -> float:  # the victim's engine holds a request (its gauges move as one is added)
        body = httpx.get(victim.url + "/metrics", timeout=5).text
        parsed = samples(body, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        return sum(
            metric_value(parsed, name) or 0.0 for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    assert wait_for(lambda: in_engine() >= 1, timeout=20), "no request reached the victim"
    victim.proc.kill()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(out) == n
    return out


def _complete(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert r.json()["usage"]["completion_tokens"] == 6


def test_prefill_killed_during_leg1_is_retried_on_the_other_prefill(sims: list[SimProcess], tmp_path: Path) -> None:
    stalled = _sim(sims, tmp_path, "prefill0", "kv_producer", "--sim-fault", "stall")
    ok = _sim(sims, tmp_path, "prefill1", "kv_producer")
    d = _sim(sims, tmp_path, "decode", "kv_consumer")
    g = _gateway([stalled, ok], [d])
    try:
        for r in _kill_mid_request(g, stalled, n=2):  # one on each prefill
            _complete(r)
            assert r.headers["x-pd-prefill"] == "prefill-1"
        assert g.metric("pdctl_retries_total", leg="prefill") >= 1  # 2 when the second came after the kill
    finally:
        g.stop()


@pytest.mark.parametrize("fallback", ["none", "decode"])
def test_only_prefill_killed_during_leg1_is_a_503_or_served_by_decode(
    sims: list[SimProcess], tmp_path: Path, fallback: str
) -> None:
    p = _sim(sims, tmp_path, "prefill", "kv_producer", "--sim-fault", "stall")
    d = _sim(sims, tmp_path, "decode", "kv_consumer")
    g = _gateway([p], [d], fallback=fallback)
    try:
        (r,) = _kill_mid_request(g, p)
        if fallback == "decode":
            _complete(r)
            assert r.headers["x-pd-path"] == "fallback"
            assert (
                g.metric("pdctl_prefill_fallback_total", to="decode", reason="prefill_failed")
                + g.metric("pdctl_prefill_fallback_total", to="decode", reason="no_prefill")
                == 1
            )
        else:
            assert r.status_code in (502, 503), r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and "prefill" in err["message"]
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1
    finally:
        g.stop()


def test_completions_logprobs_continue_at_the_whole_answers_text_offset() -> None:
    lp = {"text_offset": [0, 3], "token_logprobs": [-0.1, -0.2], "tokens": [" ab", " c"], "top_logprobs": None}
    first = {
        "id": "cmpl-r",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": " ab c", "logprobs": lp, "finish_reason": None, "token_ids": [4, 5]}],
    }
    sent = read_sent([b"data: " + json.dumps(first).encode() + b"\n\n"], [1, 2])
    assert (sent.tokens, sent.text_end) == ([4, 5], 5)
    assert continuation_body({"model": "m", "prompt": "x", "logprobs": 2}, sent)["logprobs"] == 2
    rw = _Rewriter(sent, chat=False, with_ids=False)
    rw.base = sent.text_end
    more = {"text_offset": [0], "token_logprobs": [-0.3], "tokens": [" d"], "top_logprobs": None}
    out = rw.event(
        {
            "id": "cmpl-other",
            "choices": [{"index": 0, "text": " d", "logprobs": more, "finish_reason": "length", "token_ids": [6]}],
        }
    )
    ev = json.loads(out[len(b"data: ") :])
    assert ev["id"] == "cmpl-r" and ev["choices"][0]["logprobs"]["text_offset"] == [5]
    assert "token_ids" not in ev["choices"][0] and sent.tokens == [4, 5, 6] and sent.text_end == 7


def test_no_other_worker_waits_for_the_restarted_decode(sims: list[SimProcess], tmp_path: Path) -> None:
    """1P1D, the prefill gone too: the stream waits (bounded) for the decode to answer /health again, then
    continues there."""
    import threading
    import time

    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    ref = _sim(sims, tmp_path, "ref", "kv_both")
    with httpx.Client(base_url=ref.url, timeout=30) as c:
        reference = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    p = _sim(sims, tmp_path, "prefill", "kv_producer")
    d = _sim(sims, tmp_path, "decode", "kv_consumer", "--sim-profile", "cpu-tiny", "--sim-fault", "crash-mid-stream:12")
    g = _gateway([p], [d], request_timeout_s=20.0)

    def restart() -> None:
        d.proc.wait(20)  # the crash
        time.sleep(1.0)
        _sim(sims, tmp_path, "decode-restarted", "kv_consumer", port=d.port)

    try:
        with g.client() as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            it = r.iter_raw()
            first = next(it)
            p.proc.kill()
            back = threading.Thread(target=restart)
            back.start()
            raw = first + b"".join(it)
            back.join(30)
        events = [json.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]
        assert raw.endswith(b"data: [DONE]\n\n") and not any("error" in e for e in events)
        assert _text(events, chat=False) == reference
        assert g.metric("pdctl_migrations_total", target="restarted", outcome="ok") == 1
    finally:
        g.stop()


def test_decode_killed_during_a_non_streamed_request_is_retried_on_the_other_decode(
    sims: list[SimProcess], tmp_path: Path
) -> None:
    """Nothing reached the client of a non-streamed request: no migration, the whole pipeline is retried."""
    p = _sim(sims, tmp_path, "prefill", "kv_producer")
    stalled = _sim(sims, tmp_path, "decode0", "kv_consumer", "--sim-fault", "stall")
    ok = _sim(sims, tmp_path, "decode1", "kv_consumer")
    g = _gateway([p], [stalled, ok])
    try:
        for r in _kill_mid_request(g, stalled, n=2):  # one on each decode
            _complete(r)
            assert r.headers["x-pd-decode"] == "decode-1"
        assert g.metric("pdctl_retries_total", leg="decode") >= 1
    finally:
        g.stop()
