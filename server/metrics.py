"""Every specserve Prometheus metric, defined in one place, and how requests feed them.

Latency is measured where the user feels it: at the HTTP front end, per engine
output. Labels are bounded: model (one per server), endpoint (a fixed set),
tenant ("anonymous" until API keys exist), status code, draft position (< K).
vLLM's own `vllm:*` metrics live in the same default registry and are exposed
beside these on /metrics, as vLLM defines them.

Derived figures, in PromQL:
- acceptance rate:
    sum(rate(specserve_spec_decode_accepted_tokens_total[5m]))
    / sum(rate(specserve_spec_decode_draft_tokens_total[5m]))
- mean acceptance length (tokens per verify step, bonus token included):
    1 + sum(rate(specserve_spec_decode_accepted_tokens_total[5m]))
        / sum(rate(specserve_spec_decode_drafts_total[5m]))
- acceptance at draft position p:
    sum by (position) (rate(specserve_spec_decode_accepted_tokens_per_position_total[5m]))
    / ignoring(position) group_left sum(rate(specserve_spec_decode_drafts_total[5m]))
- TPOT p95:
    histogram_quantile(0.95, sum by (le) (rate(specserve_time_per_output_token_seconds_bucket[5m])))
- output tokens/s: sum(rate(specserve_generation_tokens_total[1m]))
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from server.autopilot.idle import IdleReason
from server.engine.base import EngineInfo, EngineOutput, SpeculationStats

ANONYMOUS_TENANT = "anonymous"
# Endpoint labels are this fixed set (plus "/v1/models/{model}" and "other"),
# so clients cannot grow it; generation endpoints are those reaching the engine.
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
KNOWN_ENDPOINTS = (*GENERATION_ENDPOINTS, "/v1/models", "/health", "/ready", "/metrics")
SPECULATION_WINDOW_SECONDS = 60.0

# From 1 ms (GPU decode steps) to 2 minutes (a long CPU request).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0,
)  # fmt: skip
_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

REQUESTS = Counter(
    "specserve_requests_total", "HTTP requests by endpoint and status code",
    ["endpoint", "status"],
)  # fmt: skip
IN_FLIGHT = Gauge("specserve_requests_in_flight", "HTTP requests being served", ["endpoint"])
QUEUED = Gauge(
    "specserve_requests_queued", "Generation requests waiting for an engine slot (queue depth)"
)
RUNNING = Gauge("specserve_requests_running", "Generation requests holding an engine slot")
# Read from the engine at each scrape (see track_engine_requests).
ENGINE_REQUESTS = Gauge(
    "specserve_engine_requests", "Requests the engine holds, waiting or running"
)
QUEUE_WAIT = Histogram(
    "specserve_queue_wait_seconds",
    "Time a generation request waited for an engine slot",
    buckets=_LATENCY_BUCKETS,
)
REFUSED = Counter(
    "specserve_requests_refused_total",
    "Generation requests refused before reaching the engine, by reason",
    ["reason"],
)
RATE_LIMIT_STORE_FAILURES = Counter(
    "specserve_rate_limit_store_failures_total",
    "Rate-limit decisions made without the shared store (Redis unreachable)",
)
TTFT = Histogram(
    "specserve_time_to_first_token_seconds", "Request arrival to first generated token",
    ["model", "endpoint"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
ITL = Histogram(
    "specserve_inter_token_latency_seconds",
    "Gap between consecutive outputs of one streamed sequence (each chunk)",
    ["model", "endpoint"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
TPOT = Histogram(
    "specserve_time_per_output_token_seconds",
    "(last token - first token) / (output tokens - 1), per sequence",
    ["model", "endpoint"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
E2E = Histogram(
    "specserve_e2e_request_latency_seconds", "Request arrival to last token",
    ["model", "endpoint"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
PROMPT_TOKENS = Counter(
    "specserve_prompt_tokens_total", "Prompt tokens processed", ["model", "endpoint", "tenant"]
)
GENERATION_TOKENS = Counter(
    "specserve_generation_tokens_total", "Tokens generated", ["model", "endpoint", "tenant"]
)
SPEC_DRAFTS = Counter(
    "specserve_spec_decode_drafts_total", "Verify steps that checked a draft",
    ["model", "tenant"],
)  # fmt: skip
SPEC_DRAFT_TOKENS = Counter(
    "specserve_spec_decode_draft_tokens_total", "Draft tokens proposed", ["model", "tenant"]
)
SPEC_ACCEPTED_TOKENS = Counter(
    "specserve_spec_decode_accepted_tokens_total", "Draft tokens accepted", ["model", "tenant"]
)
SPEC_ACCEPTED_PER_POSITION = Counter(
    "specserve_spec_decode_accepted_tokens_per_position_total",
    "Draft tokens accepted at each draft position (0 = first proposed)",
    ["model", "tenant", "position"],
)  # fmt: skip
REQUEST_ACCEPTANCE = Histogram(
    "specserve_request_acceptance_rate",
    "Draft acceptance rate of each sequence; the extremes flag garbled or looping output",
    ["model"], buckets=_RATE_BUCKETS,
)  # fmt: skip
WINDOW_ACCEPTANCE_RATE = Gauge(
    "specserve_spec_decode_acceptance_rate_window",
    f"Accepted / draft tokens over the last {SPECULATION_WINDOW_SECONDS:.0f} s (NaN if none)",
)
WINDOW_ACCEPTANCE_LENGTH = Gauge(
    "specserve_spec_decode_mean_acceptance_length_window",
    f"1 + accepted tokens / drafts over the last {SPECULATION_WINDOW_SECONDS:.0f} s (NaN if none)",
)


SPECULATIVE_TOKENS = Gauge(
    "specserve_speculative_tokens",
    "Configured draft tokens per step (K; the largest K in auto mode); 0 without speculation",
    ["model"],
)  # fmt: skip
BASELINE_TPOT = Gauge(
    "specserve_baseline_time_per_output_token_seconds",
    "Measured no-speculation TPOT given with --baseline-tpot-seconds (absent if unknown)",
    ["model"],
)  # fmt: skip
ENGINE_DTYPE = Gauge(
    "specserve_engine_dtype_info",
    "Always 1; dtype is what the weights run in (set by --dtype or chosen for the hardware)",
    ["model", "dtype"],
)  # fmt: skip


SPECULATION_K_IN_FORCE = Gauge(
    "specserve_speculation_k_in_force",
    "K the draft proposed at the last engine step (0: the draft idled)",
    ["model"],
)  # fmt: skip
SPECULATION_STEPS = Counter(
    "specserve_speculation_steps_total", "Engine steps by the K they proposed", ["model", "k"]
)
SPECULATION_IDLE_STEPS = Counter(
    "specserve_speculation_idle_steps_total",
    "Engine steps with K=0, by why (autopilot/idle.py)",
    ["model", "reason"],
)  # fmt: skip
SPECULATION_PREDICTED_SPEEDUP = Gauge(
    "specserve_speculation_predicted_speedup",
    "The autopilot's predicted tokens/s at its K over tokens/s without speculation",
    ["model"],
)  # fmt: skip
SPECULATION_MEASURED_SPEEDUP = Gauge(
    "specserve_speculation_measured_speedup",
    "Measured tokens/s of recent decode steps over the fitted no-speculation tokens/s",
    ["model"],
)  # fmt: skip
DRAFT_FORWARD_PASSES = Counter(
    "specserve_draft_forward_passes_total", "Forward passes of the draft model", ["model"]
)
DRAFT_CAUGHT_UP_TOKENS = Counter(
    "specserve_draft_caught_up_tokens_total",
    "Tokens the draft prefilled when speculation resumed after K=0 steps",
    ["model"],
)  # fmt: skip
VLLM_PATCH_FAILURES = Counter(
    "specserve_vllm_patch_failures_total",
    "Engine processes where a specserve patch of vLLM raised and was handed back to vLLM's "
    "own code for the rest of the run (server/engine/vllm_patches.py)",
    ["model", "patch"],
)


def track_engine_requests(unfinished_requests: Callable[[], int]) -> None:
    """specserve_engine_requests reads this at every scrape: a request the front end has
    finished with but the engine still holds shows there."""
    ENGINE_REQUESTS.set_function(unfinished_requests)


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
            histogram.labels(model, endpoint)
        for counter in (PROMPT_TOKENS, GENERATION_TOKENS):
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
        self._itl = ITL.labels(model, endpoint)
        self._sequences: dict[tuple[int, int], _SequenceTiming] = {}
        self._prompt_tokens: dict[int, int] = {}
        self.output_tokens = 0
        self.speculation: list[SpeculationStats] = []

    @property
    def prompt_tokens(self) -> int:
        return sum(self._prompt_tokens.values())

    def on_output(self, position: int, output: EngineOutput) -> None:
        """Engine output of the request at `position` (one per prompt) arrived. A whole
        reply sent at once (output.token_times set) times its sequences by the engine's
        first and last token; its gaps between tokens are not seen (no ITL)."""
        now = time.perf_counter()
        first = last = now
        if output.token_times is not None:
            first, last = output.token_times.first, output.token_times.last
        self._prompt_tokens[position] = output.prompt_tokens
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
                    TTFT.labels(self.model, self.endpoint).observe(first - self.start)
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
        GENERATION_TOKENS.labels(*labels).inc(self.output_tokens)
        for stats in self.speculation:
            record_speculation(self.model, self.tenant, stats)
        if not completed:
            return
        E2E.labels(self.model, self.endpoint).observe(time.perf_counter() - self.start)
        tpot = TPOT.labels(self.model, self.endpoint)
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
