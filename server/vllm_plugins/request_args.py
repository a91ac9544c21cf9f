"""What specserve's scheduler reads of a vLLM request: the arguments the front end sends in
`SamplingParams.extra_args` (a request's own cap on drafts, its tenant), its logit_bias, and the
ids of the engine's own calibration requests (several processes: the API process writes them,
EngineCore's scheduler reads them); and what the scheduler sends back with a finished sequence
(its lookups' counts). Here rather than in engine/ because the scheduler's code
imports nothing of engine/; no vLLM import, since the API process imports it early.
"""

from typing import Any

# Requests the engine sends at startup to calibrate the cost model.
CALIBRATION_PREFIX = "specserve-calibrate-"
MAX_DRAFT_TOKENS_ARG = "specserve_max_draft_tokens"  # a request's cap, in extra_args
TENANT_ARG = "specserve_tenant"  # whose replies a request may be proposed, in extra_args
NO_LOOKUPS_ARG = "specserve_no_lookups"  # True: the request asked for the draft's proposals only
# The front end's request id: a request's n sequences share it (vLLM copies extra_args).
REQUEST_ARG = "specserve_request"
# The looked-up tokens, verified and accepted, of a request's finished sequences by vLLM's
# sequence id, in the `kv_transfer_params` of each one's last output: the one field of vLLM's
# output that the scheduler fills per sequence and that reaches the front end, unused without
# a KV connector (the engine then has none).
LOOKUP_COUNTS_PARAM = "specserve_lookups"


def extra_arg(request: Any, name: str) -> Any:
    params = request.sampling_params  # None only for pooling requests
    extra = params.extra_args if params is not None else None
    return extra.get(name) if extra else None


def draft_cap(request: Any) -> int | None:
    """The most drafts the request asked to verify per step (None: no cap of its own)."""
    cap = extra_arg(request, MAX_DRAFT_TOKENS_ARG)
    return None if cap is None else int(cap)


def has_logit_bias(request: Any) -> bool:
    params = request.sampling_params
    return params is not None and bool(params.logit_bias)
