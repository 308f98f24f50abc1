"""Write tests/fixtures/vllm-033/ from vLLM 0.33.0's own code (no engine, no GPU): run with 0.33's sources first on
``PYTHONPATH``.

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        vllm==0.33.0 -d /tmp/vllm033
    unzip -q -o /tmp/vllm033/vllm-0.33.0-*.whl 'vllm/*' -d /tmp/vllm033/src
    PYTHONPATH=/tmp/vllm033/src:$PWD .venv/bin/python -m benchmarks.vllm033_fixtures --out tests/fixtures/vllm-033

What it writes, each from the 0.33 module named:

* ``responses-incomplete.sse``: the event stream of a Responses request cut by ``max_output_tokens`` (3 tokens), as
  ``OpenAIServingResponses.responses_stream_generator`` builds it on the plain-text path: ``ResponsesResponse.from_request``
  for the opening and closing responses, the ``emit_simple_content_*`` events of
  ``vllm/entrypoints/openai/responses/streaming_events.py``, the terminal ``ResponseIncompleteEvent`` chosen as
  serving.py does for a ``status == "incomplete"`` response, sequence numbers as its
  ``_increment_sequence_number_and_return``, and the SSE framing of ``api_router._convert_stream_to_sse_events``.
* ``kv-events-lookahead.msgpack``: one ``KVEventBatch`` payload of ``vllm/distributed/kv_events.py``, encoded with
  ``msgspec.msgpack.Encoder`` as its ``ZmqEventPublisher`` does, holding a ``BlockStored`` with
  ``lookahead_token_ids`` and a ``BlockRemoved``.
* ``log-lines.txt``: the log lines pdctl classifies that 0.33 prints, each rendered with vLLM's own logging
  formatter from the format string and arguments of the call named beside it, and the message of the
  ``RuntimeError`` that ``vllm.distributed.nixl_utils.check_nixl_version`` raises.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Any


def _mod(name: str) -> Any:
    return importlib.import_module(name)


def _require_033() -> None:
    version = _mod("vllm._version").__version__
    if not str(version).startswith("0.33."):
        sys.exit(f"vllm {version} imported from {_mod('vllm').__file__}: put 0.33's sources first on PYTHONPATH")


def _function_from_source(path: str, name: str) -> Any:
    """One top-level function of a 0.33 source file, compiled alone (its annotations are not evaluated)."""
    import ast

    tree = ast.parse((Path(_mod("vllm").__file__).parent / path).read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]
    scope: dict[str, Any] = {}
    exec(compile(ast.Module([node], []), path, "exec"), {"__builtins__": __builtins__, "AsyncGenerator": Any}, scope)
    return scope[name]


def responses_incomplete() -> str:
    """The SSE body of a Responses stream cut after 3 tokens."""
    proto = _mod("vllm.entrypoints.openai.responses.protocol")
    ev = _mod("vllm.entrypoints.openai.responses.streaming_events")
    # api_router itself imports the whole server (orjson, fastapi...): its framing function is taken from its source.
    convert = _function_from_source("entrypoints/openai/responses/api_router.py", "_convert_stream_to_sse_events")
    sampling = _mod("vllm.sampling_params")
    events_mod = _mod("openai.types.responses")

    request = proto.ResponsesRequest(
        model="tiny", input="explain prefill", max_output_tokens=3, stream=True, request_id="resp_fixture0001"
    )
    params = sampling.SamplingParams(max_tokens=3)
    created = 1764936000
    seq = 0

    def numbered(event: Any) -> Any:
        nonlocal seq
        if hasattr(event, "sequence_number"):
            event.sequence_number = seq
        seq += 1
        return event

    start = proto.ResponsesResponse.from_request(
        request, params, model_name="tiny", created_time=created, output=[], status="in_progress", usage=None
    ).model_dump(mode="json", by_alias=True)
    out = [
        numbered(events_mod.ResponseCreatedEvent(type="response.created", sequence_number=-1, response=start)),
        numbered(events_mod.ResponseInProgressEvent(type="response.in_progress", sequence_number=-1, response=start)),
    ]
    state = ev.SimpleStreamingState()
    out += [numbered(e) for e in ev.emit_simple_content_open(state)]
    for piece in ("Prefill", " reads", " the"):
        out += [numbered(e) for e in ev.emit_simple_content_delta(state, piece)]
    status = _mod("vllm.entrypoints.openai.responses.utils").response_item_status("length")
    done = ev.emit_simple_content_done(state, status)
    out += [numbered(e) for e in done]
    # As serving.py builds it for one turn of 4 prompt tokens (none cached) and 3 generated.
    usage = proto.ResponseUsage(
        input_tokens=4, output_tokens=3, total_tokens=7,
        input_tokens_details=proto.InputTokensDetails(cache_write_tokens=0, cached_tokens=0, input_tokens_per_turn=[4],
                                                      cached_tokens_per_turn=[0]),
        output_tokens_details=proto.OutputTokensDetails(reasoning_tokens=0, tool_output_tokens=0,
                                                        output_tokens_per_turn=[3], tool_output_tokens_per_turn=[0]),
    )  # fmt: skip
    final = proto.ResponsesResponse.from_request(
        request, params, model_name="tiny", created_time=created, output=[done[-1].item], status="incomplete",
        usage=usage,
    )  # fmt: skip
    assert final.status == "incomplete"  # serving.py's choice of the terminal event
    out.append(numbered(proto.ResponseIncompleteEvent(type="response.incomplete", sequence_number=-1, response=final)))

    async def collect() -> str:
        async def gen() -> Any:
            for e in out:
                yield e

        return "".join([s async for s in convert(gen())])

    import asyncio

    return asyncio.run(collect())


def kv_batch() -> bytes:
    """One encoded batch with ``lookahead_token_ids``."""
    import msgspec

    kv = _mod("vllm.distributed.kv_events")
    stored = kv.BlockStored(
        block_hashes=[1111, 2222], parent_block_hash=None, token_ids=list(range(8)), block_size=4, lora_id=None,
        medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention",
        lookahead_token_ids=[[4, 5], [8, 9]],
    )  # fmt: skip
    removed = kv.BlockRemoved(block_hashes=[999], medium="GPU", group_idx=0)
    batch = kv.KVEventBatch(ts=1764936000.5, events=[stored, removed], data_parallel_rank=0)
    encoded: bytes = msgspec.msgpack.Encoder().encode(batch)
    return encoded


#: (logger's file:line in 0.33, level, format string, args) for each line; the strings are copied from the call.
_LOG_CALLS: tuple[tuple[str, int, str, tuple[Any, ...]], ...] = (
    ("scheduler.py:3773", logging.WARNING,
     "Recovered from KV load failure: %d request(s) rescheduled (%d tokens affected).", (2, 384)),
    ("scheduler.py:3764", logging.ERROR,
     "Failing %d request(s) due to KV load failure (failure_policy=fail, %d tokens affected). Request IDs: %s",
     (1, 128, {"cmpl-abc-0-1234abcd"})),
    ("base_worker.py:2351", logging.WARNING,
     "Not pairing remote %d-token blocks with local %d-token blocks: their %d-token common unit would split each "
     "block into more than %d transfers.", (528, 16, 16, 32)),
    ("base_worker.py:2366", logging.WARNING,
     "Not pairing remote %d-token blocks with local %d-token blocks: the remote KV layout cannot be split into "
     "%d-token units.", (48, 32, 16)),
)  # fmt: skip


def _source_has(path: str, text: str) -> bool:
    """Whether a 0.33 source file holds ``text`` (whitespace and string-literal joins ignored)."""
    source = (Path(_mod("vllm").__file__).parent / path).read_text()
    flat = "".join(part for line in source.splitlines() for part in [line.strip().strip('"')])
    return text.replace(" ", "") in flat.replace(" ", "")


def log_lines() -> str:
    """vLLM's formatter over each logging call, then the NIXL version refusal."""
    logger_mod = _mod("vllm.logger")
    fmt = _mod("vllm.logging_utils").NewLineFormatter(logger_mod._FORMAT, datefmt=logger_mod._DATE_FORMAT)
    files = {"scheduler.py": "v1/core/sched/scheduler.py",
             "base_worker.py": "distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"}  # fmt: skip
    lines = []
    for where, level, template, args in _LOG_CALLS:
        name, lineno = where.split(":")
        if not _source_has(files[name], template.split("%")[0].strip()):
            sys.exit(f"{template!r} is not in 0.33's {files[name]}")
        record = logging.LogRecord("vllm", level, files[name], int(lineno), template, args, None)
        record.vllm_process_name = "EngineCore"
        record.process = 4242
        record.created = 1764936000.0
        record.msecs = 0.0
        lines.append(fmt.format(record))
    nixl = _mod("vllm.distributed.nixl_utils")
    try:
        nixl.check_nixl_version.__wrapped__("99.0.0")
    except RuntimeError as exc:
        lines.append(f"RuntimeError: {exc}")
    else:
        sys.exit("check_nixl_version('99.0.0') did not refuse: is a nixl package installed here?")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    _require_033()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "responses-incomplete.sse").write_text(responses_incomplete())
    (args.out / "kv-events-lookahead.msgpack").write_bytes(kv_batch())
    (args.out / "log-lines.txt").write_text(log_lines())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
