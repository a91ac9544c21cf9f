"""Every request limit: how much one request may ask for, each limit's default and where
it applies.

Each limit is the setting of the same name (server/config.py; `max_n` is `--max-n`), so
an operator can raise it without a rebuild: the pydantic models check a body's shape and
its values' ranges when it is parsed, and `RequestLimits.check_*` checks the parsed body
against the server's limits before anything reaches the engine (serving's `within_limits`
makes a `LimitExceededError` a 400 naming the parameter). Its message names the flag that
raises the limit.

Not here, because they are OpenAI's wire format rather than bounds to tune: value ranges
(temperature, a bias's -100..100), a function or schema name's 64 characters, and the
Responses API's metadata (16 pairs, keys of 64 and values of 512 characters).
"""

import json
from dataclasses import dataclass
from typing import Any

from server.protocol.chat import ChatCompletionRequest, NamedToolChoice
from server.protocol.common import SamplingFields
from server.protocol.completions import CompletionRequest
from server.protocol.responses import (
    CreateResponseRequest,
    FunctionToolChoice,
    JsonSchemaTextFormat,
)


class LimitExceededError(ValueError):
    """A request over one of the limits; `param` names the parameter that is."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """The limits one server enforces; the defaults are `DEFAULT_LIMITS`."""

    # Choices per chat or completions request (`n`).
    max_n: int = 16
    # Alternatives per token: completions' `logprobs`, chat's `top_logprobs`.
    max_logprobs: int = 20
    max_stop_sequences: int = 4  # OpenAI's limit
    # OpenAI states none; each stop string is looked for in the new text of every step.
    max_stop_length: int = 256
    max_tools: int = 128  # OpenAI's limit
    # logit_bias entries: OpenAI's API reference states no cap; 300 is the one OpenAI is
    # reported to enforce, and plenty for banning or forcing a handful of words.
    max_logit_bias: int = 300
    # Sequences one completions request starts (its prompts times n): four full fan-outs.
    max_completion_sequences: int = 64
    # A client's JSON schema that a grammar enforces (response_format's, text.format's, the
    # parameters of the tools a required or named tool_choice holds the reply to) is
    # compiled for each request. 64 KiB is far above common schemas (a few KiB). The depth
    # counts nested objects and arrays, the schema itself the first, as vLLM measures it:
    # 32 admits OpenAI's documented 10 levels of nested objects (each two here: an object's
    # `properties`, then the property's schema) with room for anyOf, items and $defs, and
    # is half of the cap vLLM applies itself (64: the cost of converting a schema to a
    # grammar grows steeply with nesting, says its source).
    max_json_schema_bytes: int = 64 * 1024
    max_json_schema_depth: int = 32
    # The largest `minItems` or `maxItems` in such a schema. llguidance writes an array out
    # position by position up to that count before any of its own limits is checked (a
    # 62-byte schema with maxItems 3,000,000 took 8 s and 3.7 GB to be refused; 10**8
    # exhausts memory, and a failed allocation aborts the process), and minItems' positions
    # escape its grammar-size limit altogether. With --max-grammar-symbols bounding how many
    # arrays it builds, 256 kept what they added to the worst compile found to 0.5 s.
    max_json_schema_items: int = 256

    def check_completion(self, body: CompletionRequest) -> None:
        """Raise `LimitExceededError` where a completions body is over a limit."""
        self._check_sampling(body)
        if body.logprobs is not None:
            self._check("max_logprobs", body.logprobs, "logprobs", "logprobs must be")
        sequences = len(body.prompts()) * body.n
        self._check("max_completion_sequences", sequences, "prompt", "prompts times n must be")

    def check_chat(self, body: ChatCompletionRequest) -> None:
        """Raise `LimitExceededError` where a chat body is over a limit."""
        self._check_sampling(body)
        if body.top_logprobs is not None:
            self._check("max_logprobs", body.top_logprobs, "top_logprobs", "top_logprobs must be")
        tools = body.tools or []
        self._check("max_tools", len(tools), "tools", "tools must have", " tools")
        choice = body.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        names = [tool.function.name for tool in tools]
        for index in _grammar_tools(names, choice == "required", named):
            parameters = tools[index].function.parameters
            if parameters is not None:
                self._check_schema(parameters, f"tools.{index}.function.parameters")

    def check_response(self, body: CreateResponseRequest) -> None:
        """Raise `LimitExceededError` where a Responses API body is over a limit."""
        self._check("max_tools", len(body.tools), "tools", "tools must have", " tools")
        if isinstance(body.text.format, JsonSchemaTextFormat):
            self._check_schema(body.text.format.schema_, "text.format.schema")
        choice = body.tool_choice
        named = choice.name if isinstance(choice, FunctionToolChoice) else None
        names = [tool.name for tool in body.tools]
        for index in _grammar_tools(names, choice == "required", named):
            parameters = body.tools[index].parameters
            if parameters is not None:
                self._check_schema(parameters, f"tools.{index}.parameters")

    def _check_sampling(self, body: SamplingFields) -> None:
        """The limits on the fields chat and completions share."""
        self._check("max_n", body.n, "n", "n must be")
        stops = body.stop_list()
        self._check("max_stop_sequences", len(stops), "stop", "stop must have", " sequences")
        longest = max((len(stop) for stop in stops), default=0)
        self._check("max_stop_length", longest, "stop", "stop sequences must be", " characters")
        entries = len(body.logit_bias or {})
        self._check("max_logit_bias", entries, "logit_bias", "logit_bias must have", " entries")
        if body.response_format is not None and body.response_format.json_schema is not None:
            schema = body.response_format.json_schema.schema_
            self._check_schema(schema, "response_format.json_schema.schema")

    def _check_schema(self, schema: dict[str, Any], param: str) -> None:
        """Refuse a schema a grammar would enforce that nests too deep or weighs too much.
        Depth first: its walk is iterative, while serializing recurses once per level."""
        depth = _depth(schema)
        what = f"{param} must nest objects and arrays"
        self._check("max_json_schema_depth", depth, param, what, " levels deep")
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
        self._check("max_json_schema_bytes", size, param, f"{param} must be", " bytes as JSON")
        items = _largest_item_count(schema)
        what = f"{param} must bound arrays (minItems, maxItems) to"
        self._check("max_json_schema_items", items, param, what, " items")

    def _check(self, limit: str, value: int, param: str, what: str, unit: str = "") -> None:
        """Refuse `value` over the limit named `limit`: "<what> at most <limit><unit>"."""
        bound: int = getattr(self, limit)
        if value > bound:
            flag = "--" + limit.replace("_", "-")
            raise LimitExceededError(f"{what} at most {bound}{unit} ({flag}); got {value}", param)


def _grammar_tools(names: list[str], required: bool, named: str | None) -> list[int]:
    """The tools whose `parameters` a grammar enforces, as serving/tools.py plans them: the
    named function's (the first of its name), every tool's under "required", else none."""
    if named is not None:
        return [names.index(named)]
    return list(range(len(names))) if required else []


def _depth(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value: 0 for a scalar, 1 for `{}`."""
    depth = 0
    level = [value]
    while containers := [node for node in level if isinstance(node, dict | list)]:
        depth += 1
        level = [
            child
            for node in containers
            for child in (node.values() if isinstance(node, dict) else node)
        ]
    return depth


def _largest_item_count(schema: dict[str, Any]) -> int:
    """The largest integer `minItems` or `maxItems` anywhere in a schema, 0 for none. Those
    inside `enum`, `const` or `default` values count too, though they constrain nothing:
    telling data from subschemas is not worth a rare needless refusal."""
    largest = 0
    nodes: list[Any] = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            for key in ("minItems", "maxItems"):
                count = node.get(key)
                if isinstance(count, int):
                    largest = max(largest, count)
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
    return largest


DEFAULT_LIMITS = RequestLimits()
