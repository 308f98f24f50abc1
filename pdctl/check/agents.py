"""Rules about the agent routes: vLLM's tool calling on every worker alike.

- :func:`tools` PD032: ``--enable-auto-tool-choice`` and ``--tool-call-parser`` in each vLLM worker's
  ``extra_args``, the same on prefill and decode; the fix names the parser of the model's family, or one read
  from its tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdctl.check.findings import Ctx, Finding, is_local
from pdctl.config import Deployment, WorkerConfig

#: vLLM's ``--tool-call-parser`` for well-known model families (vLLM's tool-calling docs), by model name.
_TOOL_PARSERS = (("qwen3-coder", "qwen3_coder"), ("qwen", "hermes"), ("qwq", "hermes"), ("llama-3", "llama3_json"),
                 ("mistral", "mistral"))  # fmt: skip
_AUTO_TOOLS, _TOOL_PARSER = "--enable-auto-tool-choice", "--tool-call-parser"


def _tool_flags(w: WorkerConfig) -> tuple[bool, str | None]:
    """Whether ``w``'s ``extra_args`` turn on vLLM's auto tool choice, and the tool-call parser they name."""
    args, parser = w.extra_args, None
    for i, a in enumerate(args):
        if a == _TOOL_PARSER and i + 1 < len(args):
            parser = args[i + 1]
        elif a.startswith(_TOOL_PARSER + "="):
            parser = a.partition("=")[2]
    return _AUTO_TOOLS in args, parser


def _with_tools(w: WorkerConfig, parser: str) -> list[str]:
    """``w``'s ``extra_args`` with exactly ``--enable-auto-tool-choice --tool-call-parser parser``."""
    args, out, skip = list(w.extra_args), [], False
    for a in args:
        if skip:
            skip = False
        elif a == _TOOL_PARSER:
            skip = True
        elif a != _AUTO_TOOLS and not a.startswith(_TOOL_PARSER + "="):
            out.append(a)
    return [*out, _AUTO_TOOLS, _TOOL_PARSER, parser]


def _tool_parser_for(dep: Deployment, model: str) -> str | None:
    """The parser for ``model``: by family name, else by its tokenizer (Hermes-style ``<tool_call>`` tokens, or
    pythonic, which needs no special tokens, e.g. pdctl's tiny model); None when neither is known."""
    from pdctl.gateway.tokens import find_tokenizer

    name = model.lower()
    if found := next((parser for family, parser in _TOOL_PARSERS if family in name), None):
        return found
    tokenizer = find_tokenizer(dep.resolve_path(model) if is_local(model) else model)
    if tokenizer is None:
        return None
    return "hermes" if "<tool_call>" in tokenizer.read_text(encoding="utf-8", errors="replace") else "pythonic"


def tools(c: Ctx) -> Iterable[Finding]:
    """PD032: the agent routes need vLLM's tool calling, on prefill (which renders and validates the same request)
    and on decode (which parses the calls) alike (``OnlineRenderer``'s tool_choice check, vLLM 0.32)."""
    ws = [w for w in c.dep.workers if w.engine == "vllm"]
    if not ws:
        return
    flags = {w.name: _tool_flags(w) for w in ws}
    parser = next((p for _, p in flags.values() if p), None) or _tool_parser_for(c.dep, ws[0].model)
    refusal = ("requests with tools and tool_choice \"auto\" (the default of /v1/responses and chat, and what "
               "agents send on /v1/messages) get 400 '\"auto\" tool choice requires --enable-auto-tool-choice and "
               "--tool-call-parser to be set'")  # fmt: skip
    docs = (f"add {_AUTO_TOOLS} {_TOOL_PARSER} NAME to every worker's extra_args, with the parser of "
            f"{ws[0].model}'s family from vLLM's tool-calling docs")  # fmt: skip
    if any(on or p for on, p in flags.values()):
        for w in ws:
            on, has = flags[w.name]
            if (on, has) == (True, parser):
                continue
            now = ("tool calling off" if not (on or has) else f"{_AUTO_TOOLS} without {_TOOL_PARSER}"
                   if not has else f"{_TOOL_PARSER} {has} without {_AUTO_TOOLS}" if not on
                   else f"{_TOOL_PARSER} {has}")  # fmt: skip
            want = f"{_AUTO_TOOLS} {_TOOL_PARSER} {parser or 'NAME'}"
            yield c.at("PD032", "warning", "config", f"{w.table}.extra_args",
                       f"{w.name} has {now}, but tool calling needs {want} on every worker, prefill and decode "
                       f"alike: otherwise agents' {refusal} on one leg", None if parser else docs,
                       fixes=({f"{w.table}.extra_args": _with_tools(w, parser)},) if parser else ())  # fmt: skip
        return
    yield c.at("PD032", "info", "config", f"{ws[0].table}.extra_args",
               f"the gateway serves the agent routes (/v1/responses, /v1/messages), but without vLLM's tool calling "
               f"{refusal}", None if parser else docs,
               fixes=({f"{w.table}.extra_args": _with_tools(w, parser) for w in ws},) if parser else ())  # fmt: skip
