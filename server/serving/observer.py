"""How requests feed the metrics: one RequestObserver per request (timing, token counts and
speculation, per engine output), the speculation window of the last minute, and the series a
server creates at startup from its engine's description.
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from server.autopilot.idle import IdleReason
from server.engine.contract import EngineInfo, EngineOutput, SpeculationStats
from server.metrics import (
    ANONYMOUS_TENANT,
    BASELINE_TPOT,
    DRAFT_CAUGHT_UP_TOKENS,
    DRAFT_FORWARD_PASSES,
    E2E,
    ENGINE_DTYPE,
    GENERATION_ENDPOINTS,
    GENERATION_TOKENS,
    ITL,
    KNOWN_ENDPOINTS,
    PROMPT_CACHED_TOKENS,
    PROMPT_TOKENS,
    REQUEST_ACCEPTANCE,
    REQUESTS,
    SPEC_ACCEPTED_PER_POSITION,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
    SPECULATION_IDLE_STEPS,
    SPECULATION_STEPS,
    SPECULATION_WINDOW_SECONDS,
    SPECULATIVE_TOKENS,
    TPOT,
    TTFT,
    TTFT_BY_PROMPT_CACHE,
    WINDOW_ACCEPTANCE_LENGTH,
    WINDOW_ACCEPTANCE_RATE,
)


def describe_server(
    info: EngineInfo, baseline_tpot_seconds: float | None, error_statuses: Iterable[int]
) -> None:
    """Publish the configuration and create, at zero, every series whose labels
    are known at startup, so `rate()` sees the first requests after a start.

    From startup: requests by endpoint with status 200 (every endpoint) and
    each of `error_statuses` (generation endpoints); latency histograms and
    token counters per generation endpoint (tenant "anonymous"); speculation
    counters per draft position, autopilot steps per K and per idle reason, and
    the draft's counters. Later, at their first request: series of
    keyed tenants and of statuses outside that set.
    """
    model = info.model_name
    k = info.speculation.num_speculative_tokens if info.speculation else 0
    SPECULATIVE_TOKENS.labels(model).set(k)
    ENGINE_DTYPE.labels(model, info.dtype).set(1)
    if baseline_tpot_seconds is not None:
        BASELINE_TPOT.labels(model).set(baseline_tpot_seconds)
    for endpoint in KNOWN_ENDPOINTS:
        REQUESTS.labels(endpoint, "200")
    for endpoint in GENERATION_ENDPOINTS:
        for status in error_statuses:
            REQUESTS.labels(endpoint, str(status))
        for histogram in (TTFT, ITL, TPOT, E2E):
            histogram.labels(model, endpoint, ANONYMOUS_TENANT)
        for prompt_cache in ("hit", "miss"):
            TTFT_BY_PROMPT_CACHE.labels(model, endpoint, prompt_cache)
        for counter in (PROMPT_TOKENS, PROMPT_CACHED_TOKENS, GENERATION_TOKENS):
            counter.labels(model, endpoint, ANONYMOUS_TENANT)
    for counter in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS):
        counter.labels(model, ANONYMOUS_TENANT)
    for position in range(k):
        SPEC_ACCEPTED_PER_POSITION.labels(model, ANONYMOUS_TENANT, str(position))
    if info.speculation is not None:
        for steps_k in range(k + 1):
            SPECULATION_STEPS.labels(model, str(steps_k))
        for reason in IdleReason:
            SPECULATION_IDLE_STEPS.labels(model, reason)
        DRAFT_FORWARD_PASSES.labels(model)
        DRAFT_CAUGHT_UP_TOKENS.labels(model)


class SpeculationWindow:
    """Speculation totals of the requests that finished within the window.

    Old entries are dropped on every insert as well as on every read, so memory
    stays bounded by the traffic of one window whether or not anything scrapes.
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._seconds = seconds
        self._clock = clock
        self._entries: deque[tuple[float, int, int, int]] = deque()
        self._lock = threading.Lock()  # scrapes run in another thread

    def add(self, stats: SpeculationStats) -> None:
        with self._lock:
            now = self._clock()
            self._prune(now)
            self._entries.append((now, stats.drafts, stats.draft_tokens, stats.accepted_tokens))

    def _prune(self, now: float) -> None:  # holding the lock
        horizon = now - self._seconds
        while self._entries and self._entries[0][0] < horizon:
            self._entries.popleft()

    def _totals(self) -> tuple[int, int, int]:
        with self._lock:
            self._prune(self._clock())
            drafts = sum(e[1] for e in self._entries)
            draft_tokens = sum(e[2] for e in self._entries)
            accepted = sum(e[3] for e in self._entries)
        return drafts, draft_tokens, accepted

    def acceptance_rate(self) -> float:
        _, draft_tokens, accepted = self._totals()
        return accepted / draft_tokens if draft_tokens else float("nan")

    def mean_acceptance_length(self) -> float:
        drafts, _, accepted = self._totals()
        return 1.0 + accepted / drafts if drafts else float("nan")


WINDOW = SpeculationWindow(SPECULATION_WINDOW_SECONDS)
WINDOW_ACCEPTANCE_RATE.set_function(WINDOW.acceptance_rate)
WINDOW_ACCEPTANCE_LENGTH.set_function(WINDOW.mean_acceptance_length)


@dataclass
class _SequenceTiming:
    first: float
    last: float
    tokens: int


class RequestObserver:
    """Timing, token counts and speculation of one request, fed per engine output.

    TTFT is per request (its first token of any sequence); inter-token gaps and
    TPOT are per sequence (one per prompt and choice), as vLLM defines them.
    The serving layer reads the totals back for usage and the per-request
    speculation summary, so counts in responses and in metrics agree.
    """

    def __init__(self, model: str, endpoint: str, arrival: float, tenant: str) -> None:
        self.model, self.endpoint, self.tenant = model, endpoint, tenant
        self.start = arrival  # time.perf_counter() when the request arrived
        # Resolved once: `labels()` is a locked dict lookup, and ITL is
        # observed on every engine output.
        self._itl = ITL.labels(model, endpoint, tenant)
        self._sequences: dict[tuple[int, int], _SequenceTiming] = {}
        self._prompt_tokens: dict[int, int] = {}
        self._cached_tokens: dict[int, int] = {}
        self.output_tokens = 0
        self.speculation: list[SpeculationStats] = []

    @property
    def prompt_tokens(self) -> int:
        return sum(self._prompt_tokens.values())

    @property
    def cached_tokens(self) -> int:
        """Of the prompt tokens, those whose KV the engine reused from its prefix cache."""
        return sum(self._cached_tokens.values())

    def on_output(self, position: int, output: EngineOutput) -> None:
        """Engine output of the request at `position` (one per prompt) arrived. A whole
        reply sent at once (output.token_times set) times its sequences by the engine's
        first and last token; its gaps between tokens are not seen (no ITL)."""
        now = time.perf_counter()
        first = last = now
        if output.token_times is not None:
            first, last = output.token_times.first, output.token_times.last
        if position not in self._prompt_tokens:  # both known from the first output on
            self._prompt_tokens[position] = output.prompt_tokens
            self._cached_tokens[position] = output.cached_tokens
        for choice in output.choices:
            if choice.speculation is not None:
                self.speculation.append(choice.speculation)
            if not choice.token_ids:
                continue
            self.output_tokens += len(choice.token_ids)
            key = (position, choice.index)
            timing = self._sequences.get(key)
            if timing is None:
                if not self._sequences:
                    TTFT.labels(self.model, self.endpoint, self.tenant).observe(first - self.start)
                    prompt_cache = "hit" if output.cached_tokens else "miss"
                    TTFT_BY_PROMPT_CACHE.labels(self.model, self.endpoint, prompt_cache).observe(
                        first - self.start
                    )
                self._sequences[key] = _SequenceTiming(first, last, len(choice.token_ids))
                continue
            self._itl.observe(now - timing.last)
            timing.last = now
            timing.tokens += len(choice.token_ids)

    def finish(self, completed: bool) -> None:
        """The request ended. Tokens and speculation always count; latency only
        for requests that completed, so aborted ones do not skew it."""
        labels = (self.model, self.endpoint, self.tenant)
        PROMPT_TOKENS.labels(*labels).inc(self.prompt_tokens)
        PROMPT_CACHED_TOKENS.labels(*labels).inc(self.cached_tokens)
        GENERATION_TOKENS.labels(*labels).inc(self.output_tokens)
        for stats in self.speculation:
            record_speculation(self.model, self.tenant, stats)
        if not completed:
            return
        E2E.labels(*labels).observe(time.perf_counter() - self.start)
        tpot = TPOT.labels(*labels)
        for timing in self._sequences.values():
            if timing.tokens > 1:
                tpot.observe((timing.last - timing.first) / (timing.tokens - 1))


def record_speculation(model: str, tenant: str, stats: SpeculationStats) -> None:
    SPEC_DRAFTS.labels(model, tenant).inc(stats.drafts)
    SPEC_DRAFT_TOKENS.labels(model, tenant).inc(stats.draft_tokens)
    SPEC_ACCEPTED_TOKENS.labels(model, tenant).inc(stats.accepted_tokens)
    for position, accepted in enumerate(stats.accepted_per_position):
        SPEC_ACCEPTED_PER_POSITION.labels(model, tenant, str(position)).inc(accepted)
    if stats.draft_tokens:
        REQUEST_ACCEPTANCE.labels(model).observe(stats.accepted_tokens / stats.draft_tokens)
    WINDOW.add(stats)
