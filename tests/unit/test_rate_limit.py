"""Per-tenant rate limits: buckets, tokens reserved at admission and settled at the end,
OpenAI's 429 shape and headers, key-file limits."""

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest

from server.app import create_app
from server.config import ConfigError
from server.errors import RateLimitError
from server.traffic.api_keys import ApiKeys, KeyRing, load_key_ring
from server.traffic.rate_limit import Admitted, RateLimiter, TenantLimits, format_duration
from tests.unit.scripted_engine import ScriptedEngine

BODY = {"model": "scripted", "prompt": "a b", "max_tokens": 2}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_requests_per_minute_allows_a_burst_then_refills_at_the_limit_pace() -> None:
    clock = Clock()
    limiter = RateLimiter({"a": TenantLimits(requests_per_minute=3)}, clock)
    remaining = [
        (await limiter.admit("a", 1)).headers["x-ratelimit-remaining-requests"] for _ in range(3)
    ]
    assert remaining == ["2", "1", "0"]
    with pytest.raises(RateLimitError) as refused:
        await limiter.admit("a", 1)
    assert refused.value.status == 429
    assert refused.value.type == "requests"
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.headers["Retry-After"] == "20"  # one request refills in 60/3 s
    assert "Limit 3, Used 3" in refused.value.message
    clock.now += 20
    assert (await limiter.admit("a", 1)).headers["x-ratelimit-remaining-requests"] == "0"


async def test_a_reservation_the_bucket_cannot_cover_is_refused() -> None:
    clock = Clock()
    limiter = RateLimiter({"a": TenantLimits(tokens_per_minute=600)}, clock)  # 10 tokens/s
    admitted = await limiter.admit("a", 400)
    assert admitted.reserved_tokens == 400
    assert admitted.headers["x-ratelimit-remaining-tokens"] == "200"
    assert admitted.headers["x-ratelimit-reset-tokens"] == "40s"
    with pytest.raises(RateLimitError) as refused:
        await limiter.admit("a", 300)
    assert refused.value.type == "tokens"
    assert refused.value.message == (
        "Rate limit reached for tenant a on tokens per min (TPM): Limit 600, Used 400, "
        "Requested 300. Please try again in 10s."
    )
    assert refused.value.headers["Retry-After"] == "10"
    assert refused.value.headers["x-ratelimit-remaining-tokens"] == "200"
    clock.now += 10
    assert (await limiter.admit("a", 300)).headers["x-ratelimit-remaining-tokens"] == "0"


async def test_settling_refunds_the_unused_reservation_never_past_the_limit() -> None:
    clock = Clock()
    limiter = RateLimiter({"a": TenantLimits(tokens_per_minute=600)}, clock)
    await limiter.admit("a", 400)
    await limiter.settle("a", 400, 100)  # 300 back
    assert (await limiter.admit("a", 500)).headers["x-ratelimit-remaining-tokens"] == "0"
    clock.now += 60  # full again while a request of 500 still runs
    await limiter.settle("a", 500, 0)  # its refund finds the bucket full: 600, not 1100
    assert (await limiter.admit("a", 600)).headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimitError):
        await limiter.admit("a", 1)


async def test_settling_charges_what_was_used_beyond_the_reservation() -> None:
    clock = Clock()
    limiter = RateLimiter({"a": TenantLimits(tokens_per_minute=600)}, clock)
    await limiter.admit("a", 100)
    await limiter.settle("a", 100, 900)  # 800 more than reserved: the bucket owes 300
    with pytest.raises(RateLimitError) as refused:
        await limiter.admit("a", 1)
    assert refused.value.type == "tokens"
    assert "Limit 600, Used 900, Requested 1." in refused.value.message
    # From -300 to 1 token at 10 tokens/s.
    assert refused.value.headers["Retry-After"] == "31"
    clock.now += 31
    headers = (await limiter.admit("a", 1)).headers
    assert headers["x-ratelimit-remaining-tokens"] == "9"
    assert headers["x-ratelimit-reset-tokens"] == "59.1s"


async def test_a_request_larger_than_a_minute_s_allowance_runs_on_a_full_bucket() -> None:
    clock = Clock()
    limiter = RateLimiter({"a": TenantLimits(tokens_per_minute=600)}, clock)
    await limiter.settle("a", 0, 1)  # a token short of full
    with pytest.raises(RateLimitError) as refused:
        await limiter.admit("a", 1000)
    assert "Used 1, Requested 1000. Please try again in 100ms." in refused.value.message
    clock.now += 0.1  # full: it can never have more
    admitted = await limiter.admit("a", 1000)
    assert admitted.reserved_tokens == 1000
    assert admitted.headers["x-ratelimit-remaining-tokens"] == "0"
    # It left the bucket 400 in debt: from -400 to full, at 10 tokens/s.
    assert admitted.headers["x-ratelimit-reset-tokens"] == "1m40s"
    with pytest.raises(RateLimitError):
        await limiter.admit("a", 1)
    await limiter.settle("a", 1000, 250)
    assert (await limiter.admit("a", 350)).headers["x-ratelimit-remaining-tokens"] == "0"


async def test_tenants_are_independent_and_unlisted_ones_unlimited() -> None:
    limiter = RateLimiter({"a": TenantLimits(requests_per_minute=1)}, Clock())
    assert (await limiter.admit("a", 10)).reserved_tokens == 0  # no tokens limit: no reservation
    with pytest.raises(RateLimitError):
        await limiter.admit("a", 1)
    for _ in range(100):
        assert await limiter.admit("b", 10**6) == Admitted({}, 0)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.017, "17ms"), (1.0, "1s"), (8.44, "8.4s"), (360, "6m0s")]
)
def test_reset_durations_use_openai_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@asynccontextmanager
async def tenant_client(limits: TenantLimits) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app whose only key belongs to a tenant with `limits`."""
    keys = ApiKeys(KeyRing({"sk-a": "team-a"}, {"team-a": limits}))
    transport = httpx.ASGITransport(app=create_app(ScriptedEngine(), api_keys=keys))
    headers = {"Authorization": "Bearer sk-a"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers=headers
    ) as client:
        yield client


async def test_over_limit_requests_get_429_with_openai_headers() -> None:
    async with tenant_client(TenantLimits(requests_per_minute=2)) as client:
        first = await client.post("/v1/completions", json=BODY)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        stream = {**BODY, "stream": True}
        second = await client.post("/v1/completions", json=stream)
        assert second.status_code == 200
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        third = await client.post("/v1/chat/completions", json={})
        assert third.status_code == 429
        assert third.json()["error"]["code"] == "rate_limit_exceeded"
        assert third.json()["error"]["type"] == "requests"
        assert int(third.headers["retry-after"]) >= 1
        assert third.headers["x-ratelimit-remaining-requests"] == "0"
        # Listing models is not rate limited.
        assert (await client.get("/v1/models")).status_code == 200


async def test_a_request_reserves_its_estimate_and_settles_its_usage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A stopped clock: the bucket does not refill between the two requests,
    # however long the machine takes to serve the first.
    monkeypatch.setattr("server.app.RateLimiter", partial(RateLimiter, clock=Clock()))
    body = {**BODY, "max_tokens": 50}  # more than the script's seven words
    reserved = 1 + 50  # "a b" is a token at four bytes a token, plus max_tokens
    async with tenant_client(TenantLimits(tokens_per_minute=100)) as client:
        first = await client.post("/v1/completions", json=body)
        used = first.json()["usage"]["total_tokens"]
        second = await client.post("/v1/completions", json=body)
    assert used < reserved
    assert first.headers["x-ratelimit-remaining-tokens"] == str(100 - reserved)
    # The first's unused reservation came back; the second's is taken.
    assert second.headers["x-ratelimit-remaining-tokens"] == str(100 - used - reserved)


def test_key_file_limits_are_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    entries = [
        {"key": "k1", "tenant": "a", "requests_per_minute": 60, "tokens_per_minute": 1000},
        {"key": "k2", "tenant": "a", "requests_per_minute": 60, "tokens_per_minute": 1000},
        {"key": "k3", "tenant": "b"},
    ]
    path.write_text(json.dumps({"keys": entries}))
    ring = load_key_ring(path)
    assert ring.limits == {"a": TenantLimits(60, 1000), "b": TenantLimits()}
    for bad in (
        [{"key": "k1", "tenant": "a", "requests_per_minute": 0}],
        [{"key": "k1", "tenant": "a", "tokens_per_minute": "many"}],
        [
            {"key": "k1", "tenant": "a", "requests_per_minute": 1},
            {"key": "k2", "tenant": "a", "requests_per_minute": 2},
        ],
    ):
        path.write_text(json.dumps({"keys": bad}))
        with pytest.raises(ConfigError):
            load_key_ring(path)


async def test_new_limits_apply_at_once_and_unchanged_buckets_keep_their_level() -> None:
    limiter = RateLimiter(
        {"a": TenantLimits(requests_per_minute=2), "b": TenantLimits(requests_per_minute=5)},
        Clock(),
    )
    await limiter.admit("a", 1)
    await limiter.admit("a", 1)
    limiter.set_limits(
        {"a": TenantLimits(requests_per_minute=2), "b": TenantLimits(requests_per_minute=1)}
    )
    with pytest.raises(RateLimitError):
        await limiter.admit("a", 1)  # unchanged limit: its spent bucket is not refilled by a reload
    # A new limit starts full.
    assert (await limiter.admit("b", 1)).headers["x-ratelimit-limit-requests"] == "1"
    with pytest.raises(RateLimitError):
        await limiter.admit("b", 1)
    limiter.set_limits({})
    for _ in range(5):
        assert await limiter.admit("a", 1) == Admitted({}, 0)  # no limit any more


async def test_a_reloaded_key_file_brings_its_tenants_limits(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "sk-a", "tenant": "team-a"}]}))
    keys = ApiKeys(load_key_ring(path), path)
    transport = httpx.ASGITransport(app=create_app(ScriptedEngine(), api_keys=keys))
    headers = {"Authorization": "Bearer sk-a"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers=headers
    ) as client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        entry = {"key": "sk-a", "tenant": "team-a", "requests_per_minute": 1}
        path.write_text(json.dumps({"keys": [entry]}))
        assert keys.reload()
        first = await client.post("/v1/completions", json=BODY)
        assert first.headers["x-ratelimit-limit-requests"] == "1"
        assert (await client.post("/v1/completions", json=BODY)).status_code == 429
