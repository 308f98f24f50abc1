"""pdctl.vllm.sse: the client-side SSE reading shared by bench and the N1 invariant."""

from __future__ import annotations

import pytest

from pdctl.vllm.sse import SSEParser, sse_events


def test_line_ends_cr_lf_crlf_and_a_crlf_split_across_chunks() -> None:
    body = b"data: a\r\rdata: b\n\ndata: c\r\n\r\n: ping\r\n\r\ndata: d\r\ndata: e\r\n\r\n"
    assert sse_events(body) == ["a", "b", "c", "d\ne"]
    for cut in range(len(body) + 1):
        p = SSEParser()
        assert p.feed(body[:cut]) + p.feed(body[cut:]) == ["a", "b", "c", "d\ne"], cut


def test_fields_other_than_data_and_events_without_data_are_not_dispatched() -> None:
    assert sse_events(b"event: x\nid: 3\n\ndata\n\ndata:x\ndata:  y\n\n") == ["", "x\n y"]


def test_open_event_discarded_by_sse_events_flushed_by_close() -> None:
    assert sse_events(b"data: a\n\ndata: b") == ["a"]
    assert sse_events(b"data: a\n\ndata: b\n") == ["a"]
    p = SSEParser()
    assert p.feed(b"data: a\n\ndata: b") == ["a"]
    assert p.close() == ["b"]


def test_bad_utf8_is_replaced_by_the_parser_and_an_error_for_sse_events() -> None:
    assert SSEParser().feed(b"data: \xff\n\n") == ["\ufffd"]
    with pytest.raises(UnicodeDecodeError):
        sse_events(b": \xff\n\ndata: a\n\n")
