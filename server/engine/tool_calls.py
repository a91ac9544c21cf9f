"""Tool calls read out of replies by vLLM's tool parsers (vLLM glue, API process).

A model writes its calls in its own format (Qwen2.5's hermes style:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`); `--tool-call-parser`
names the vLLM parser that reads it. This module wraps one parser instance per
choice behind the engine contract's `ToolCallParser`: `parse` for a finished
reply, `feed` for the text a stream may send before any call (the parser holds
back what could start one).
"""

from typing import Any

from server.engine.contract import ParsedReply


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

    def feed(self, text: str, token_ids: list[int]) -> str:
        previous_text, previous_ids = self._text, self._token_ids
        self._text += text
        self._token_ids = [*previous_ids, *token_ids]
        # The parser's own call deltas are not used: calls go out whole, once parsed.
        message = self._parser.extract_tool_calls_streaming(
            previous_text, self._text, text, previous_ids, self._token_ids, token_ids, None
        )
        return (message.content or "") if message is not None else ""
