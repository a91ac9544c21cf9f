"""Tool calls read out of replies by vLLM's tool parsers (vLLM glue).

A model writes its calls in its own format (Qwen2.5's hermes style:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`); `--tool-call-parser`
names the vLLM parser that reads it. This module wraps one parser instance per
choice behind the engine contract's `ToolCallParser`: `parse` for a finished
reply, `feed` for a stream (the parser keeps what it has sent between deltas).
"""

from typing import Any

from server.engine.base import ParsedReply, ToolCallFragment


def parser_class(name: str) -> Any:
    """vLLM's tool parser class registered under `name`; ValueError naming the known ones."""
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ValueError(f"unknown tool call parser {name!r}; vLLM knows: {known}") from None


class VllmToolCallParser:
    """One choice's tool calls, through a vLLM tool parser."""

    def __init__(self, parser_cls: Any, tokenizer: Any) -> None:
        self._parser = parser_cls(tokenizer)
        self._text = ""
        self._token_ids: list[int] = []

    def parse(self, text: str) -> ParsedReply:
        # The parsers read nothing from the request for the formats we serve.
        extracted = self._parser.extract_tool_calls(text, request=None)
        if not extracted.tools_called:
            return ParsedReply(text or None, [])
        calls = [(call.function.name, call.function.arguments) for call in extracted.tool_calls]
        return ParsedReply(extracted.content or None, calls)

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, list[ToolCallFragment]]:
        previous_text, previous_ids = self._text, self._token_ids
        self._text += text
        self._token_ids = [*previous_ids, *token_ids]
        message = self._parser.extract_tool_calls_streaming(
            previous_text, self._text, text, previous_ids, self._token_ids, token_ids, None
        )
        if message is None:
            return "", []
        fragments = [
            ToolCallFragment(
                call.index,
                call.function.name if call.function else None,
                (call.function.arguments or "") if call.function else "",
            )
            for call in message.tool_calls
        ]
        return message.content or "", fragments
