"""One request through the real client code, over a scripted HTTP transport.

The transport streams chunks and moves a fake clock between them, so the
timeline the client records is known exactly.
"""

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from loadtest.client import send
from loadtest.records import RequestRecord
from loadtest.workloads import WorkItem

CHAT = WorkItem("chat-0", "chat", messages=(("user", "hi"),))
COMPLETION = WorkItem("code-0", "completions", prompt="def f():")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TimedStream(httpx.AsyncByteStream):
    """Yields (delay, bytes) pairs: the clock advances by delay before each read."""

    def __init__(self, clock: Clock, parts: list[tuple[float, bytes]]) -> None:
        self.clock, self.parts = clock, parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for delay, data in self.parts:
            self.clock.now += delay
            yield data


def sse(data: object) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def chat_chunk(content: str | None = None, role: str | None = None) -> bytes:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return sse({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


async def run(
    item: WorkItem, response: httpx.Response | Exception, clock: Clock, stream: bool = True
) -> RequestRecord:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(response, Exception):
            raise response
        return response

    transport = httpx.MockTransport(handler)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        record = RequestRecord(index=0, item=item.id, server="s")
        payload = item.payload("m", 16, 0.0, stream)
        return await send(client, item, payload, record, clock)


async def test_chat_stream_timeline() -> None:
    clock = Clock()
    parts = [
        (0.01, chat_chunk(role="assistant", content="")),  # role first: not a token
        (0.49, chat_chunk("Hel")),  # first text 0.5 s after sending
        (0.2, chat_chunk("lo") + chat_chunk(" wor")),  # two events in one read
        (0.3, chat_chunk("ld")),
        (0.0, sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})),
        (0.05, sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}})),
        (0.0, b"data: [DONE]\n\n"),
    ]
    record = await run(CHAT, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert record.success and record.error is None
    assert record.ttft == pytest.approx(0.5)
    assert record.itl == pytest.approx([0.2, 0.0, 0.3])
    assert record.e2el == pytest.approx(1.0)  # last text chunk, not the usage chunk
    assert record.output_tokens == 6 and record.output_tokens_source == "usage"
    assert record.prompt_tokens == 9
    assert record.tpot == pytest.approx(0.5 / 5)
    assert record.text == "Hello world"


async def test_completion_stream_without_usage_counts_chunks() -> None:
    clock = Clock()
    chunks = [sse({"choices": [{"index": 0, "text": t}]}) for t in ("a", "b", "c")]
    parts = [(0.1, chunks[0]), (0.1, chunks[1]), (0.1, chunks[2]), (0.0, b"data: [DONE]\n\n")]
    record = await run(COMPLETION, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert record.success
    assert record.output_tokens == 3 and record.output_tokens_source == "chunks"
    assert record.ttft == pytest.approx(0.1) and record.e2el == pytest.approx(0.3)


async def test_speculation_summary_is_kept() -> None:
    clock = Clock()
    summary = {"applied": True, "accepted_tokens": 3, "draft_tokens": 4}
    parts = [
        (0.1, chat_chunk("x")),
        (0.0, sse({"choices": [], "usage": {"completion_tokens": 1}, "speculation": summary})),
        (0.0, b"data: [DONE]\n\n"),
    ]
    record = await run(CHAT, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert record.speculation == summary


@pytest.mark.parametrize("status", [429, 503])
async def test_refusals_are_failures_with_their_status(status: int) -> None:
    body = {"error": {"message": "server busy", "type": "x", "param": None, "code": None}}
    response = httpx.Response(status, json=body, headers={"Retry-After": "1"})
    record = await run(CHAT, response, Clock())
    assert not record.success
    assert record.status == status
    assert record.error == f"HTTP {status}: server busy"


async def test_error_event_inside_a_200_stream_is_a_failure() -> None:
    clock = Clock()
    parts = [
        (0.1, chat_chunk("x")),
        (0.1, sse({"error": {"message": "engine died"}})),
        (0.0, b"data: [DONE]\n\n"),
    ]
    record = await run(CHAT, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert not record.success and record.status == 200
    assert record.error is not None and "engine died" in record.error


async def test_stream_cut_before_done_is_a_failure() -> None:
    clock = Clock()
    parts = [(0.1, chat_chunk("x")), (0.1, chat_chunk("y"))]
    record = await run(CHAT, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert not record.success
    assert record.error is not None and "[DONE]" in record.error


async def test_stream_without_text_or_an_end_is_a_failure() -> None:
    clock = Clock()
    parts = [(0.1, chat_chunk(role="assistant", content="")), (0.0, b"data: [DONE]\n\n")]
    record = await run(CHAT, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert not record.success


async def test_an_empty_reply_that_ends_is_timed_without_a_first_token() -> None:
    """The model's first token was its end: a reply, not a failure, with no TTFT."""
    clock = Clock()
    end = sse({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]})
    usage = sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})
    parts = [
        (0.1, chat_chunk(role="assistant", content="")),
        (0.2, end),
        (0.0, usage),
        (0.0, b"data: [DONE]\n\n"),
    ]
    record = await run(CHAT, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert record.success and record.ttft is None and record.tpot is None
    assert record.e2el == pytest.approx(0.3)
    assert (record.output_tokens, record.text) == (1, "")


async def test_bad_json_chunk_is_a_failure() -> None:
    clock = Clock()
    parts = [(0.1, b"data: {not json\n\n"), (0.0, b"data: [DONE]\n\n")]
    record = await run(CHAT, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert not record.success and record.error is not None


async def test_connection_error_has_no_status() -> None:
    record = await run(CHAT, httpx.ConnectError("refused"), Clock())
    assert not record.success and record.status is None
    assert record.error is not None and "ConnectError" in record.error


async def test_whole_response_ttft_is_e2el() -> None:
    clock = Clock()

    class Slow(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            clock.now += 2.0
            yield json.dumps(
                {
                    "choices": [{"index": 0, "message": {"content": "hi"}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 5},
                }
            ).encode()

    record = await run(CHAT, httpx.Response(200, stream=Slow()), clock, stream=False)
    assert record.success
    assert record.ttft == record.e2el == pytest.approx(2.0)
    assert record.output_tokens == 5 and record.text == "hi"


CALL = {"name": "read_file", "arguments": '{"path": "loadtest/sse.py"}'}


async def test_a_stream_of_tool_calls_only_times_the_calls() -> None:
    """specserve sends a parsed call whole once the reply ends: its text is the name and the
    arguments, and the first token is seen with the last."""
    clock = Clock()
    call = {"index": 0, "id": "call_1", "type": "function", "function": CALL}
    parts = [
        (0.01, chat_chunk(role="assistant", content="")),
        (0.99, sse({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})),
        (0.0, sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 14}})),
        (0.0, b"data: [DONE]\n\n"),
    ]
    record = await run(CHAT, httpx.Response(200, stream=TimedStream(clock, parts)), clock)
    assert record.success and record.output_tokens == 14
    assert record.ttft == record.e2el == pytest.approx(1.0)
    assert record.text == 'read_file{"path": "loadtest/sse.py"}'


async def test_a_whole_reply_of_tool_calls_has_their_text() -> None:
    message = {"content": None, "tool_calls": [{"id": "c", "type": "function", "function": CALL}]}
    body = {"choices": [{"index": 0, "message": message}], "usage": {"completion_tokens": 14}}
    record = await run(CHAT, httpx.Response(200, json=body), Clock(), stream=False)
    assert record.success and record.text == 'read_file{"path": "loadtest/sse.py"}'
