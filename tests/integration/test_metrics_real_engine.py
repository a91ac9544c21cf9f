"""Speculation metrics and per-request stats on the real engine, exactly.

A model drafting for itself gets every draft token accepted, so the counts
must match exactly; a different draft must be accepted less; and the stats in
each response must equal what the counters gained for it.
"""

import httpx
import pytest
from prometheus_client import REGISTRY

from tests.integration.conftest import RunningServer

pytestmark = pytest.mark.integration

SPEC_COUNTERS = {
    "drafts": "specserve_spec_decode_drafts_total",
    "draft_tokens": "specserve_spec_decode_draft_tokens_total",
    "accepted_tokens": "specserve_spec_decode_accepted_tokens_total",
}


def counters(model: str) -> dict[str, float]:
    labels = {"model": model, "tenant": "anonymous"}
    values = {
        key: REGISTRY.get_sample_value(name, labels) or 0.0 for key, name in SPEC_COUNTERS.items()
    }
    for position in range(3):
        values[f"pos{position}"] = (
            REGISTRY.get_sample_value(
                "specserve_spec_decode_accepted_tokens_per_position_total",
                {**labels, "position": str(position)},
            )
            or 0.0
        )
    return values


async def complete(server: RunningServer, **body: object) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        response = await http.post("/v1/completions", json={"model": server.model, **body})
    assert response.status_code == 200, response.text
    return response


async def test_self_draft_accepts_every_draft_token(self_draft_server: RunningServer) -> None:
    before = counters("tiny-self")
    response = await complete(
        self_draft_server, prompt="def add(a, b):", max_tokens=40, temperature=0
    )
    summary = response.json()["speculation"]
    delta = {key: value - before[key] for key, value in counters("tiny-self").items()}
    assert summary["applied"] is True
    assert summary["draft_tokens"] > 0
    assert summary["accepted_tokens"] == summary["draft_tokens"]
    assert summary["acceptance_rate"] == 1.0
    assert delta["accepted_tokens"] == delta["draft_tokens"] == summary["draft_tokens"]
    assert delta["drafts"] == summary["drafts"]
    # Every step accepted all K=3 positions, except possibly a shorter last step.
    assert summary["accepted_per_position"][0] == summary["drafts"]
    assert response.headers["x-specserve-acceptance-rate"] == "1.0000"


async def test_other_draft_is_accepted_less_and_counters_match_the_body(
    spec_server: RunningServer,
) -> None:
    before = counters("tiny")
    response = await complete(
        spec_server, prompt=["The weather", "import os"], max_tokens=40, temperature=0
    )
    summary = response.json()["speculation"]
    delta = {key: value - before[key] for key, value in counters("tiny").items()}
    assert 0 < summary["accepted_tokens"] < summary["draft_tokens"]
    assert summary["acceptance_rate"] == summary["accepted_tokens"] / summary["draft_tokens"]
    assert {key: delta[key] for key in SPEC_COUNTERS} == {
        key: summary[key] for key in SPEC_COUNTERS
    }
    assert [delta[f"pos{p}"] for p in range(3)] == summary["accepted_per_position"]
    # Acceptance is a prefix: a later position is never accepted more often.
    per_position = summary["accepted_per_position"]
    assert per_position == sorted(per_position, reverse=True)


async def test_speculation_is_reported_as_skipped_without_a_draft(
    plain_server: RunningServer,
) -> None:
    response = await complete(plain_server, prompt="x", max_tokens=4)
    summary = response.json()["speculation"]
    assert summary["applied"] is False
    assert "disabled" in summary["reason"]
    assert response.headers["x-specserve-speculation-applied"] == "false"


async def test_metrics_endpoint_exposes_vllm_and_specserve(spec_server: RunningServer) -> None:
    await complete(spec_server, prompt="x", max_tokens=8, temperature=0)
    async with httpx.AsyncClient(base_url=spec_server.base_url) as http:
        text = (await http.get("/metrics")).text
    # vLLM keeps one engine's `vllm:*` series per process (the latest engine's,
    # here); the e2e test checks its speculation series on a real server.
    for name in (
        "vllm:time_to_first_token_seconds",
        "specserve_spec_decode_accepted_tokens_total",
        "specserve_time_per_output_token_seconds_bucket",
    ):
        assert name in text, name


async def test_a_whole_reply_is_timed_by_the_engine_a_streamed_one_by_its_chunks(
    spec_server: RunningServer,
) -> None:
    """A reply not streamed is asked of vLLM whole (one output at the end): its TTFT and
    TPOT come from the engine's token times, and it adds no inter-token gaps."""
    labels = {"model": spec_server.model, "endpoint": "/v1/completions", "tenant": "anonymous"}
    names = {
        "ttft": "specserve_time_to_first_token_seconds_sum",
        "tpot": "specserve_time_per_output_token_seconds_sum",
        "tpot_count": "specserve_time_per_output_token_seconds_count",
        "itl_count": "specserve_inter_token_latency_seconds_count",
        "e2e": "specserve_e2e_request_latency_seconds_sum",
    }

    def totals() -> dict[str, float]:
        return {key: REGISTRY.get_sample_value(name, labels) or 0.0 for key, name in names.items()}

    before = totals()
    response = await complete(spec_server, prompt="x", max_tokens=16, temperature=0)
    assert response.json()["usage"]["completion_tokens"] >= 2
    whole = {key: value - before[key] for key, value in totals().items()}
    assert whole["itl_count"] == 0 and whole["tpot_count"] == 1
    assert 0 < whole["ttft"] < whole["e2e"] and whole["tpot"] > 0
    before = totals()
    async with httpx.AsyncClient(base_url=spec_server.base_url, timeout=120) as http:
        body = {"model": spec_server.model, "prompt": "x", "max_tokens": 16, "temperature": 0}
        body["stream"] = True
        async with http.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            await stream.aread()
    streamed = {key: value - before[key] for key, value in totals().items()}
    assert streamed["itl_count"] >= 1 and streamed["tpot_count"] == 1
