"""Request and response models of POST /v1/responses (OpenAI's Responses API), stateless.

The input items become chat messages (`CreateResponseRequest.messages`), so the
conversation reaches the chat template exactly as chat's would; `text.format`
becomes chat's `response_format`. Nothing is stored: `previous_response_id` is
refused, and `store` is accepted but every response says `"store": false`.
"""

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from server.protocol.chat import ChatMessage, FunctionCall, MessageToolCall
from server.protocol.common import (
    JsonSchemaFormat,
    ResponseFormat,
    SpeculationOptions,
    SpeculationSummary,
    StrictRequest,
    check_tool_choice,
)

# Of a response and of each output item.
Progress = Literal["in_progress", "completed", "incomplete"]


class InputText(StrictRequest):
    type: Literal["input_text"]
    text: str


class OutputTextPart(StrictRequest):
    """An earlier assistant reply's text, sent back in the history."""

    type: Literal["output_text"]
    text: str
    # What an earlier response carried with the text: accepted, not read.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


ContentPart = Annotated[InputText | OutputTextPart, Field(discriminator="type")]


class MessageItem(StrictRequest):
    type: Literal["message"] = "message"
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    # An earlier response's output item sent back as it came: accepted, not read.
    id: str | None = None
    status: Progress | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(StrictRequest):
    """A call an earlier response made."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Progress | None = None


class FunctionCallOutputItem(StrictRequest):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Progress | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_type(item: Any) -> str:
    # Message items may leave out their type (OpenAI's "easy input message").
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="input_item_type",
        custom_error_message="input items are messages, function_call or function_call_output",
    ),
]


class PlainTextFormat(StrictRequest):
    type: Literal["text"]


class JsonObjectFormat(StrictRequest):
    type: Literal["json_object"]


class JsonSchemaTextFormat(JsonSchemaFormat):
    """Chat's `response_format.json_schema`, flat: `{"type": "json_schema", "name",
    "schema", "strict"}`."""

    type: Literal["json_schema"]


TextFormat = Annotated[
    PlainTextFormat | JsonObjectFormat | JsonSchemaTextFormat, Field(discriminator="type")
]


class TextConfig(StrictRequest):
    format: TextFormat = PlainTextFormat(type="text")


class FunctionTool(StrictRequest):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # A JSON schema of the arguments object; none: any object.
    parameters: dict[str, Any] | None = None
    # The arguments follow the schema only where a grammar enforces them
    # (tool_choice "required" or a named function), strict or not.
    strict: bool | None = None


class FunctionToolChoice(StrictRequest):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


class ResponseStreamOptions(StrictRequest):
    # specserve adds no obfuscation padding to stream events, asked or not.
    include_obfuscation: bool = True


class CreateResponseRequest(StrictRequest):
    model: str
    # A string is one user message.
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # specserve's extension, as on chat: the engine carries seeds as signed 64-bit integers.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    text: TextConfig = TextConfig()
    tools: list[FunctionTool] = Field(
        default_factory=list, description="At most the server's `--max-tools`."
    )
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    # OpenAI stores responses unless told not to; specserve never does, so either
    # value is accepted and the response says `"store": false`.
    store: bool = True
    previous_response_id: str | None = None  # refused: nothing is stored
    # Extra output data to include: specserve has none to add.
    include: list[str] = Field(default_factory=list)
    # A prompt that does not fit is a 400, never cut.
    truncation: Literal["disabled"] = "disabled"
    metadata: Annotated[
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
        Field(max_length=16),
    ] = Field(default_factory=dict)
    user: str | None = None
    speculation: SpeculationOptions | None = None  # specserve's extension, as on chat

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_problems(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # Only the list form can hold a mistake worth naming; the errors of the
        # string form ("not a string") would bury it.
        try:
            return handler(value)
        except ValidationError as exc:
            if isinstance(value, str):
                raise
            problems = [
                f"{'.'.join(str(part) for part in error['loc'][1:])}: {error['msg']}"
                for error in exc.errors()
                if error["loc"][:1] != ("str",)
            ]
            raise ValueError("; ".join(problems)) from None

    @field_validator("tools", mode="before")
    @classmethod
    def _only_functions(cls, tools: Any) -> Any:
        if isinstance(tools, list):
            # Named types only: other malformed tools get the usual validation errors.
            types = [t.get("type") for t in tools if isinstance(t, dict)]
            others = sorted({t for t in types if isinstance(t, str)} - {"function"})
            if others:
                raise ValueError(
                    f"only function tools are supported; built-in tools ({', '.join(others)}) "
                    "are not"
                )
        return tools

    @field_validator("previous_response_id")
    @classmethod
    def _nothing_stored(cls, value: str) -> str:
        raise ValueError(
            "specserve stores no responses; send the whole conversation in input "
            "(earlier output items and function_call_output items included)"
        )

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, values: list[str]) -> list[str]:
        if values:
            raise ValueError(f"specserve has no extra output data to include; got {values}")
        return values

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "CreateResponseRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _check_tool_choice(self) -> "CreateResponseRequest":
        choice = self.tool_choice
        check_tool_choice(
            choice if isinstance(choice, str) else None,
            choice.name if isinstance(choice, FunctionToolChoice) else None,
            [tool.name for tool in self.tools],
            "text.format" if self.text.format.type != "text" else None,
        )
        return self

    def messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: instructions first, each function_call
        joined to the assistant turn it follows, each output a tool message."""
        messages = []
        if self.instructions is not None:
            messages.append(ChatMessage(role="system", content=self.instructions))
        items = (
            [MessageItem(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        for item in items:
            if isinstance(item, FunctionCallItem):
                call = MessageToolCall(
                    id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
                )
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":
                    calls = [*(last.tool_calls or []), call]
                    messages[-1] = ChatMessage(
                        role="assistant", content=last.content, tool_calls=calls
                    )
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id)
                )
            else:
                messages.append(ChatMessage(role=item.role, content=item.text()))
        return messages

    def response_format(self) -> ResponseFormat:
        """`text.format` in chat's shape."""
        fmt = self.text.format
        schema = fmt if isinstance(fmt, JsonSchemaTextFormat) else None
        return ResponseFormat(type=fmt.type, json_schema=schema)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)  # specserve adds none


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Progress
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str  # what the function_call_output answering it names
    name: str
    arguments: str  # JSON text
    status: Progress


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response: its output items, and the request's settings echoed as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Progress
    error: None = None  # failures after the stream started arrive as an `error` event
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    store: Literal[False] = False
    temperature: float
    text: TextConfig
    tool_choice: ToolChoice
    tools: list[FunctionTool]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None  # None until the response is done
    user: str | None
    speculation: SpeculationSummary | None = None
