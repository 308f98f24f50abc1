"""Run planned vLLM command lines through vLLM's own parser and config classes (``check``; no GPU, no weights).

Two halves in one file:

* :func:`validate_commands` (pdctl side) sends each worker's flags as JSON to a child interpreter that runs
  this very file as a script, and reads back one :class:`Refusal` per command line vLLM would refuse.
* :func:`_main` (child side, stdlib and vLLM only, so it runs in whichever environment holds vLLM) does what
  ``vllm serve`` does before it touches a model: ``make_arg_parser(FlexibleArgumentParser())``,
  ``parse_args``, ``validate_parsed_serve_args``, ``AsyncEngineArgs.from_cli_args`` (which builds and
  validates ``KVTransferConfig`` and the other config objects given as flags), then ``SchedulerConfig`` with
  the model's context length pdctl found, which raises what ``SchedulerConfig.verify_max_model_len`` raises at
  start.

A child process keeps vLLM's import side effects (logging set-up, platform detection, ~5 s of imports) out of
pdctl and lets the check use the interpreter that will launch vLLM.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Command", "Refusal", "validate_commands"]

_TIMEOUT_S = 120.0
# Runs this file as __main__ without the current directory on sys.path (`python FILE` would put pdctl/ itself
# there, and its config.py, errors.py, ... would shadow other top-level modules of the same name).
_RUN_AS_SCRIPT = (
    "import runpy, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
    "runpy.run_path({path!r}, run_name='__main__')"
)


@dataclass(frozen=True, slots=True)
class Command:
    """One worker's vLLM flags (argv after the launch form) and the model's context length, if known."""

    worker: str
    args: tuple[str, ...]
    context_len: int | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """vLLM's refusal of one command line: the worker, the flag it names (if any) and vLLM's message."""

    worker: str
    flag: str | None
    message: str


class ValidatorUnavailable(Exception):
    """The child interpreter could not run the check (vLLM missing or broken there); the reason is the message."""


def validate_commands(
    commands: Sequence[Command], python: str | None = None, timeout_s: float = _TIMEOUT_S
) -> list[Refusal]:
    """What vLLM refuses among ``commands``, checked by ``python`` (default: this interpreter).

    Raises :class:`ValidatorUnavailable` when vLLM cannot be imported there or the child fails otherwise.
    """
    payload = json.dumps([{"worker": c.worker, "args": list(c.args), "context_len": c.context_len} for c in commands])
    try:
        done = subprocess.run(
            [python or sys.executable, "-c", _RUN_AS_SCRIPT.format(path=str(Path(__file__).resolve()))],
            input=payload, capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValidatorUnavailable(f"vLLM's parser did not answer: {exc}") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValidatorUnavailable(f"vLLM's parser could not run: {tail}")
    try:
        result = json.loads(lines[-1])
        if "unavailable" in result:
            raise ValidatorUnavailable(str(result["unavailable"]))
        return [Refusal(str(r["worker"]), r.get("flag"), str(r["message"])) for r in result["refusals"]]
    except (ValueError, TypeError, KeyError) as exc:
        # Not pdctl's child script answering: a wrapper or another program stands in for the engine's python.
        raise ValidatorUnavailable(
            f"vLLM's parser gave an answer pdctl cannot read ({exc!r}): {lines[-1][:200]}"
        ) from None


# ------------------------------------------------------------------------------------ child side

_FLAG = re.compile(r"(--[a-z0-9][a-z0-9-]*)")
# Scheduler errors name fields, not flags.
_FIELD_FLAGS = (
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("max_num_seqs", "--max-num-seqs"),
    ("max_model_len", "--max-model-len"),
)


def _flag_of(message: str) -> str | None:
    if m := _FLAG.search(message):
        return m.group(1)
    for field, flag in _FIELD_FLAGS:
        if field in message:
            return flag
    return None


#: Where ``make_arg_parser`` and ``validate_parsed_serve_args`` live, newest vLLM first: 0.33 moved them to
#: ``entrypoints.common``, 0.32 has them in ``entrypoints.launchers``, earlier versions in ``entrypoints.openai``.
_CLI_ARGS_MODULES = (
    "vllm.entrypoints.common.cli_args",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.openai.cli_args",
)


def _cli_args() -> Any:
    """vLLM's ``cli_args`` module, wherever this version keeps it (ImportError naming every place tried)."""
    import importlib

    for name in _CLI_ARGS_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise  # the module exists but one of its own imports is missing: that is the error to report
            continue
        if hasattr(module, "make_arg_parser") and hasattr(module, "validate_parsed_serve_args"):
            return module
    raise ImportError(f"no vLLM argument parser in {', '.join(_CLI_ARGS_MODULES)}")


def _check_one(parser: Any, cmd: dict[str, Any]) -> str | None:
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    validate_parsed_serve_args = _cli_args().validate_parsed_serve_args

    try:
        args = parser.parse_args(cmd["args"])
        validate_parsed_serve_args(args)
        engine = AsyncEngineArgs.from_cli_args(args)
        max_len = engine.max_model_len or cmd["context_len"]
        if max_len is not None and engine.max_num_batched_tokens is not None:
            chunked = True if engine.enable_chunked_prefill is None else bool(engine.enable_chunked_prefill)
            SchedulerConfig(
                max_model_len=max_len,
                is_encoder_decoder=False,
                max_num_batched_tokens=engine.max_num_batched_tokens,
                # Without the flag vLLM picks a per-device default: only a given value can be checked.
                max_num_seqs=engine.max_num_seqs or 1,
                enable_chunked_prefill=chunked,
            )
    except Exception as exc:  # argparse (_ParseError), ValueError, TypeError, pydantic's ValidationError...
        return _tidy(str(exc)) or type(exc).__name__
    return None


def _tidy(message: str) -> str:
    """One line, without pydantic's ``[type=...]`` trailer and documentation link."""
    text = " ".join(message.split())
    text = re.sub(r"\s*\[type=[^\]]*\]", "", text)
    return re.sub(r"\s*For further information visit \S+", "", text).strip()


class _ParseError(Exception):
    pass


def _main() -> int:
    commands = json.loads(sys.stdin.read())
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        make_arg_parser = _cli_args().make_arg_parser
    except Exception as exc:
        print(json.dumps({"unavailable": f"vLLM is not importable by {sys.executable}: {exc}"}))
        return 0

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:
            raise _ParseError(message)

    parser = make_arg_parser(Parser(prog="vllm serve"))  # type: ignore[no-untyped-call]
    refusals = []
    for cmd in commands:
        message = _check_one(parser, cmd)
        if message is not None:
            refusals.append({"worker": cmd["worker"], "flag": _flag_of(message), "message": message})
    print(json.dumps({"refusals": refusals}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
