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
from dataclasses import dataclass, field
from typing import Any, Literal

from server.engine.base import Engine, JsonFormat, ParsedReply, ToolCallFragment, ToolCallParser

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
            return JsonFormat(chosen.parameters or ANY_OBJECT)
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
            return JsonFormat(schema)
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _required_calls(text: str) -> ParsedReply:
    try:
        items = json.loads(text)
        calls = [(item["name"], json.dumps(item["parameters"])) for item in items]
    except (ValueError, TypeError, KeyError):  # cut off by max_tokens or a stop string
        return ParsedReply(text or None, [])
    return ParsedReply(None, calls)


@dataclass
class ReplyCalls:
    """One choice's calls: `parse` for a whole reply; `feed` each streamed delta,
    then `close` with the whole text for what the stream still owes."""

    plan: ToolPlan
    parser: ToolCallParser | None
    _names_sent: set[int] = field(default_factory=set)
    _arguments_sent: dict[int, str] = field(default_factory=dict)
    _content_sent: str = ""

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
            assert self.plan.named is not None
            return "", self._sent([ToolCallFragment(0, self.plan.named, text)])
        if self.plan.mode == "required":
            return "", []  # the array is read whole at the end
        assert self.parser is not None
        content, fragments = self.parser.feed(text, token_ids)
        self._content_sent += content
        if not self.plan.parallel:
            fragments = [f for f in fragments if f.index == 0]
        return content, self._sent(fragments)

    def close(self, text: str) -> tuple[str, list[ToolCallFragment], ParsedReply]:
        """What the stream still owes after the last delta, so that the streamed
        pieces add up to `parse(text)` (a parser may hold back a partial tag)."""
        parsed = self.parse(text)
        content = ""
        if not parsed.calls and text.startswith(self._content_sent):
            content = text[len(self._content_sent) :]
        fragments = []
        for index, (name, arguments) in enumerate(parsed.calls):
            sent = self._arguments_sent.get(index, "")
            rest = arguments[len(sent) :] if arguments.startswith(sent) else ""
            if index not in self._names_sent or rest:
                fragments.append(ToolCallFragment(index, name, rest))
        return content, self._sent(fragments), parsed

    def _sent(self, fragments: list[ToolCallFragment]) -> list[ToolCallFragment]:
        """Record what goes out; a call's name is sent once, with its first piece."""
        out = []
        for fragment in fragments:
            name = fragment.name if fragment.index not in self._names_sent else None
            if name is None and fragment.index not in self._names_sent:
                continue  # arguments before the name: the parser sends the name first
            self._names_sent.add(fragment.index)
            self._arguments_sent[fragment.index] = (
                self._arguments_sent.get(fragment.index, "") + fragment.arguments
            )
            if name is not None or fragment.arguments:
                out.append(ToolCallFragment(fragment.index, name, fragment.arguments))
        return out
