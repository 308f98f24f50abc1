"""The simulator's HTTP front end: a raw ASGI app with vLLM's OpenAI-compatible endpoints and shapes.

With ``VLLM_SERVER_DEV_MODE=1`` it also serves vLLM's ``POST /reset_prefix_cache``
(vllm/entrypoints/serve/dev/cache/api_router.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

from pdctl.sim import logfmt as L
from pdctl.sim import logprobs as lp
from pdctl.sim.agentapi import (
    COUNT_TOKENS,
    MESSAGES,
    RESPONSES,
    AgentStream,
    chat_request,
    messages_reply,
    responses_reply,
)
from pdctl.sim.engine import SimEngine, SimRequest, StreamEvent
from pdctl.sim.text import VOCAB_SIZE, apply_chat_template

__all__ = ["SimApp"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

VLLM_VERSION = "0.32.0"
FINGERPRINT = f"vllm-{VLLM_VERSION}-sim"
_PHRASES = {400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class HTTPError(Exception):
    """An error answered in vLLM's shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``: ``code`` is the status, ``type`` its phrase."""
    return {"error": {"message": message, "type": _PHRASES.get(status, "Error"), "param": param, "code": status}}


class _Reply(NamedTuple):
    """One completion's answer side: where it goes, the engine's request, the client's body and the reply's id."""

    send: Send
    req: SimRequest
    body: Mapping[str, Any]
    chat: bool
    resp_id: str
    extra: list[tuple[bytes, bytes]]
    watcher: asyncio.Future[None]


class SimApp:
    """ASGI app over one ``SimEngine``; ``reported_model`` is the id shown (and accepted)."""

    def __init__(self, engine: SimEngine, reported_model: str, on_crash: Callable[[int], None]) -> None:
        self.engine = engine
        self.model = reported_model
        self.root = engine.cfg.model
        self.created = int(time.time())
        self._on_crash = on_crash
        self.ready = True
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's routes: the answer, 405 for a known path with another method, 404 for any other path."""
        path, method = scope["path"], scope["method"]
        try:
            if path == "/health" and method == "GET":
                await _respond(send, 200 if self.ready else 503, b"", [])
            elif path == "/v1/models" and method == "GET":
                await _json(send, 200, self._models())
            elif path == "/version" and method == "GET":
                await _json(send, 200, {"version": VLLM_VERSION})
            elif path == "/metrics" and method == "GET":
                body = self.engine.metrics.render()
                await _respond(send, 200, body, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
            elif path == "/tokenize" and method == "POST":
                await _json(send, 200, self._tokenize(await _read_json(receive)))
            elif path == "/detokenize" and method == "POST":
                await _json(send, 200, self._detokenize(await _read_json(receive)))
            elif path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
                await self._generate(scope, receive, send, chat=path.endswith("chat/completions"))
            elif path in (RESPONSES, MESSAGES) and method == "POST":
                await self._agent(scope, receive, send, path)
            elif path == COUNT_TOKENS and method == "POST":
                await _json(send, 200, self._count_tokens(await _read_json(receive)))
            elif path == "/reset_prefix_cache" and self.dev_mode and method == "POST":
                self.engine.log.info(L.W_RESET_API, "Resetting prefix cache...")
                await _json(send, 200, {"success": self.engine.reset_prefix_cache()})
            elif path == "/reset_prefix_cache" and self.dev_mode:
                await _json(send, 405, error_body(405, "Method Not Allowed"))
            elif path in ("/health", "/v1/models", "/version", "/metrics", "/tokenize", "/detokenize",
                          "/v1/completions", "/v1/chat/completions", RESPONSES, MESSAGES, COUNT_TOKENS):  # fmt: skip
                await _json(send, 405, error_body(405, "Method Not Allowed"))
            else:
                await _json(send, 404, {"detail": "Not Found"})
        except HTTPError as e:
            if path in (MESSAGES, COUNT_TOKENS):  # vLLM's translate_error_response: Anthropic's envelope and type
                kind = _PHRASES.get(e.status, "Error").replace(" ", "") + "Error"
                await _json(send, e.status, {"type": "error", "error": {"type": kind, "message": e.message}})
            else:
                await _json(send, e.status, error_body(e.status, e.message, e.param))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "vllm",
                    "root": self.root,
                    "parent": None,
                    "max_model_len": self.engine.cfg.max_model_len,
                    "permission": [],
                }
            ],
        }

    def _tokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if "messages" in body:
            text = apply_chat_template(_messages(body), bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise HTTPError(400, "Either 'prompt' (a string) or 'messages' is required.", "prompt")
        ids = self.engine.tokenizer.encode(text)
        return {"count": len(ids), "max_model_len": self.engine.cfg.max_model_len, "tokens": ids, "token_strs": None}

    def _count_tokens(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``/v1/messages/count_tokens``: the Messages request's rendered prompt, counted (vLLM 0.32's answer)."""
        self._check_model(body)
        try:
            messages, _, _ = chat_request(body, COUNT_TOKENS)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        n = len(self.engine.tokenizer.encode(apply_chat_template(messages)))
        return {"input_tokens": n, "context_management": {"original_input_tokens": n}}

    # ------------------------------------------------------------------ generation
    def _check_model(self, body: Mapping[str, Any]) -> None:
        name = body.get("model")
        if name is not None and name != self.model:
            raise HTTPError(404, f"The model `{name}` does not exist.", "model")

    def _prompt_ids(self, body: Mapping[str, Any], chat: bool) -> list[int]:
        tok = self.engine.tokenizer
        if chat:
            return tok.encode(apply_chat_template(_messages(body)))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < VOCAB_SIZE), None)
            if bad is not None:
                raise HTTPError(400, f"Token id {bad} is out of vocabulary", "prompt")
            return list(prompt)
        raise HTTPError(400, "'prompt' must be a string, a list of one string, or a list of token ids.", "prompt")

    def _max_tokens(self, body: Mapping[str, Any], prompt_len: int) -> tuple[int, bool]:
        limit = self.engine.cfg.max_model_len
        if prompt_len > limit:
            raise HTTPError(
                400,
                f"The decoder prompt (length {prompt_len}) is longer than the maximum model length of {limit}. "
                "Make sure that `max_model_len` is no smaller than the number of text tokens.",
                "prompt",
            )
        raw = body.get("max_completion_tokens", body.get("max_tokens"))
        if raw is None:
            return max(1, limit - prompt_len), True
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
            raise HTTPError(400, f"max_tokens must be at least 1, got {raw}.", "max_tokens")
        if prompt_len + raw > limit:
            raise HTTPError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {raw}. This model's maximum context "
                f"length is {limit} tokens and your request has {prompt_len} input tokens "
                f"({raw} > {limit} - {prompt_len}).",
                "max_tokens",
            )
        return raw, False

    @staticmethod
    def _top_k(body: Mapping[str, Any], chat: bool) -> int | None:
        """How many candidates per token the request asks for (None: no logprobs), as vLLM validates it."""
        field = "top_logprobs" if chat else "logprobs"
        if chat and not body.get("logprobs"):
            return None
        raw = body.get(field, 0 if chat else None)
        if raw is None:
            return None
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0 or raw > lp.MAX_LOGPROBS:
            raise HTTPError(400, f"{field} must be an integer from 0 to {lp.MAX_LOGPROBS}, got {raw!r}.", field)
        return raw

    def _logprobs(self, body: Mapping[str, Any], req: SimRequest, chat: bool) -> dict[str, Any] | None:
        k = self._top_k(body, chat)
        if k is None:
            return None
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        build = lp.chat_logprobs if chat else lp.completion_logprobs
        return build(self.engine.tokenizer, req.output_ids, req.output_scores, k, as_ids, req.near_ties)

    def _detokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise HTTPError(400, "'tokens' must be a list of token ids.", "tokens")
        return {"prompt": self.engine.tokenizer.decode(tokens)}

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        body = await _read_json(receive)
        self._check_model(body)
        self._top_k(body, chat)
        try:
            ids = self._prompt_ids(body, chat)
        except ValueError as e:
            raise HTTPError(400, str(e), "messages") from None
        max_tokens, default_len = self._max_tokens(body, len(ids))
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise HTTPError(400, "temperature must be a number >= 0.", "temperature")
        params = body.get("kv_transfer_params")
        if params is not None and not isinstance(params, Mapping):
            raise HTTPError(400, "kv_transfer_params must be an object.", "kv_transfer_params")
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or secrets.token_hex(16)
        resp_id = ("chatcmpl-" if chat else "cmpl-") + rid
        seed = body.get("seed")
        req = SimRequest(
            request_id=self.engine.new_request_id(resp_id),
            prompt_ids=ids,
            max_tokens=max_tokens,
            temperature=float(temperature),
            seed=seed if isinstance(seed, int) else None,
            eos_allowed=default_len and not body.get("ignore_eos", False),
            cache_salt=body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None,
            kv_params=params,
        )
        self.engine.add(req)
        extra = [(b"x-request-id", rid.encode("latin-1"))]
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            reply = _Reply(send, req, body, chat, resp_id, extra, watcher)
            await (self._stream(reply) if body.get("stream") else self._complete(reply))
        finally:
            watcher.cancel()
            self.engine.abort(req)

    async def _agent(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        """``/v1/responses`` and ``/v1/messages`` (:mod:`pdctl.sim.agentapi`): the engine runs them as chat."""
        body = await _read_json(receive)
        self._check_model(body)
        try:
            messages, max_raw, forced = chat_request(body, route)
            ids = self.engine.tokenizer.encode(apply_chat_template(messages))
        except ValueError as e:
            raise HTTPError(400, str(e), "messages" if route == MESSAGES else "input") from None
        field = "max_tokens" if route == MESSAGES else "max_output_tokens"
        max_tokens, default_len = self._max_tokens({} if max_raw is None else {"max_tokens": max_raw}, len(ids))
        if max_raw is not None and max_tokens != max_raw:
            raise HTTPError(400, f"{field} must be a positive integer.", field)
        params = body.get("kv_transfer_params")
        if params is not None and not isinstance(params, Mapping):
            raise HTTPError(400, "kv_transfer_params must be an object.", "kv_transfer_params")
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or secrets.token_hex(16)
        if route == RESPONSES:  # the body's request_id names the response; the header is not used (vLLM)
            given = body.get("request_id")
            resp_id = given if isinstance(given, str) and given else f"resp_{secrets.token_hex(16)}"
        else:
            resp_id = "chatcmpl-" + rid
        temperature = body.get("temperature", 1.0)
        req = SimRequest(
            request_id=self.engine.new_request_id(resp_id),
            prompt_ids=ids,
            max_tokens=max_tokens,
            temperature=float(temperature) if isinstance(temperature, (int, float)) else 1.0,
            seed=None,
            eos_allowed=default_len,
            kv_params=params,
        )
        self.engine.add(req)
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        extra = [(b"x-request-id", rid.encode("latin-1"))]
        try:
            if not body.get("stream"):
                if not await self._finished(req, watcher):
                    return
                text = self.engine.tokenizer.decode(req.output_ids)
                n_out = len(req.output_ids)
                if route == MESSAGES and forced is not None and req.finish_reason == "length":
                    # vLLM's non-streamed Anthropic reply json.loads the call's arguments, which a max-token stop
                    # cut off (messages_full_converter): a 400, e.g. for a forced tool on a one-token prefill leg.
                    raise HTTPError(400, "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")
                out = (
                    messages_reply(resp_id, self.model, text, req.finish_reason, forced, req.prompt_len, n_out,
                                   req.result_params)
                    if route == MESSAGES
                    else responses_reply(resp_id, self.model, body, text, req.finish_reason, forced, req.prompt_len,
                                         n_out, req.result_params)
                )  # fmt: skip
                await _json(send, 200, out, extra)
                return
            first = await self._open_stream(send, req, extra, watcher)
            if first is None:
                return

            async def write(data: bytes) -> None:
                await send({"type": "http.response.body", "body": data, "more_body": True})

            out_stream = AgentStream(route, write, resp_id, self.model, body, forced, req.prompt_len)
            await out_stream.start()
            cur: StreamEvent | None = first
            while cur is not None and cur.kind == "token":
                await out_stream.token(self.engine.tokenizer.token_text(cur.token))
                cur = await self._next(req, watcher)
            if cur is None:
                return
            if cur.kind == "error":
                await out_stream.fail(cur.message)
            else:
                await out_stream.finish(req.finish_reason, len(req.output_ids))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.engine.abort(req)

    async def _open_stream(
        self, send: Send, req: SimRequest, extra: list[tuple[bytes, bytes]], watcher: asyncio.Future[None]
    ) -> StreamEvent | None:
        """The first event, then the stream's headers; None when the client went away.

        Errors found before the first token (e.g. a failed KV pull) are answered as plain HTTP errors."""
        first = await self._next(req, watcher)
        if first is None:
            return None
        if first.kind == "error":
            raise HTTPError(first.status, first.message)
        await send({"type": "http.response.start", "status": 200, "headers": _SSE + extra})
        return first

    async def _finished(self, req: SimRequest, watcher: asyncio.Future[None]) -> bool:
        """Wait for the request's end (a non-streamed answer); False when the client went away."""
        while True:
            ev = await self._next(req, watcher)
            if ev is None:
                return False
            if ev.kind == "error":
                raise HTTPError(ev.status, ev.message)
            if ev.kind == "finish":
                return True

    async def _next(self, req: SimRequest, watcher: asyncio.Future[None]) -> StreamEvent | None:
        """The next engine event, or None when the client went away."""
        if not req.events.empty():
            return req.events.get_nowait()
        getter: asyncio.Future[StreamEvent] = asyncio.ensure_future(req.events.get())
        waits: set[asyncio.Future[Any]] = {getter, watcher}
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        return None

    async def _complete(self, r: _Reply) -> None:
        send, req, body, chat, resp_id, extra, watcher = r
        if not await self._finished(req, watcher):
            return
        text = self.engine.tokenizer.decode(req.output_ids)
        want_ids = bool(body.get("return_token_ids"))
        logprobs = self._logprobs(body, req, chat)
        ids = list(req.output_ids) if want_ids else None
        prompt_ids = list(req.prompt_ids) if want_ids else None
        obj = "chat.completion" if chat else "text_completion"
        content: dict[str, Any] = (
            {"message": {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                         "function_call": None, "tool_calls": [], "reasoning": None}}
            if chat
            else {"text": text}
        )  # fmt: skip
        choice = {"index": 0, **content, "logprobs": logprobs, "finish_reason": req.finish_reason,
                  "stop_reason": None, "token_ids": ids}  # fmt: skip
        if not chat:
            choice.update(prompt_logprobs=None, prompt_token_ids=prompt_ids, routed_experts=None)
        # vLLM's two response classes share their head and usage; the fields after those are each class's own.
        out: dict[str, Any] = {"id": resp_id, "object": obj, "created": int(time.time()), "model": self.model,
                               "choices": [choice], "service_tier": None, "system_fingerprint": FINGERPRINT,
                               "usage": _usage(req)}  # fmt: skip
        if chat:
            out.update(prompt_logprobs=None, prompt_token_ids=prompt_ids, kv_transfer_params=req.result_params)
        else:
            out.update(kv_transfer_params=req.result_params, ec_transfer_params=None, metrics=None)
        await _json(send, 200, out, extra)

    async def _stream(self, r: _Reply) -> None:
        send, req, body, chat, resp_id, extra, watcher = r
        first = await self._open_stream(send, req, extra, watcher)
        if first is None:
            return
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        want_ids = bool(body.get("return_token_ids"))
        opts = body.get("stream_options")
        include_usage = isinstance(opts, Mapping) and bool(opts.get("include_usage"))
        crash = self.engine.faults.get("crash-mid-stream")
        crash_at = int(crash.num(3)) if crash is not None and crash.fires() else 0
        tok = self.engine.tokenizer
        head = f'{{"id":"{resp_id}","object":"{obj}","created":{created},"model":{json.dumps(self.model)},'

        async def chunk(payload: str) -> None:
            await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(), "more_body": True})

        if chat:
            await chunk(head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                        '"logprobs":null,"finish_reason":null}],"prompt_token_ids":'
                        + (json.dumps(req.prompt_ids) if want_ids else "null") + "}")  # fmt: skip
        sent = 0
        ev: StreamEvent | None = first
        while ev is not None:
            if ev.kind == "error":
                await chunk(json.dumps(error_body(ev.status, ev.message)))
                break
            if ev.kind == "finish":
                break
            # Coalesce a finish that is already queued into the last token's chunk, as vLLM does.
            nxt = req.events.get_nowait() if not req.events.empty() else None
            reason = json.dumps(req.finish_reason) if nxt is not None and nxt.kind == "finish" else "null"
            text = json.dumps(tok.token_text(ev.token))
            ids = f',"token_ids":[{ev.token}]' if want_ids else ""
            if want_ids and not chat and sent == 0:  # vLLM's completions send the prompt's ids in the first chunk
                ids = f',"prompt_token_ids":{json.dumps(req.prompt_ids)}{ids}'
            if chat:
                await chunk(head + f'"choices":[{{"index":0,"delta":{{"content":{text}}},"logprobs":null,'
                            f'"finish_reason":{reason}{ids}}}]}}')  # fmt: skip
            else:
                await chunk(head + f'"choices":[{{"index":0,"text":{text},"logprobs":null,'
                            f'"finish_reason":{reason},"stop_reason":null{ids}}}]}}')  # fmt: skip
            sent += 1
            if crash_at and sent == crash_at:
                self.engine.crash(137)
            if nxt is not None and nxt.kind == "finish":
                break
            ev = nxt if nxt is not None else await self._next(req, watcher)
        if ev is None:
            return
        if include_usage and req.finish_reason is not None and ev.kind != "error":
            await chunk(head + f'"choices":[],"usage":{json.dumps(_usage(req))}}}')
        if ev.kind != "error":
            await chunk("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _usage(req: SimRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": req.prompt_len,
        "total_tokens": req.prompt_len + len(req.output_ids),
        "completion_tokens": len(req.output_ids),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, Mapping) for m in msgs):
        raise HTTPError(400, "'messages' must be a non-empty list of message objects.", "messages")
    return msgs


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _read_json(receive: Receive) -> dict[str, Any]:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected")
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except ValueError as e:
        raise HTTPError(400, f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "The request body must be a JSON object.")
    return body


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, obj: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    with contextlib.suppress(OSError):
        await _respond(send, status, json.dumps(obj).encode(), _JSON + (extra or []))
