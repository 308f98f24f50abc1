"""The gateway's request parsing and validation (``pdctl.gateway.request``), called directly: no server, no I/O."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdctl.gateway.errors import ApiError
from pdctl.gateway.request import (
    CHAT_PATH,
    CompletionRequest,
    check_fits,
    parse_body,
    read_model,
    route_model,
    validate,
)

COMPLETIONS = "/v1/completions"


def _error(fn: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"\xff\xfe", "not valid UTF-8 (byte 0)"),
        (b"{", "invalid JSON"),
        (b'{"a": NaN}', "NaN is not valid JSON"),
        (b'{"temperature": 1e999}', "the number 1e999 is out of range"),
        (b'{"temperature": -1.5e400}', "the number -1.5e400 is out of range"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"a": [[[[1]]]]}', "nested deeper than 4 levels"),
        (b'{"prompt": [1, 2, [[[3]]]]}', "nested deeper than 4 levels"),
        (b"[" * 100_000, "nested too deeply"),
    ],
)
def test_parse_body_refuses_with_400(raw: bytes, fragment: str) -> None:
    err = _error(parse_body, raw, 4)
    assert err.status == 400 and fragment in err.message


def test_parse_body_accepts_an_object_at_the_nesting_limit() -> None:
    assert parse_body(b'{"a": [[1]]}', 3) == {"a": [[1]]}


@pytest.mark.parametrize("body", [{}, {"model": ""}, {"model": 3}])
def test_read_model_requires_a_string(body: dict[str, Any]) -> None:
    err = _error(read_model, body)
    assert (err.status, err.param) == (400, "model")


@pytest.mark.parametrize(
    ("body", "endpoint", "param"),
    [
        ({"stream": "yes", "messages": [{}]}, CHAT_PATH, "stream"),
        ({"messages": []}, CHAT_PATH, "messages"),
        ({"prompt": ""}, COMPLETIONS, "prompt"),
        ({"prompt": {"a": 1}}, COMPLETIONS, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, COMPLETIONS, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, COMPLETIONS, "max_tokens"),
        ({"prompt": "x", "max_completion_tokens": 1.5}, COMPLETIONS, "max_completion_tokens"),
        ({"prompt": "x", "n": 65}, COMPLETIONS, "n"),
        ({"prompt": "x", "n": False}, COMPLETIONS, "n"),
    ],
)
def test_validate_names_the_bad_field(body: dict[str, Any], endpoint: str, param: str) -> None:
    err = _error(validate, body, endpoint, "m")
    assert (err.status, err.param) == (400, param)
    assert json.loads(err.body())["error"]["param"] == param


def test_validate_reads_the_fields_and_estimates_prompt_tokens() -> None:
    chat = validate({"messages": [{"role": "user", "content": "x" * 60}], "stream": True, "max_tokens": 7},
                    CHAT_PATH, "m")  # fmt: skip
    assert chat == CompletionRequest("m", True, 10, 7, chat=True, multi_prompt=False, items=1)
    batch = validate({"prompt": ["a", "b"], "max_completion_tokens": 3}, COMPLETIONS, "m")
    assert (batch.multi_prompt, batch.max_tokens, batch.prompt_tokens) == (True, 3, 1)
    ids = validate({"prompt": [1, 2, 3]}, COMPLETIONS, "m")  # token ids: one prompt, not a batch
    assert (ids.multi_prompt, ids.max_tokens) == (False, None)


def test_route_model() -> None:
    local = {"tiny": 2048}
    assert route_model("tiny", local, has_upstream=False) == "local"
    assert route_model("gpt-x", local, has_upstream=True) == "upstream"
    assert route_model("anything", {}, has_upstream=False) == "local"  # models not learnt yet: try the workers
    err = _error(route_model, "gpt-x", local, False)
    assert (err.status, err.code) == (404, "model_not_found") and "tiny" in err.message


def test_check_fits() -> None:
    batch = CompletionRequest("m", False, 1, None, chat=False, multi_prompt=True)
    assert _error(check_fits, batch, "local", True, None).param == "prompt"
    check_fits(batch, "upstream", True, None)  # the upstream takes batches
    check_fits(batch, "local", False, None)  # so does one colocated worker
    long = CompletionRequest("m", False, 100, 50, chat=True, multi_prompt=False)
    err = _error(check_fits, long, "local", True, 120)
    assert (err.code, err.param) == ("context_length_exceeded", "messages")
    assert _error(check_fits, long, "local", True, 50).param == "max_tokens"
    check_fits(long, "local", True, 150)
    check_fits(long, "local", True, None)  # unknown context length: vLLM decides
