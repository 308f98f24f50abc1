"""The gateway's JSON codec for worker and upstream bodies (pdctl.gateway.codec): the same values as the standard
library's, whatever the body holds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.gateway import codec


def _values(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(10**40), max_value=10**40)
        | st.floats(allow_nan=False, allow_infinity=False)
        | text,
        lambda children: st.lists(children, max_size=5) | st.dictionaries(text, children, max_size=5),
        max_leaves=30,
    )


@settings(max_examples=300, deadline=None)
@given(_values(st.text()))  # lone surrogates included: msgspec cannot write them, json can
def test_what_it_writes_reads_back_as_the_same_value(value: Any) -> None:
    assert json.loads(codec.encode(value)) == value


@settings(max_examples=300, deadline=None)
@given(_values(st.text(st.characters(blacklist_categories=("Cs",)))))
def test_it_reads_what_it_writes(value: Any) -> None:
    assert codec.decode(codec.encode(value)) == value


def test_compact_utf8_and_the_standard_librarys_form_only_where_msgspec_cannot() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "用一句话解释 KV Cache"}], "temperature": 1e-7}
    assert codec.encode(body) == (
        '{"model":"tiny","messages":[{"role":"user","content":"用一句话解释 KV Cache"}],"temperature":1e-7}'.encode()
    )
    lone = {"content": "a\ud800b"}  # a client may send "\ud800": json reads it as a lone surrogate
    assert codec.encode(lone) == b'{"content":"a\\ud800b"}'
    assert codec.encode({"seed": 10**30}) == b'{"seed":1000000000000000000000000000000}'


@pytest.mark.parametrize("data", [b"", b"{", b'{"a": NaN}', b"1e999", b"\xff"])
def test_a_reply_that_is_not_json_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        codec.decode(data)
