"""A chat request's prompt as the engine renders it: the model's Jinja chat template, the way transformers runs it.

vLLM 0.32 renders ``/v1/chat/completions`` with transformers' ``apply_chat_template``
(vllm/renderers/hf.py ``safe_apply_chat_template``), which compiles the template in a sandboxed Jinja environment
(transformers/utils/chat_template_utils.py ``_cached_compile_jinja_template``: ``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension, a ``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``),
renders it with ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the tokenizer's special
tokens (``bos_token``, ``eos_token``, ...), then encodes the text with ``add_special_tokens=False``. This module
does the same with jinja2 alone, so the gateway knows a chat's exact prompt token ids (adaptive PD's exact view,
:mod:`pdctl.gateway.routing.exact_view`) without importing transformers.

Map:

- :class:`ChatTemplate`: :meth:`ChatTemplate.load` reads a model folder's ``chat_template.jinja`` (transformers 5)
  or ``tokenizer_config.json``'s ``chat_template``, with its special tokens; :meth:`ChatTemplate.render` -> the
  prompt text, or None for a request it cannot render as vLLM would.

The request is first rewritten as vLLM rewrites it (:mod:`pdctl.gateway.prompt_view`: the agent routes' conversion
to chat, Claude Code's billing line, tools as vLLM dumps them, text parts joined or kept by the template's content
format, ``developer`` as ``system`` where the template lacks the role). What :meth:`~ChatTemplate.render` declines
(None; the caller falls back to its approximate view): a request :func:`~pdctl.gateway.prompt_view.chat_request`
does not know exactly (images, unknown blocks, ``continue_final_message``, ``documents``), and a template that
raises or does not compile here (a transformers-only extension such as ``{% generation %}``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from pdctl.gateway import conversation, prompt_view

__all__ = ["ChatTemplate"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ChatTemplate:
    """One model's chat template, compiled once."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = env.from_string(source)
        self.content_format = conversation.content_format(source)
        """``string`` or ``openai``: how the template reads a message's content."""
        self.merge_system = conversation.merge_inline_system(self._template)
        """Whether ``/v1/messages`` merges inline system messages into the leading one for this template."""
        self.developer_role = '"developer"' in source or "'developer'" in source

    @classmethod
    def load(cls, folder: Path) -> ChatTemplate | None:
        """The template of the model in ``folder`` (None: it has none, or jinja2 cannot compile it)."""
        config: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        jinja_file = folder / "chat_template.jinja"
        source: Any = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else config.get("chat_template")
        if isinstance(source, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
            source = named.get("default")
        if not isinstance(source, str):
            return None
        special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
        try:
            return cls(source, special)
        except Exception:  # a template jinja2 alone cannot compile (transformers' extensions): no exact view
            return None

    def render(self, body: Mapping[str, Any], endpoint: str = prompt_view.CHAT) -> str | None:
        """The prompt text vLLM renders for ``body`` sent to ``endpoint`` (None: declined, module docstring)."""
        req = prompt_view.chat_request(endpoint, body, self.merge_system)
        if req is None or not req.messages:
            return None
        messages = conversation.conversation(req.messages, self.content_format, self.developer_role)
        if messages is None:
            return None
        try:
            return str(self._template.render(**{
                **self.special_tokens,
                **req.template_kwargs,
                "messages": messages,
                "tools": req.tools,
                "documents": None,
                "add_generation_prompt": req.add_generation_prompt,
            }))  # fmt: skip
        except Exception:  # the template rejected the request (raise_exception) or failed: vLLM answers 400 itself
            return None
