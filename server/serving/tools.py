"""Tool calling, shared by chat completions and the Responses API: what a request's
tools add to the prompt and to the grammar, and how each choice's reply becomes
calls, whole or streamed.

- `auto`: the tools go through the chat template and the model decides; the
  engine's tool call parser (the model's own format, e.g. hermes `<tool_call>`)
  reads calls out of the reply.
- A named function: a grammar holds the reply to that function's arguments
  schema, so the arguments always parse; the reply is the arguments.
- `required`: a grammar holds the reply to a JSON array of
  `{"name": ..., "parameters": {...}}` over the offered tools (one item when
  parallel calls are off).
- `none` (or no tools): a plain reply; the tools are not shown to the model.
"""

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from server.engine.contract import Engine, JsonFormat, ParsedReply, ToolCallParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Function:
    """One function tool, as both APIs describe it."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def template_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or ANY_OBJECT
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["parse", "named", "required"]
    functions: list[Function]
    parallel: bool
    named: str | None = None

    def template_tools(self) -> list[dict[str, Any]]:
        return [function.template_dict() for function in self.functions]

    def grammar(self) -> JsonFormat | None:
        if self.mode == "named":
            chosen = next(f for f in self.functions if f.name == self.named)
            return JsonFormat(chosen.parameters or ANY_OBJECT, param="tools")
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [f.name]},
                        "parameters": f.parameters or ANY_OBJECT,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for f in self.functions
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return JsonFormat(schema, param="tools")
        return None


def plan(
    functions: list[Function], choice: str | None, named: str | None, parallel: bool
) -> ToolPlan | None:
    """What the request's tools ask for; None for a plain reply. `choice` is
    none/auto/required (None: auto), `named` a function tool_choice names."""
    if not functions or (choice == "none" and named is None):
        return None
    if named is not None:
        return ToolPlan("named", functions, parallel, named)
    return ToolPlan("required" if choice == "required" else "parse", functions, parallel)


@dataclass(frozen=True)
class ToolCallFragment:
    """Part of a streamed call: the call's place among the reply's calls, its name
    the first time it appears, then pieces of its JSON arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _required_calls(text: str) -> ParsedReply:
    try:
        items = json.loads(text)
        calls = [(item["name"], json.dumps(item["parameters"])) for item in items]
    except (ValueError, TypeError, KeyError):  # cut off by max_tokens or a stop string
        return ParsedReply(text or None, [])
    return ParsedReply(None, calls)


def parse_reply(engine: Engine, tool_plan: ToolPlan | None, text: str) -> ParsedReply:
    """A whole reply's text and calls; without tools, all text."""
    if tool_plan is None:
        return ParsedReply(text, [])
    return ReplyCalls.start(engine, tool_plan).parse(text)


@dataclass
class ReplyCalls:
    """One choice's calls: `parse` for a whole reply; for a stream, `feed` each delta,
    then `close` with the whole text for the rest.

    A named function's arguments stream as they come: the grammar makes them valid.
    Calls a parser reads (`auto`) or the `required` list go out whole at `close`,
    taken from `parse`: a call cut off by max_tokens or written as broken JSON is
    no call in the whole reply, so it must not have been streamed as one. The
    text before the calls streams as it comes."""

    plan: ToolPlan
    parser: ToolCallParser | None
    _content_sent: str = ""
    _named_started: bool = False

    @classmethod
    def start(cls, engine: Engine, tool_plan: ToolPlan) -> "ReplyCalls":
        parser = engine.tool_call_parser() if tool_plan.mode == "parse" else None
        return cls(tool_plan, parser)

    def parse(self, text: str) -> ParsedReply:
        if self.plan.mode == "named":
            assert self.plan.named is not None
            return ParsedReply(None, [(self.plan.named, text)])
        if self.plan.mode == "required":
            return _required_calls(text)
        assert self.parser is not None
        parsed = self.parser.parse(text)
        return parsed if self.plan.parallel else ParsedReply(parsed.content, parsed.calls[:1])

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, list[ToolCallFragment]]:
        if self.plan.mode == "named":
            name = None if self._named_started else self.plan.named
            self._named_started = True
            return "", [ToolCallFragment(0, name, text)]
        if self.plan.mode == "required":
            return "", []
        assert self.parser is not None
        content = self.parser.feed(text, token_ids)
        self._content_sent += content
        return content, []

    def close(self, text: str) -> tuple[str, list[ToolCallFragment], ParsedReply]:
        """What the stream still owes after the last delta, and the whole reply."""
        parsed = self.parse(text)
        if self.plan.mode == "named":
            fragments = [] if self._named_started else [ToolCallFragment(0, self.plan.named, text)]
            return "", fragments, parsed
        content = ""
        if not parsed.calls and text.startswith(self._content_sent):
            content = text[len(self._content_sent) :]  # what the parser held back
        calls = [
            ToolCallFragment(i, name, arguments) for i, (name, arguments) in enumerate(parsed.calls)
        ]
        return content, calls, parsed
