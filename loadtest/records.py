"""What one request did, as the load generator saw it.

Times are `time.perf_counter()` seconds. `start` is relative to the start of
the run; the others are durations from the moment the request was sent.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass
class RequestRecord:
    index: int  # position in the run's request sequence
    item: str  # workload item id, so runs against two servers pair up
    server: str  # label of the server it went to
    start: float = 0.0
    success: bool = False
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None
    ttft: float | None = None  # sent -> first chunk carrying generated text
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    e2el: float | None = None  # sent -> last text chunk (whole response if not streamed)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt's, reused from the server's prefix cache
    output_tokens: int = 0
    # "usage" when the server reported the count; "chunks" when it did not and
    # every text chunk counted as one token (an undercount with speculation).
    output_tokens_source: Literal["usage", "chunks"] = "usage"
    speculation: dict[str, Any] | None = None  # the server's per-request summary, if any
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); undefined below two tokens."""
        if not self.success or self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["tpot"] = self.tpot
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RequestRecord":
        data = {k: v for k, v in data.items() if k != "tpot"}
        return cls(**data)
