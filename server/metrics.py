"""Every specserve Prometheus metric, defined in one place (serving/observer.py feeds them).

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
- share of prompt tokens served from the prefix cache:
    sum(rate(specserve_prompt_cached_tokens_total[5m]))
    / sum(rate(specserve_prompt_tokens_total[5m]))
"""

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

ANONYMOUS_TENANT = "anonymous"
# Endpoint labels are this fixed set (plus "/v1/models/{model}" and "other"),
# so clients cannot grow it; generation endpoints are those reaching the engine.
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
RENDER_ENDPOINTS = tuple(f"{endpoint}/render" for endpoint in GENERATION_ENDPOINTS)
KNOWN_ENDPOINTS = (
    *GENERATION_ENDPOINTS,
    *RENDER_ENDPOINTS,
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
)
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
    "specserve_requests_queued",
    "Sequences (prompts x n) of generation requests waiting for engine slots (queue depth)",
)
RUNNING = Gauge(
    "specserve_requests_running", "Sequences (prompts x n) of generation requests in the engine"
)
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
    ["model", "endpoint", "tenant"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
ITL = Histogram(
    "specserve_inter_token_latency_seconds",
    "Gap between consecutive outputs of one streamed sequence (each chunk)",
    ["model", "endpoint", "tenant"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
TPOT = Histogram(
    "specserve_time_per_output_token_seconds",
    "(last token - first token) / (output tokens - 1), per sequence",
    ["model", "endpoint", "tenant"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
E2E = Histogram(
    "specserve_e2e_request_latency_seconds", "Request arrival to last token",
    ["model", "endpoint", "tenant"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
PROMPT_TOKENS = Counter(
    "specserve_prompt_tokens_total", "Prompt tokens processed", ["model", "endpoint", "tenant"]
)
GENERATION_TOKENS = Counter(
    "specserve_generation_tokens_total", "Tokens generated", ["model", "endpoint", "tenant"]
)
PROMPT_CACHED_TOKENS = Counter(
    "specserve_prompt_cached_tokens_total",
    "Prompt tokens whose KV cache was reused from an earlier request (prefix cache hits)",
    ["model", "endpoint", "tenant"],
)  # fmt: skip
TTFT_BY_PROMPT_CACHE = Histogram(
    "specserve_time_to_first_token_by_prompt_cache_seconds",
    "Request arrival to first generated token, by whether any prompt token came from the "
    "prefix cache (prompt_cache hit or miss)",
    ["model", "endpoint", "prompt_cache"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
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
# Acceptance by source: rate(..._accepted_tokens_by_source_total[5m])
#   / rate(..._draft_tokens_by_source_total[5m]), per source.
SPEC_SOURCE_DRAFT_TOKENS = Counter(
    "specserve_spec_decode_draft_tokens_by_source_total",
    "Proposed tokens the target verified, by source (draft: the draft model; lookup: looked "
    "up in the request's context or its tenant's earlier replies, --speculative-method hybrid)",
    ["model", "source"],
)  # fmt: skip
SPEC_SOURCE_ACCEPTED_TOKENS = Counter(
    "specserve_spec_decode_accepted_tokens_by_source_total",
    "Proposed tokens the target accepted, by source (draft or lookup)",
    ["model", "source"],
)  # fmt: skip
LOOKUP_INDEX_TOKENS = Gauge(
    "specserve_lookup_index_tokens",
    "Tokens of recent replies held for lookups (--lookup-index-tokens bounds it)",
    ["model"],
)  # fmt: skip
AUTOPILOT_REPORTS_DROPPED = Counter(
    "specserve_autopilot_reports_dropped_total",
    "Reports of vLLM's engine processes to the front end that were dropped: unsent (the "
    "sender could not send it, over the size cap or refused) or unreadable (the front end "
    "could not read it); the next report carries the totals again "
    "(server/engine/autopilot_feed.py)",
    ["model", "reason"],
)
VLLM_PATCH_FAILURES = Counter(
    "specserve_vllm_patch_failures_total",
    "Engine processes where a specserve patch of vLLM raised and was handed back to vLLM's "
    "own code for the rest of the run (server/vllm_plugins/registry.py)",
    ["model", "patch"],
)


def track_engine_requests(unfinished_requests: Callable[[], int]) -> None:
    """specserve_engine_requests reads this at every scrape: a request the front end has
    finished with but the engine still holds shows there."""
    ENGINE_REQUESTS.set_function(unfinished_requests)
