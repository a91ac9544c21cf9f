"""Speculation figures from the server's Prometheus counters, as deltas over a run.

specserve exports `specserve_spec_decode_*` (per request, per tenant); vLLM's
own server exports `vllm:spec_decode_*` (specserve serves those too). The
specserve family wins when both are there, so a run against vLLM's server
works unchanged. Derived figures, as both servers' docs define them:
acceptance rate = accepted / draft tokens; mean acceptance length =
1 + accepted / drafts; acceptance at position p = accepted at p / drafts.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

FAMILIES = {
    "specserve": (
        "specserve_spec_decode_drafts_total",
        "specserve_spec_decode_draft_tokens_total",
        "specserve_spec_decode_accepted_tokens_total",
        "specserve_spec_decode_accepted_tokens_per_position_total",
    ),
    "vllm": (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    ),
}
SPECULATIVE_TOKENS = "specserve_speculative_tokens"


@dataclass
class SpecCounters:
    source: str  # "specserve" or "vllm"
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        return SpecCounters(
            self.source,
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            {p: v - before.per_position.get(p, 0.0) for p, v in sorted(self.per_position.items())},
        )

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        positions = sorted(set(self.per_position) | set(other.per_position))
        return SpecCounters(
            self.source,
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted + other.accepted,
            {p: self.per_position.get(p, 0.0) + other.per_position.get(p, 0.0) for p in positions},
        )

    def figures(self) -> dict[str, Any]:
        """Counts and derived rates; rates are NaN when nothing was drafted."""
        return {
            "source": self.source,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else math.nan,
            "mean_acceptance_length": 1 + self.accepted / self.drafts if self.drafts else math.nan,
            "acceptance_by_position": [
                self.per_position[p] / self.drafts if self.drafts else math.nan
                for p in sorted(self.per_position)
            ],
        }


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value)]}; text that is not the
    exposition format (a page that is not metrics) has none."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found.setdefault(sample.name, []).append((sample.labels, sample.value))
    except ValueError:
        return {}
    return found


def parse(text: str) -> SpecCounters | None:
    """Speculation counters summed over labels; None if the server has none."""
    found = samples(text)
    for source, (drafts, draft_tokens, accepted, per_position) in FAMILIES.items():
        if drafts not in found:
            continue
        counters = SpecCounters(
            source,
            sum(v for _, v in found[drafts]),
            sum(v for _, v in found.get(draft_tokens, [])),
            sum(v for _, v in found.get(accepted, [])),
        )
        for labels, value in found.get(per_position, []):
            if "position" in labels:
                position = int(labels["position"])
                counters.per_position[position] = counters.per_position.get(position, 0) + value
        return counters
    return None


def speculative_tokens(text: str) -> int | None:
    """specserve's configured K (0 without speculation), if it says."""
    values = samples(text).get(SPECULATIVE_TOKENS)
    return int(max(v for _, v in values)) if values else None


async def scrape(client: httpx.AsyncClient, url: str = "/metrics") -> str | None:
    """The server's metrics text (`url`: a path on its base URL, or a URL of its own),
    or None if it has none or refuses."""
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None
