"""specserve's metrics and per-request speculation stats, over the scripted engine."""

import math
from dataclasses import replace

import httpx
import pytest
from prometheus_client import REGISTRY

from server.api.instrumentation import endpoint_label
from server.app import create_app
from server.engine.contract import (
    ChoiceDelta,
    EngineInfo,
    EngineOutput,
    SpeculationStats,
    TokenTimes,
)
from server.serving.observer import RequestObserver, SpeculationWindow
from tests.unit.scripted_engine import SCRIPTED_SPECULATION, ScriptedEngine
from tests.unit.sse import events


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


SPEC = {"model": "scripted", "tenant": "anonymous"}
BODY = {"model": "scripted", "prompt": "a b", "max_tokens": 2}
LATENCY = {"model": "scripted", "endpoint": "/v1/completions", "tenant": "anonymous"}


async def test_a_request_updates_counts_latency_and_speculation(client: httpx.AsyncClient) -> None:
    names = {
        "ok": ("specserve_requests_total", {"endpoint": "/v1/completions", "status": "200"}),
        "tokens": ("specserve_generation_tokens_total", LATENCY),
        "prompt": ("specserve_prompt_tokens_total", LATENCY),
        "ttft": ("specserve_time_to_first_token_seconds_count", LATENCY),
        "itl": ("specserve_inter_token_latency_seconds_count", LATENCY),
        "tpot": ("specserve_time_per_output_token_seconds_count", LATENCY),
        "e2e": ("specserve_e2e_request_latency_seconds_count", LATENCY),
        "drafts": ("specserve_spec_decode_drafts_total", SPEC),
        "draft_tokens": ("specserve_spec_decode_draft_tokens_total", SPEC),
        "accepted": ("specserve_spec_decode_accepted_tokens_total", SPEC),
        "pos0": ("specserve_spec_decode_accepted_tokens_per_position_total",
                 {**SPEC, "position": "0"}),
        "per_request": ("specserve_request_acceptance_rate_count", {"model": "scripted"}),
    }  # fmt: skip
    for stream, itl in [(True, 6), (False, 0)]:
        before = {key: sample(name, **labels) for key, (name, labels) in names.items()}
        body = {"model": "scripted", "prompt": "a b", "max_tokens": 4, "n": 2, "stream": stream}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200
        delta = {key: sample(name, **labels) - before[key] for key, (name, labels) in names.items()}
        # n=2: one TTFT and e2e for the request; per sequence one TPOT, the scripted
        # speculation stats and, streamed, 3 gaps (a whole reply's gaps are not seen).
        assert delta == {
            "ok": 1, "tokens": 8, "prompt": 2, "ttft": 1, "itl": itl, "tpot": 2, "e2e": 1,
            "drafts": 4, "draft_tokens": 12, "accepted": 8, "pos0": 4, "per_request": 2,
        }  # fmt: skip


async def test_body_and_headers_carry_the_request_speculation(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "model": "scripted",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
        },
    )
    summary = response.json()["speculation"]
    stats = SCRIPTED_SPECULATION
    assert summary == {
        "applied": True, "reason": None, "mode": "fixed", "method": "draft_model",
        "num_speculative_tokens": 3, "steps_by_k": {},
        "drafts": stats.drafts, "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "accepted_per_position": stats.accepted_per_position,
        "acceptance_rate": 4 / 6, "mean_acceptance_length": 1 + 4 / 2, "by_source": None,
    }  # fmt: skip
    assert response.headers["x-specserve-speculation-applied"] == "true"
    assert response.headers["x-specserve-draft-tokens"] == "6"
    assert response.headers["x-specserve-accepted-tokens"] == "4"
    assert response.headers["x-specserve-acceptance-rate"] == "0.6667"


async def test_the_hybrid_splits_each_response_s_counts_by_source(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    engine.speculative_method = "hybrid"
    engine.speculation = replace(SCRIPTED_SPECULATION, lookup_tokens=4, lookup_accepted_tokens=3)
    body = {"model": "scripted", "prompt": "a b", "max_tokens": 4, "n": 2}
    summary = (await client.post("/v1/completions", json=body)).json()["speculation"]
    # Two sequences, each 6 proposed tokens (4 looked up) and 4 accepted (3 looked up).
    assert (summary["draft_tokens"], summary["accepted_tokens"]) == (12, 8)
    assert summary["by_source"] == {
        "draft": {"draft_tokens": 4, "accepted_tokens": 2},
        "lookup": {"draft_tokens": 8, "accepted_tokens": 6},
    }


async def test_stream_usage_chunk_carries_the_speculation(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "model": "scripted",
            "prompt": "x",
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    final = events(response.text)[-2]
    assert final["usage"]["completion_tokens"] == 2
    assert final["speculation"]["accepted_tokens"] == 4
    assert all(chunk["speculation"] is None for chunk in events(response.text)[:-2])


async def test_refused_requests_are_counted_by_status(client: httpx.AsyncClient) -> None:
    labels = {"endpoint": "/v1/completions", "status": "400"}
    before = sample("specserve_requests_total", **labels)
    await client.post("/v1/completions", json={"model": "scripted", "prompt": "x", "n": 0})
    assert sample("specserve_requests_total", **labels) == before + 1
    assert sample("specserve_requests_in_flight", endpoint="/v1/completions") == 0


async def test_metrics_endpoint_serves_prometheus_text(client: httpx.AsyncClient) -> None:
    await client.get("/v1/models")
    response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert "specserve_requests_total{" in response.text
    assert "specserve_spec_decode_acceptance_rate_window" in response.text


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/v1/completions", "/v1/completions"),
        ("/v1/models/x", "/v1/models/{model}"),
        ("/v1/chat/completions/render", "/v1/chat/completions/render"),
        ("/random/123", "other"),
        ("/v1/completions/extra", "other"),
    ],
)
def test_endpoint_labels_are_bounded(path: str, label: str) -> None:
    assert endpoint_label(path) == label


def test_speculation_window_forgets_old_requests() -> None:
    now = [100.0]
    window = SpeculationWindow(60, clock=lambda: now[0])
    assert math.isnan(window.acceptance_rate())
    window.add(
        SpeculationStats(
            drafts=4, draft_tokens=12, accepted_tokens=12, accepted_per_position=[4, 4, 4]
        )
    )
    now[0] = 130.0
    window.add(
        SpeculationStats(
            drafts=4, draft_tokens=12, accepted_tokens=0, accepted_per_position=[0, 0, 0]
        )
    )
    assert window.acceptance_rate() == 0.5
    assert window.mean_acceptance_length() == 1 + 12 / 8
    now[0] = 161.0
    assert window.acceptance_rate() == 0.0
    assert window.mean_acceptance_length() == 1.0
    now[0] = 200.0
    assert math.isnan(window.mean_acceptance_length())


def test_speculation_window_stays_bounded_without_scrapes() -> None:
    """Nothing reads the window here (no scraper): inserts alone drop what is out of it."""
    now = [0.0]
    window = SpeculationWindow(60, clock=lambda: now[0])
    stats = SpeculationStats(
        drafts=1, draft_tokens=2, accepted_tokens=1, accepted_per_position=[1, 0]
    )
    for second in range(600):
        now[0] = float(second)
        window.add(stats)
    assert len(window._entries) == 61  # the requests of seconds 539..599


class _FreshModelEngine(ScriptedEngine):
    """A model name no other test uses, so its series start from nothing."""

    def info(self) -> EngineInfo:
        return replace(super().info(), model_name="fresh-at-startup")


async def test_startup_creates_the_latency_and_count_series_at_zero() -> None:
    app = create_app(_FreshModelEngine())
    latency = {
        "model": "fresh-at-startup",
        "endpoint": "/v1/chat/completions",
        "tenant": "anonymous",
    }
    assert REGISTRY.get_sample_value("specserve_time_to_first_token_seconds_count", latency) is None
    async with app.router.lifespan_context(app):
        for name in (
            "specserve_time_to_first_token_seconds_count",
            "specserve_inter_token_latency_seconds_count",
            "specserve_time_per_output_token_seconds_count",
            "specserve_e2e_request_latency_seconds_count",
        ):
            assert REGISTRY.get_sample_value(name, latency) == 0, name
        tokens = latency
        assert REGISTRY.get_sample_value("specserve_generation_tokens_total", tokens) == 0
        assert REGISTRY.get_sample_value("specserve_prompt_tokens_total", tokens) == 0
        for status in ("200", "400", "429", "499", "503", "504"):
            labels = {"endpoint": "/v1/chat/completions", "status": status}
            assert REGISTRY.get_sample_value("specserve_requests_total", labels) is not None
        assert (
            REGISTRY.get_sample_value(
                "specserve_requests_total", {"endpoint": "/health", "status": "200"}
            )
            is not None
        )


async def test_with_a_metrics_port_metrics_are_served_there_and_only_there() -> None:
    transport = httpx.ASGITransport(app=create_app(ScriptedEngine(), metrics_port=9400))
    async with httpx.AsyncClient(transport=transport) as client:
        api, metrics = "http://server:8000", "http://server:9400"
        assert (await client.get(f"{api}/v1/models")).status_code == 200
        hidden = await client.get(f"{api}/metrics")
        assert hidden.status_code == 404
        assert hidden.json()["error"]["message"] == "/metrics is not served on the API port"
        scraped = await client.get(f"{metrics}/metrics")
        assert scraped.status_code == 200 and "specserve_requests_total{" in scraped.text
        for path in ("/v1/models", "/health", "/docs"):
            assert (await client.get(f"{metrics}{path}")).status_code == 404


async def test_the_engine_requests_gauge_reads_the_engine_at_each_scrape() -> None:
    engine = ScriptedEngine()
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
            assert sample("specserve_engine_requests") == 0
            engine.unfinished = 3  # as if three requests were stuck in the engine
            scraped = (await client.get("/metrics")).text
            assert "specserve_engine_requests 3.0" in scraped.splitlines()


def test_a_whole_reply_is_timed_by_its_engine_token_times_not_by_its_arrival() -> None:
    """A reply not streamed arrives in one output at the end: its TTFT and TPOT are the
    engine's first and last token times, which its arrival cannot tell."""
    labels = {"model": "whole-reply", "endpoint": "/v1/chat/completions", "tenant": "team"}
    observer = RequestObserver("whole-reply", labels["endpoint"], 100.0, "team")
    choice = ChoiceDelta(0, "a b c d e", [1, 2, 3, 4, 5], finish_reason="stop")
    observer.on_output(0, EngineOutput(3, [choice], TokenTimes(first=101.0, last=103.0)))
    observer.finish(completed=True)
    assert sample("specserve_time_to_first_token_seconds_sum", **labels) == 1.0
    assert sample("specserve_time_per_output_token_seconds_sum", **labels) == 0.5
    assert sample("specserve_inter_token_latency_seconds_count", **labels) == 0
    assert observer.output_tokens == 5
