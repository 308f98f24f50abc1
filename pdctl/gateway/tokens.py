"""Prompt token counts for rate limits and admission: the model's own tokenizer, else an estimate.

:func:`find_tokenizer` looks for ``tokenizer.json`` in a local model folder or in the Hugging Face cache
(never over the network); :class:`TokenCounter` loads each one once (the ``tokenizers`` library, Rust, fast)
and counts the text of a request body. Chat templates add a few tokens per message that are not counted.
Without a tokenizer, :func:`estimate_tokens` counts each CJK character as a token and four ASCII characters
as one, so Chinese prompts are not under-counted (one token is about 1-1.5 Chinese characters).

:meth:`TokenCounter.prompt_ids` gives a request's exact prompt token ids, as the engine computes them (adaptive PD's
exact view): a completion's prompt encoded with the tokenizer's special tokens, a chat, an Anthropic Messages or a
Responses request rewritten as vLLM rewrites it (:mod:`pdctl.gateway.prompt_view`), rendered with the model's chat
template (:mod:`pdctl.gateway.chat_template`) and encoded without them, as vLLM does; the simulator's models
(``engine = "sim"``) with the simulator's own tokenizer and template. None where that cannot be known exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pdctl.gateway.chat_template import ChatTemplate
from pdctl.vllm.protocol import MESSAGES_PATH, RESPONSES_PATH

__all__ = ["TokenCounter", "estimate_tokens", "find_tokenizer", "prompt_parts"]

#: The endpoints whose prompt :meth:`TokenCounter.prompt_ids` knows.
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
AGENT_ROUTES = (MESSAGES_PATH, RESPONSES_PATH)

log = logging.getLogger("pdctl.gateway")

# Above this many characters the count runs on a thread, so a long prompt does not stall the event loop
# (about 1 ms a thousand characters; the thread hop costs ~0.1 ms; docs/performance.md).
_THREAD_CHARS = 2048


def estimate_tokens(texts: Iterable[str], ids: int = 0) -> int:
    """Tokens of ``texts`` without a tokenizer, plus ``ids``: four ASCII characters a token, and a token per
    two UTF-8 bytes beyond the first of each other character (a CJK character, 3 bytes: one token, as in the
    tokenizers of Qwen, GLM, DeepSeek; Cyrillic, 2 bytes: half a token). The byte count is C-fast; a regex
    over a long Chinese prompt is not (docs/performance.md)."""
    total = ids
    for t in texts:
        wide = 0 if t.isascii() else (len(t.encode("utf-8", "surrogatepass")) - len(t)) // 2
        total += wide + -(-max(0, len(t) - wide) // 4)
    return max(1, total)


def prompt_parts(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """The prompt's text pieces and its count of token ids: ``messages`` or ``prompt``, and the agent routes'
    ``system`` (Anthropic), ``instructions`` and ``input`` (Responses) and ``tools`` (their JSON: an agent's tool
    definitions are often most of its prompt)."""
    texts: list[str] = []
    ids = 0
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        texts.append(json.dumps(tools, ensure_ascii=False))
    stack: list[Any] = [body.get("messages"), body.get("prompt"), body.get("system"), body.get("instructions"),
                        body.get("input")]  # fmt: skip
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            texts.append(v)
        elif isinstance(v, bool):
            continue
        elif isinstance(v, int):
            ids += 1
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(x for k, x in v.items() if k in ("content", "text", "prompt", "arguments", "output"))
    return texts, ids


def find_tokenizer(source: str) -> Path | None:
    """``tokenizer.json`` of a local model folder, or of a Hugging Face repo id already in the cache."""
    local = Path(source).expanduser()
    if local.is_dir():
        f = local / "tokenizer.json"
        return f if f.is_file() else None
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - comes with vLLM and tokenizers
        return None
    try:
        found = try_to_load_from_cache(source, "tokenizer.json")
    except Exception:  # an invalid repo id: there is no cached tokenizer to find
        return None
    return Path(found) if isinstance(found, str) else None


class TokenCounter:
    """Token counts per model name: exact where a tokenizer was loaded, estimated elsewhere."""

    def __init__(self) -> None:
        self._tok: dict[str, Any] = {}
        self._templates: dict[str, ChatTemplate] = {}
        self._sim: dict[str, tuple[Any, Any]] = {}

    def load(self, models: Mapping[str, str], sim: Iterable[str] = ()) -> None:
        """Load the tokenizer (and chat template) of each ``{served name: model path or repo id}`` that has one
        (blocking); the models in ``sim`` are the simulator's, tokenized as it does."""
        from tokenizers import Tokenizer

        for name in sim:
            from pdctl.sim.text import Tokenizer as SimTokenizer
            from pdctl.sim.text import apply_chat_template

            self._sim[name] = (SimTokenizer(), apply_chat_template)
        for name, source in models.items():
            if name in self._tok or name in self._sim:
                continue
            path = find_tokenizer(source)
            if path is None:
                log.info("model %s: no tokenizer.json found locally; token counts are estimates", name)
                continue
            try:
                self._tok[name] = Tokenizer.from_file(str(path))
            except Exception as exc:  # a corrupt file must not stop the gateway: counts fall back to estimates
                log.warning("model %s: cannot load %s (%s); token counts are estimates", name, path, exc)
                continue
            try:
                template = ChatTemplate.load(path.parent)
            except (OSError, ValueError) as exc:  # unreadable config: chats get no exact prompt ids
                log.warning("model %s: cannot read its chat template (%s)", name, exc)
                template = None
            if template is not None:
                self._templates[name] = template

    def exact(self, model: str) -> bool:
        """Whether ``model`` is counted with its tokenizer."""
        return model in self._tok

    def _count(self, model: str, texts: list[str], ids: int) -> int:
        tok = self._tok.get(model)
        if tok is None:
            return estimate_tokens(texts, ids)
        if not texts:
            return max(1, ids)
        encs = tok.encode_batch(texts, add_special_tokens=False)
        return max(1, ids + sum(len(e.ids) for e in encs))

    def _ids(self, model: str, endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if endpoint == COMPLETIONS and isinstance(prompt, list) and prompt:  # the ids themselves, any model
            ok = all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            return list(prompt) if ok else None
        sim = self._sim.get(model)
        if sim is not None:
            tok, template = sim
            if endpoint == CHAT and isinstance(body.get("messages"), list):
                return list(tok.encode(template(body["messages"], bool(body.get("add_generation_prompt", True)))))
            if endpoint in AGENT_ROUTES:  # the simulator renders the agent routes as vLLM does, its own way
                from pdctl.sim.agentapi import chat_request

                try:
                    return list(tok.encode(template(chat_request(body, endpoint)[0])))
                except ValueError:  # the simulator answers it 400
                    return None
            if endpoint == COMPLETIONS and isinstance(prompt, str):
                return list(tok.encode(prompt))
        else:
            tok = self._tok.get(model)
            if tok is None:
                return None
            if endpoint == CHAT or endpoint in AGENT_ROUTES:
                template = self._templates.get(model)
                text = template.render(body, endpoint) if template is not None else None
                return None if text is None else list(tok.encode(text, add_special_tokens=False).ids)
            if endpoint == COMPLETIONS and isinstance(prompt, str):
                return list(tok.encode(prompt, add_special_tokens=True).ids)
        return None

    async def prompt_ids(self, model: str, endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine computes them (module docstring); None: not known exactly. A long
        prompt is encoded on a thread."""
        if sum(len(t) for t in prompt_parts(body)[0]) > _THREAD_CHARS:
            return await asyncio.to_thread(self._ids, model, endpoint, body)
        return self._ids(model, endpoint, body)

    async def count(self, model: str, body: Mapping[str, Any]) -> int:
        """Prompt tokens of ``body`` for ``model``; a long prompt is counted on a thread."""
        texts, ids = prompt_parts(body)
        if model in self._tok and sum(len(t) for t in texts) > _THREAD_CHARS:
            return await asyncio.to_thread(self._count, model, texts, ids)
        return self._count(model, texts, ids)
