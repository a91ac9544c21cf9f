"""A streamed text chunk rendered from its per-request template says what the
pydantic chunk says, whatever the text holds."""

import json

import pytest

from server.protocol.chat import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from server.protocol.completions import CompletionChoice, CompletionResponse
from server.serving.common import TextEvent, sse

TEXTS = [
    "",
    "plain",
    ' "quoted" and \\back\\slashed',
    "line\nbreak\ttab\r\x00\x1f\x7f",
    "é, 中文, 🙂, \u2028\u2029",
    TextEvent.MARKER,
    "@@specserve",
]


def _data(event: str) -> object:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event.removeprefix("data: "))


def _chat(content: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id="chatcmpl-1",
        created=1,
        model="m",
        choices=[ChatChunkChoice(index=2, delta=ChatDelta(content=content))],
    )


def _completion(text: str) -> CompletionResponse:
    return CompletionResponse(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=3, text=text)]
    )


@pytest.mark.parametrize("text", TEXTS)
def test_a_chat_text_event_says_what_the_pydantic_chunk_says(text: str) -> None:
    event = TextEvent(_chat(TextEvent.MARKER))
    assert _data(event.render(text)) == _data(sse(_chat(text)))


@pytest.mark.parametrize("text", TEXTS)
def test_a_completion_text_event_says_what_the_pydantic_chunk_says(text: str) -> None:
    event = TextEvent(_completion(TextEvent.MARKER))
    assert _data(event.render(text)) == _data(sse(_completion(text)))


def test_a_payload_without_the_marker_is_refused() -> None:
    with pytest.raises(ValueError, match="MARKER"):
        TextEvent(_chat("no marker"))
