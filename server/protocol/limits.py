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

from dataclasses import dataclass

from server.protocol.chat import ChatCompletionRequest
from server.protocol.common import SamplingFields
from server.protocol.completions import CompletionRequest
from server.protocol.responses import CreateResponseRequest


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
        self._check("max_tools", len(body.tools or []), "tools", "tools must have", " tools")

    def check_response(self, body: CreateResponseRequest) -> None:
        """Raise `LimitExceededError` where a Responses API body is over a limit."""
        self._check("max_tools", len(body.tools), "tools", "tools must have", " tools")

    def _check_sampling(self, body: SamplingFields) -> None:
        """The limits on the fields chat and completions share."""
        self._check("max_n", body.n, "n", "n must be")
        stops = body.stop_list()
        self._check("max_stop_sequences", len(stops), "stop", "stop must have", " sequences")
        longest = max((len(stop) for stop in stops), default=0)
        self._check("max_stop_length", longest, "stop", "stop sequences must be", " characters")
        entries = len(body.logit_bias or {})
        self._check("max_logit_bias", entries, "logit_bias", "logit_bias must have", " entries")

    def _check(self, limit: str, value: int, param: str, what: str, unit: str = "") -> None:
        """Refuse `value` over the limit named `limit`: "<what> at most <limit><unit>"."""
        bound: int = getattr(self, limit)
        if value > bound:
            flag = "--" + limit.replace("_", "-")
            raise LimitExceededError(f"{what} at most {bound}{unit} ({flag}); got {value}", param)


DEFAULT_LIMITS = RequestLimits()
