"""SSE parsing edge cases: events split anywhere across network reads."""

import pytest

from loadtest.sse import SSEParser

STREAM = (
    b'data: {"a": 1}\n\n'
    b": keep-alive ping\n\n"
    b"event: message\nid: 7\ndata: first line\ndata: second line\n\n"
    b"data:no-space\r\n\r\n"
    b'data: {"text": "caf\xc3\xa9 \xe2\x82\xac"}\r\r'
    b"data: [DONE]\n\n"
)
EXPECTED = [
    '{"a": 1}',
    "first line\nsecond line",
    "no-space",
    '{"text": "café €"}',
    "[DONE]",
]


def test_whole_stream_in_one_read() -> None:
    parser = SSEParser()
    assert parser.feed(STREAM) + parser.close() == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_split_at_every_byte(cut: int) -> None:
    # Cuts land mid-field, between CR and LF, between the two newlines that end
    # an event, and inside the multi-byte UTF-8 characters.
    parser = SSEParser()
    events = parser.feed(STREAM[:cut]) + parser.feed(STREAM[cut:]) + parser.close()
    assert events == EXPECTED


def test_one_byte_at_a_time() -> None:
    parser = SSEParser()
    events = [e for i in range(len(STREAM)) for e in parser.feed(STREAM[i : i + 1])]
    assert events + parser.close() == EXPECTED


def test_crlf_split_between_reads_is_one_line_end() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    # The LF completes the CRLF (not a blank line), so both data lines are one event.
    assert parser.feed(b"\ndata: b\r\n\r\n") == ["a\nb"]


def test_event_without_final_blank_line_counts_at_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == ["[DONE]"]


def test_comments_and_fieldless_events_yield_nothing() -> None:
    parser = SSEParser()
    assert parser.feed(b": ping\n\nevent: noop\n\nretry: 10\n\n") + parser.close() == []


def test_empty_data_field_is_an_event() -> None:
    parser = SSEParser()
    assert parser.feed(b"data:\n\n") == [""]
