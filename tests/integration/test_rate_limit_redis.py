"""Rate limits kept in a real Redis (Debian's redis-server, installed by `make
tools`): two specserve processes over the scripted engine enforce one tenant's
limit together, and when Redis goes away each follows its failure mode and
enforces the limit again once Redis is back; two limiters on one Redis reserve
and settle a tenant's tokens together."""

import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.launch import wait_until_up
from server.errors import RateLimitError
from server.traffic.rate_limit import TenantLimits
from server.traffic.rate_limit_redis import RedisRateLimiter
from tests.net import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

REQUESTS_PER_MINUTE = 6
BODY = {"model": "scripted", "prompt": "a b", "max_tokens": 2}
KEY = "sk-shared-tenant"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def _specserve(tmp_path: Path, store: str, on_failure: str = "open") -> Iterator[httpx.Client]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    keys = tmp_path / "keys.json"
    entry = {"key": KEY, "tenant": "team", "requests_per_minute": REQUESTS_PER_MINUTE}
    keys.write_text(json.dumps({"keys": [entry]}))
    port = free_port()
    log = tmp_path / f"scripted-{port}.log"
    command = [
        sys.executable, "-m", "tests.scripted_server", "--port", str(port),
        "--api-key-file", str(keys), "--rate-limit-store", store,
        "--rate-limit-on-store-failure", on_failure,
    ]  # fmt: skip
    with log.open("w") as out:
        popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_up(popen, f"{base_url}/health", 120, log)
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
            yield client
    finally:
        popen.kill()
        popen.wait()


def _status(client: httpx.Client) -> int:
    return client.post("/v1/completions", json=BODY).status_code


def test_two_replicas_on_one_redis_admit_the_tenant_s_limit_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with (
        _specserve(tmp_path / "a", redis_server.url) as a,
        _specserve(tmp_path / "b", redis_server.url) as b,
    ):
        started = time.monotonic()
        statuses = [_status(a if i % 2 else b) for i in range(2 * REQUESTS_PER_MINUTE)]
        elapsed = time.monotonic() - started
    # The bucket refills while the requests go out: this many more may pass, however slow.
    refilled = math.floor(REQUESTS_PER_MINUTE * elapsed / 60)
    admitted = statuses.count(200)
    print(f"\n{admitted} of {len(statuses)} admitted in {elapsed:.2f} s: {statuses}")
    assert statuses.count(429) == len(statuses) - admitted
    assert REQUESTS_PER_MINUTE <= admitted <= REQUESTS_PER_MINUTE + refilled
    assert REQUESTS_PER_MINUTE + refilled < 2 * REQUESTS_PER_MINUTE, "too slow to tell"


@pytest.mark.parametrize(("on_failure", "status_without_redis"), [("open", 200), ("closed", 503)])
def test_without_redis_the_failure_mode_applies_and_the_limit_returns_with_it(
    redis_server: RedisServer, tmp_path: Path, on_failure: str, status_without_redis: int
) -> None:
    with _specserve(tmp_path, redis_server.url, on_failure) as client:
        for _ in range(REQUESTS_PER_MINUTE):
            _status(client)
        assert _status(client) == 429
        redis_server.stop()
        assert [_status(client) for _ in range(3)] == [status_without_redis] * 3
        failures = [
            line
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("specserve_rate_limit_store_failures_total ")
        ]
        assert failures and float(failures[0].split()[1]) >= 3
        redis_server.start()  # empty: the tenant's bucket is full again
        # Enforced again: a full bucket's worth passes, then the limit runs out (the bound
        # only stops a test whose limit never returns).
        statuses: list[int] = []
        while 429 not in statuses and len(statuses) < 3 * REQUESTS_PER_MINUTE:
            statuses.append(_status(client))
        print(f"\nafter Redis came back ({on_failure}): {statuses}")
        assert statuses[-1] == 429
        assert statuses.count(200) >= REQUESTS_PER_MINUTE


async def test_two_limiters_on_one_redis_reserve_and_settle_tokens_together(
    redis_server: RedisServer,
) -> None:
    # 60 tokens per minute: the buckets refill one token a second, on Redis's clock.
    limits = {tenant: TenantLimits(tokens_per_minute=60) for tenant in ("team", "big", "full")}
    a = RedisRateLimiter(redis_server.url, limits, "closed")
    b = RedisRateLimiter(redis_server.url, limits, "closed")
    started = time.monotonic()
    try:
        admitted = await a.admit("team", 40)
        assert admitted.reserved_tokens == 40
        assert admitted.headers["x-ratelimit-remaining-tokens"] == "20"
        with pytest.raises(RateLimitError) as refused:
            await b.admit("team", 40)  # the other replica sees the reservation
        assert refused.value.type == "tokens"
        assert "Limit 60, Used 40, Requested 40." in refused.value.message
        await a.settle("team", 40, 10)  # 30 back
        remaining = (await b.admit("team", 40)).headers["x-ratelimit-remaining-tokens"]
        await b.settle("team", 40, 100)  # 60 more than reserved
        with pytest.raises(RateLimitError) as in_debt:
            await a.admit("team", 1)
        refill = math.ceil(time.monotonic() - started)  # at most this many tokens came back
        assert 10 <= int(remaining) <= 10 + refill
        assert 50 - refill <= int(in_debt.value.headers["Retry-After"]) <= 51

        # Larger than a minute's allowance: admitted on the full bucket, into debt.
        admitted = await a.admit("big", 100)
        assert admitted.reserved_tokens == 100
        assert admitted.headers["x-ratelimit-remaining-tokens"] == "0"
        assert admitted.headers["x-ratelimit-reset-tokens"] == "1m40s"
        with pytest.raises(RateLimitError):
            await b.admit("big", 100)

        # A refund never fills a bucket past its limit.
        await a.settle("full", 50, 0)
        assert (await b.admit("full", 60)).headers["x-ratelimit-remaining-tokens"] == "0"
    finally:
        await a.close()
        await b.close()
