"""Request and response models of POST /v1/chat/completions."""

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from server.protocol.common import (
    SamplingFields,
    SpeculationSummary,
    StrictRequest,
    Usage,
    check_tool_choice,
)


def _is_none(value: object) -> bool:
    """Fields OpenAI leaves out rather than sending null."""
    return value is None


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class FunctionCall(StrictRequest):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(StrictRequest):
    """A call an earlier assistant turn made, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        # Chat templates write arguments with `tojson`: they expect an object, and a
        # JSON string would come out quoted twice.
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(StrictRequest):
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers

    @model_validator(mode="after")
    def _check_role_fields(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool messages need tool_call_id, and only they carry it")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(StrictRequest):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # A JSON schema of the arguments object; none: any object.
    parameters: dict[str, Any] | None = None
    # The arguments follow the schema only where a grammar enforces them
    # (tool_choice "required" or a named function), strict or not.
    strict: bool | None = None


class ToolDefinition(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, description="At most the server's `--max-logprobs`."
    )
    tools: list[ToolDefinition] | None = Field(
        None, description="At most the server's `--max-tools`."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tool_choice(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        constrained = self.response_format is not None and self.response_format.type != "text"
        check_tool_choice(
            choice if isinstance(choice, str) else None,
            choice.function.name if isinstance(choice, NamedToolChoice) else None,
            [tool.function.name for tool in self.tools or []],
            "response_format" if constrained else None,
        )
        return self

    def offered_tools(self) -> list[ToolDefinition]:
        """The tools the model may call: none when tool_choice is none."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationSummary | None = None


class ToolCallFunctionDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_is_none)
    arguments: str | None = Field(default=None, exclude_if=_is_none)


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: id, type and name first, then argument fragments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: ToolCallFunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculation: SpeculationSummary | None = None
