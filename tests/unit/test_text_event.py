"""A streamed text chunk rendered from its choice's template says what the
pydantic chunk says, whatever the text holds."""

import json
from collections.abc import Callable

import pytest
from pydantic import BaseModel

from server.protocol.chat import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from server.protocol.completions import CompletionChoice, CompletionResponse
from server.serving.sse import (
    TextEvents,
    sse,
)

TEXTS = [
    "",
    "plain",
    ' "quoted" and \\back\\slashed',
    "line\nbreak\ttab\r\x00\x1f\x7f",
    "é, 中文, 🙂, \u2028\u2029",
    TextEvents.MARKER,
    "@@specserve",
]


def _data(event: str) -> object:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event.removeprefix("data: "))


def _chat(index: int, content: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id="chatcmpl-1",
        created=1,
        model="m",
        choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=content))],
    )


def _completion(index: int, text: str) -> CompletionResponse:
    return CompletionResponse(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=index, text=text)]
    )


@pytest.mark.parametrize("payload", [_chat, _completion])
@pytest.mark.parametrize("text", TEXTS)
def test_a_text_chunk_says_what_the_pydantic_chunk_says(
    payload: Callable[[int, str], BaseModel], text: str
) -> None:
    chunks = TextEvents(payload)
    for index in (0, 2, 0):  # each choice's own template, reused
        assert _data(chunks.render(index, text)) == _data(sse(payload(index, text)))


def test_a_payload_without_the_marker_is_refused() -> None:
    chunks = TextEvents(lambda index, text: _chat(index, "no marker"))
    with pytest.raises(ValueError, match="MARKER"):
        chunks.render(0, "text")
