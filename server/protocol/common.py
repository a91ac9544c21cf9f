"""Pydantic models shared by the completion and chat protocols.

Requests forbid unknown fields: a parameter specserve cannot honour is a 400
that names it, never silently ignored. How many and how large (`n`, `stop`,
`logit_bias`, `tools`...) is no constraint of the models: each is a server
setting, checked after parsing (limits.py), and the field's description names
its flag.
"""

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

# A logit_bias key: a token id as OpenAI spells it, decimal without sign or leading zeros.
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]*)$")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


def _optional_properties_accept_null(schema: dict[str, Any]) -> None:
    """Say in the OpenAPI document what `_null_means_default` does: every
    optional property also accepts null."""
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        if "anyOf" in prop:
            if {"type": "null"} not in prop["anyOf"]:
                prop["anyOf"].append({"type": "null"})
            continue
        annotations = {
            key: prop.pop(key) for key in ("title", "default", "description") if key in prop
        }
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **annotations}


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_optional_properties_accept_null)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI accepts `"temperature": null` and friends as "use the default".
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(StrictRequest):
    include_usage: bool = False


class JsonSchemaFormat(StrictRequest):
    """OpenAI's `response_format.json_schema`."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the wire name stays OpenAI's.
    schema_: dict[str, Any] = Field(alias="schema")
    # The schema is always enforced by a grammar, so strict or not, replies match it.
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema" and only there')
        return self


def _logit_bias_problem(error: ErrorDetails) -> str:
    location = error["loc"]
    if location[-1:] == ("[key]",):
        return f"key {location[0]!r} is not a token id (a decimal integer)"
    if location:
        return f"token {location[0]}: {error['msg']}"
    return error["msg"]


class SpeculationOptions(StrictRequest):
    """specserve's extension: speculation for this request alone."""

    # At most this many draft tokens verified per step for this request; 0: none (the
    # request decodes as without speculation), e.g. to A/B speculation on live traffic.
    max_draft_tokens: int | None = Field(None, ge=0, le=64)
    # False: nothing looked up is proposed to this request, only the draft model's
    # proposals (the hybrid), e.g. to A/B the lookups on live traffic.
    lookups: bool = True


def draft_cap(options: SpeculationOptions | None) -> int | None:
    """A request's cap on its drafts per step, if it set one."""
    return None if options is None else options.max_draft_tokens


def lookups_wanted(options: SpeculationOptions | None) -> bool:
    """Whether the request may be proposed looked-up tokens."""
    return options is None or options.lookups


# vllm-router re-serializes chat and completion bodies with these fields of vLLM's and
# SGLang's servers set to their defaults. At those values they ask for what specserve does
# anyway, so they are taken as absent; any other value is still refused by name.
ROUTER_DEFAULT_FIELDS: dict[str, bool] = {
    "ignore_eos": False,
    "no_stop_trim": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


class SamplingFields(StrictRequest):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, description="At most the server's `--max-n`.")
    stop: str | list[str] | None = Field(
        None,
        description="At most the server's `--max-stop-sequences`, each of at most "
        "`--max-stop-length` characters.",
    )
    # The engine carries seeds as signed 64-bit integers.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    response_format: ResponseFormat | None = None
    # Token id -> bias added to its logit before sampling: -100 bans it, 100 forces it.
    # Ids must be in the model's vocabulary, which only the engine knows (checked in serving).
    logit_bias: dict[TokenIdKey, Bias] | None = Field(
        None, description="At most the server's `--max-logit-bias` entries."
    )
    speculation: SpeculationOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _router_defaults_are_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {
                key: value
                for key, value in data.items()
                if key not in ROUTER_DEFAULT_FIELDS or value is not ROUTER_DEFAULT_FIELDS[key]
            }
        return data

    @field_validator("logit_bias", mode="wrap")
    @classmethod
    def _logit_bias_is_one_parameter(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # An entry's error names `logit_bias` itself, as OpenAI's do, not a key inside it.
        try:
            return handler(value)
        except ValidationError as exc:
            raise ValueError("; ".join(_logit_bias_problem(e) for e in exc.errors())) from None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class PromptTokensDetails(BaseModel):
    # Prompt tokens whose KV the engine reused from an earlier request with the same prefix.
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class SourceCounts(BaseModel):
    """Proposed tokens of one source that the target verified, and those it accepted."""

    draft_tokens: int = 0
    accepted_tokens: int = 0


class SpeculationSummary(BaseModel):
    """specserve's extension object: what speculation did for one request.

    Sent as `speculation` in non-streaming bodies and in the streaming usage
    chunk; OpenAI clients keep unknown fields (`response.model_extra`).
    """

    applied: bool
    # Why no draft was verified: disabled, not_paying, batch_too_large,
    # calibrating, too_short, prefill, lookup, logit_bias (its own) or requested_off; None when
    # applied.
    reason: str | None = None
    mode: str | None = None  # auto (the autopilot picks K per step) or fixed
    method: str | None = None
    num_speculative_tokens: int | None = None  # K (fixed) or the largest K (auto)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Verify steps whose draft token at each position was accepted.
    accepted_per_position: list[int] = Field(default_factory=list)
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    # Engine steps by the number of drafts they verified ("0": the draft idled).
    steps_by_k: dict[str, int] = Field(default_factory=dict)
    # The hybrid: draft_tokens and accepted_tokens split into "draft" (the draft model's
    # proposals) and "lookup" (looked up in the request's context or the tenant's replies).
    by_source: dict[str, SourceCounts] | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, the shape of every error this server sends."""

    error: ErrorDetail


def check_tool_choice(
    choice: str | None, named: str | None, tool_names: list[str], format_param: str | None
) -> None:
    """Refuse a tool_choice the request cannot honour (chat and the Responses API).

    `choice` is none/auto/required (None: not sent), `named` the function a named
    choice names, `format_param` the parameter that already holds the reply to JSON.
    """
    if named is None and choice in (None, "none", "auto"):
        return
    if not tool_names:
        raise ValueError("tool_choice other than none and auto needs tools")
    if named is not None and named not in tool_names:
        raise ValueError(f"tool_choice names {named!r}, which is not in tools")
    if format_param is not None:
        raise ValueError(
            f"{format_param} and a required or named tool_choice both set the reply's "
            "grammar; send one of them"
        )
