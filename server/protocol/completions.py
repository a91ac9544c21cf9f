"""Request and response models of POST /v1/completions (OpenAI legacy completions)."""

from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from server.protocol.common import SamplingFields, SpeculationSummary, Usage

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(
        description="Its prompts times `n`: at most the server's `--max-completion-sequences`."
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, description="At most the server's `--max-logprobs`.")
    echo: bool = False
    # Fill in the middle: the prompt is the text before the insertion, this the text after.
    suffix: str | None = None
    # Accepted only at the value that changes nothing (best_of = n: keep all n), so OpenAI
    # clients that send it keep working; vLLM V1 has no best_of, so anything else is a 400.
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")  # absent when n itself was invalid
        if best_of is not None and n is not None and best_of != n:
            raise ValueError(
                f"best_of must equal n ({n}): generating extra sequences to keep the best "
                "is not supported"
            )
        return best_of

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "CompletionRequest":
        if self.suffix is not None and self.echo:
            raise ValueError("echo together with suffix is not supported")
        if self.suffix is not None and not all(isinstance(p, str) for p in self.prompts()):
            raise ValueError("suffix needs text prompts, not token ids")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of separate prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [[int(p) for p in prompt]]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationSummary | None = None
