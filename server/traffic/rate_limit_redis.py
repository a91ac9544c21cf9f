"""Per-tenant rate limits kept in Redis, so N replicas together enforce one limit.

The buckets are rate_limit.py's, held in one Redis hash per tenant and kind
(level and time), with its rules: a request reserves its estimate of tokens
at admission and settles them when it ends. Each admission and each
settlement is one Lua script, which Redis runs atomically and on its own
clock, so replicas never race or disagree about time, nor overdraw a bucket
between them; a key expires once its bucket would be full again, which is the
same as no key. Both keys of a tenant share a hash tag, so a Redis Cluster
keeps them on one node.

Redis unreachable: `on_store_failure` "open" admits without a limit, "closed"
refuses with 503; either way a warning is logged once per outage and
`specserve_rate_limit_store_failures_total` counts the decisions made without
the store. A request admitted without the store reserved nothing, so its
whole use is charged when it ends. The client reconnects on the next decision,
so the limits return by themselves with Redis. A changed limit (a reloaded key
file) applies from the next decision; a bucket above a lowered limit is cut to
it.
"""

import logging
from typing import Literal

import redis.asyncio
from redis.exceptions import RedisError

from server.errors import OverloadedError
from server.metrics import RATE_LIMIT_STORE_FAILURES, REFUSED
from server.traffic.rate_limit import Admitted, Bucket, TenantLimits, headers, refuse_if_short

logger = logging.getLogger(__name__)

# A decision waits at most this long for Redis before the failure mode applies.
_STORE_TIMEOUT_SECONDS = 0.5

_BUCKETS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local function refilled(key, per_minute)
  local state = redis.call('HMGET', key, 'level', 'time')
  local level, time = tonumber(state[1]), tonumber(state[2])
  if level == nil then return per_minute end
  return math.min(per_minute, level + (now - time) * per_minute / 60)
end
local function fmt(level)
  if level == nil then return '' end
  return string.format('%.17g', level)
end
local function store(key, per_minute, level)
  redis.call('HSET', key, 'level', fmt(level), 'time', string.format('%.17g', now))
  local full_ms = math.ceil((per_minute - level) * 60000 / per_minute)
  redis.call('PEXPIRE', key, math.max(full_ms, 0) + 1000)
end
"""

# KEYS: the requests and tokens buckets; ARGV: their limits per minute (0: none), the
# tokens to reserve. Admits (1), taking one request and the reservation, when every bucket
# covers its part (Bucket.needed: a full tokens bucket covers any reservation), else refuses
# (0); returns that and the levels after it ("" where there is no limit).
_ADMIT = (
    _BUCKETS
    + """
local rpm, tpm, estimate = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local requests, tokens = nil, nil
if rpm > 0 then requests = refilled(KEYS[1], rpm) end
if tpm > 0 then tokens = refilled(KEYS[2], tpm) end
if (requests ~= nil and requests < 1) or (tokens ~= nil and tokens < math.min(estimate, tpm)) then
  return {0, fmt(requests), fmt(tokens)}
end
if requests ~= nil then
  requests = requests - 1
  store(KEYS[1], rpm, requests)
end
if tokens ~= nil then
  tokens = tokens - estimate
  store(KEYS[2], tpm, tokens)
end
return {1, fmt(requests), fmt(tokens)}
"""
)

# KEYS: the tokens bucket; ARGV: its limit per minute, the tokens reserved, the tokens used.
# The difference back or taken (a level past the limit is cut back by the next `refilled`).
_SETTLE = (
    _BUCKETS
    + """
local tpm = tonumber(ARGV[1])
store(KEYS[1], tpm, refilled(KEYS[1], tpm) + tonumber(ARGV[2]) - tonumber(ARGV[3]))
return 1
"""
)


class RedisRateLimiter:
    """The tenants' buckets in the Redis at `url` (redis://, rediss:// or unix://)."""

    def __init__(
        self,
        url: str,
        limits: dict[str, TenantLimits],
        on_store_failure: Literal["open", "closed"],
    ) -> None:
        self._redis = redis.asyncio.Redis.from_url(
            url,
            socket_timeout=_STORE_TIMEOUT_SECONDS,
            socket_connect_timeout=_STORE_TIMEOUT_SECONDS,
        )
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)
        self._limits = limits
        self._on_store_failure = on_store_failure
        self._store_down = False

    def set_limits(self, limits: dict[str, TenantLimits]) -> None:
        self._limits = limits

    async def close(self) -> None:
        await self._redis.aclose()

    async def admit(self, tenant: str, estimate: int) -> Admitted:
        limits = self._limits.get(tenant, TenantLimits())
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if rpm is None and tpm is None:
            return Admitted({}, 0)
        try:
            admitted, *levels = await self._admit(
                keys=_keys(tenant), args=[rpm or 0, tpm or 0, estimate]
            )
        except RedisError as exc:
            self._failed(exc)
            if self._on_store_failure == "closed":
                REFUSED.labels("rate_limit_store_unavailable").inc()
                raise OverloadedError(
                    "Rate limits cannot be checked right now (the limit store is "
                    "unreachable); retry later",
                    headers={"Retry-After": "1"},
                ) from None
            return Admitted({}, 0)
        self._reached()
        requests, tokens = (
            Bucket(per_minute, 0.0, float(level)) if per_minute else None
            for per_minute, level in zip((rpm, tpm), levels, strict=True)
        )
        if not admitted:
            refuse_if_short(tenant, requests, tokens, estimate)
        return Admitted(headers(requests, tokens), estimate if tokens is not None else 0)

    async def settle(self, tenant: str, reserved: int, used: int) -> None:
        tpm = self._limits.get(tenant, TenantLimits()).tokens_per_minute
        if tpm is None:
            return
        try:
            await self._settle(keys=_keys(tenant)[1:], args=[tpm, reserved, used])
        except RedisError as exc:
            self._failed(exc)
            return
        self._reached()

    def _failed(self, exc: RedisError) -> None:
        RATE_LIMIT_STORE_FAILURES.inc()
        if not self._store_down:
            self._store_down = True
            logger.warning(
                "rate limit store unreachable (%s): failing %s until it is back",
                exc,
                self._on_store_failure,
            )

    def _reached(self) -> None:
        if self._store_down:
            self._store_down = False
            logger.info("rate limit store reachable again: limits enforced")


def _keys(tenant: str) -> list[str]:
    return [f"specserve:ratelimit:{{{tenant}}}:{kind}" for kind in ("requests", "tokens")]
