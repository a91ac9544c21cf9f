"""vLLM's requests and outputs on the engine contract (engine/contract.py): the SamplingParams of a
request's options, and each RequestOutput's choices, logprobs, finish reasons, token times and
speculation counts (API process). Imports vllm only inside functions, as the adapter does.
"""

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from server.engine.contract import (
    ChoiceDelta,
    SamplingOptions,
    SpeculationStats,
    TokenLogprob,
    TokenTimes,
)
from server.errors import EngineUnavailableError, InternalError, InvalidRequestError
from server.vllm_plugins.request_args import (
    LOOKUP_COUNTS_PARAM,
    MAX_DRAFT_TOKENS_ARG,
    NO_LOOKUPS_ARG,
    REQUEST_ARG,
    TENANT_ARG,
)


def sampling_params(
    options: SamplingOptions,
    stream: bool = True,
    tenant: str | None = None,
    request_id: str | None = None,
) -> Any:
    """vLLM's SamplingParams for a request's options; what vLLM refuses is a 400."""
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    structured = None
    if options.json_format is not None:
        schema = options.json_format.schema
        structured = StructuredOutputsParams(
            json=schema, json_object=None if schema is not None else True
        )
    try:
        return SamplingParams(
            n=options.n,
            temperature=options.temperature,
            top_p=options.top_p,
            max_tokens=options.max_tokens,
            stop=list(options.stop),
            seed=options.seed,
            logprobs=options.logprobs,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            logit_bias=None if options.logit_bias is None else dict(options.logit_bias),
            structured_outputs=structured,
            # A reply not streamed is wanted whole: no output per step, none of the work
            # each costs this process (vLLM's own server does the same).
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            extra_args=scheduler_args(options, tenant, request_id),
        )
    except (ValueError, VLLMClientError) as exc:
        raise InvalidRequestError(str(exc)) from exc


def choice(
    completion: Any, top_count: int | None, speculation: SpeculationStats | None, tokenizer: Any
) -> ChoiceDelta:
    """One of vLLM's completion outputs as a contract ChoiceDelta."""
    return ChoiceDelta(
        index=completion.index,
        text=completion.text,
        token_ids=list(completion.token_ids),
        logprobs=None if top_count is None else _logprobs(completion, top_count, tokenizer),
        finish_reason=finish_reason(completion.finish_reason),
        speculation=speculation,
    )


def _logprobs(completion: Any, top_count: int, tokenizer: Any) -> list[TokenLogprob]:
    entries = []
    for token_id, alternatives in zip(completion.token_ids, completion.logprobs, strict=True):
        chosen = alternatives[token_id]
        ranked = sorted(alternatives.items(), key=lambda item: item[1].rank or 0)
        entries.append(
            TokenLogprob(
                token=_token_text(tokenizer, token_id, chosen.decoded_token),
                logprob=chosen.logprob,
                top=[
                    (_token_text(tokenizer, tid, lp.decoded_token), lp.logprob)
                    for tid, lp in ranked[:top_count]
                ],
            )
        )
    return entries


def _token_text(tokenizer: Any, token_id: int, decoded: str | None) -> str:
    if decoded is not None:
        return decoded
    return str(tokenizer.decode([token_id]))


def scheduler_args(
    options: SamplingOptions, tenant: str | None, request_id: str | None
) -> dict[str, Any] | None:
    """What the autopilot scheduler reads from a request (vLLM carries it as extra_args)."""
    args: dict[str, Any] = {}
    if options.max_draft_tokens is not None:
        args[MAX_DRAFT_TOKENS_ARG] = options.max_draft_tokens
    if not options.lookups:
        args[NO_LOOKUPS_ARG] = True
    if tenant is not None:
        args[TENANT_ARG] = tenant
    if request_id is not None:
        args[REQUEST_ARG] = request_id
    return args or None


class FinishedLookups:
    """The lookup counts of one request's finished sequences, as the scheduler hands them over:
    each finished sequence's last output carries those of its finished siblings too, keyed by
    vLLM's sequence id (request_args.LOOKUP_COUNTS_PARAM), so that where vLLM merges outputs
    and keeps the last one's transfer params (n sequences, a reader behind), none is lost."""

    def __init__(self) -> None:
        self._seen: dict[str, Mapping[str, int]] = {}
        self._handed = (0, 0)

    def add(self, transfer_params: Mapping[str, Any] | None) -> None:
        self._seen.update((transfer_params or {}).get(LOOKUP_COUNTS_PARAM, {}))

    def take(self) -> tuple[int, int]:
        """Looked-up tokens verified and accepted not yet handed to a finished sequence: a
        sequence gets its own, and where outputs were merged the first gets all they held."""
        verified = sum(c["verified"] for c in self._seen.values())
        accepted = sum(c["accepted"] for c in self._seen.values())
        new = (verified - self._handed[0], accepted - self._handed[1])
        self._handed = (verified, accepted)
        return new


def token_times(stats: Any) -> TokenTimes | None:
    """The first and last token times of vLLM's request stats (the engine core's
    time.monotonic()) on this process's time.perf_counter() clock; None without them."""
    if stats is None or not stats.first_token_ts:
        return None
    offset = time.perf_counter() - time.monotonic()
    return TokenTimes(stats.first_token_ts + offset, stats.last_token_ts + offset)


def finish_reason(reason: str | None) -> str | None:
    """vLLM's reasons in OpenAI's vocabulary; its failures become errors."""
    if reason == "error":
        raise InternalError("the engine failed this request; retry it")
    if reason == "abort":
        raise EngineUnavailableError("the engine aborted this request; retry it")
    if reason == "repetition":
        return "stop"
    return reason


def speculation_stats(
    metrics: Any, tokens: int, lookups: tuple[int, int] = (0, 0)
) -> SpeculationStats:
    """Fold vLLM's per-sequence histogram of accepted draft counts per step; `lookups`: of
    its proposed tokens, those looked up, verified and accepted (FinishedLookups.take).

    `tokens` is the sequence's output length: its first token comes from the
    prefill, each verify step gives its accepted drafts plus one, and every
    other step (K=0) gives one token.
    """
    histogram: list[int] = list(metrics.histogram)
    accepted = sum(j * count for j, count in enumerate(histogram))
    # Acceptance is a prefix: a step with j accepted tokens accepted positions 0..j-1.
    per_position = [
        sum(histogram[j] for j in range(pos + 1, len(histogram)))
        for pos in range(metrics.num_spec_tokens)
    ]
    drafts = sum(histogram)
    steps_by_k = Counter(metrics.per_step_drafted)
    idle_steps = tokens - 1 - (accepted + drafts)
    if idle_steps > 0:
        steps_by_k[0] = idle_steps
    return SpeculationStats(
        drafts=drafts,
        draft_tokens=metrics.num_draft_tokens,
        accepted_tokens=accepted,
        accepted_per_position=per_position,
        steps_by_k=dict(steps_by_k),
        lookup_tokens=lookups[0],
        lookup_accepted_tokens=lookups[1],
    )
