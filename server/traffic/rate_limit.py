"""Per-tenant rate limits: requests per minute and tokens per minute.

Each limit is a bucket that holds one minute's allowance and refills
continuously, so a tenant may burst up to its limit and then proceeds at the
limit's pace. As with OpenAI, every admitted request counts, including ones
that fail later.

Tokens are reserved at admission and settled at the end. A request reserves
an estimate of its tokens (the admission middleware's: its prompt's, plus the
most it may generate) and is refused while the bucket cannot cover it, so
concurrent requests cannot overdraw the tenant's allowance. A request larger
than a whole minute's allowance is admitted when the bucket is full (else it
could never run) and leaves it in debt. OpenAI refuses such a request
outright ("Request too large"), but here a request without `max_tokens` may
fill the model's context and reserves that, and a tenant whose limit is below
the context length could then never send one. When the request ends its
actual tokens (prompt plus generated) replace the reservation: the difference
is refunded (never past the bucket's size: the bucket is read only through a
refill, which caps it), or charged when it used more.

Responses carry OpenAI's headers: `x-ratelimit-limit-*`, `x-ratelimit-remaining-*`
(what is left once this request and its reservation are taken) and
`x-ratelimit-reset-*` (time until the bucket is full again, as "6m0s", "1.5s",
"20ms"); a refusal adds `Retry-After` in whole seconds.

`RateLimiter` keeps the buckets in this process; `rate_limit_redis` keeps the
same buckets in Redis, shared by every replica. Both are a `TenantRateLimiter`.
"""

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from server.errors import RateLimitError
from server.metrics import REFUSED


@dataclass(frozen=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True)
class Admitted:
    headers: dict[str, str]  # the response's rate-limit headers
    # Taken from the tenant's token bucket: 0 without a tokens-per-minute limit, or when
    # admitted without the limit store.
    reserved_tokens: int


class TenantRateLimiter(Protocol):
    async def admit(self, tenant: str, estimate: int) -> Admitted:
        """Count one request for `tenant` and reserve its `estimate` of tokens, or raise
        `RateLimitError` (429)."""

    async def settle(self, tenant: str, reserved: int, used: int) -> None:
        """A request ended: charge the tokens it `used` in place of those it `reserved`."""

    def set_limits(self, limits: dict[str, TenantLimits]) -> None:
        """Put new limits in force (a reloaded key file)."""

    async def close(self) -> None:
        """Let go of what it holds outside the process (connections) at shutdown."""


class Bucket:
    """One limit: its allowance per minute and what is left of it now."""

    def __init__(self, per_minute: int, now: float, level: float | None = None) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute) if level is None else level
        self._updated = now

    def refill(self, now: float) -> None:
        gained = (now - self._updated) * self.per_minute / 60
        self.level = min(float(self.per_minute), self.level + gained)
        self._updated = now

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) * 60 / self.per_minute)

    def needed(self, amount: int) -> int:
        """The level at which the bucket covers `amount`: more than a minute's allowance is
        covered by a full bucket, else it could never be."""
        return min(amount, self.per_minute)

    def headers(self, kind: str) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{kind}": str(self.per_minute),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(self.level))),
            f"x-ratelimit-reset-{kind}": format_duration(self.seconds_until(self.per_minute)),
        }


class RateLimiter:
    """The buckets of every tenant with limits; tenants without are unlimited."""

    def __init__(
        self, limits: dict[str, TenantLimits], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._requests: dict[str, Bucket] = {}
        self._tokens: dict[str, Bucket] = {}
        # Settlements arrive from request teardown; keep updates whole.
        self._lock = threading.Lock()
        self.set_limits(limits)

    async def close(self) -> None:
        return None  # all in this process

    def set_limits(self, limits: dict[str, TenantLimits]) -> None:
        """Put new limits in force (a reloaded key file): a tenant whose limit is unchanged
        keeps its bucket as it is; a new or changed limit starts full; others go."""
        with self._lock:
            now = self._clock()
            self._requests = _buckets(
                self._requests, {t: v.requests_per_minute for t, v in limits.items()}, now
            )
            self._tokens = _buckets(
                self._tokens, {t: v.tokens_per_minute for t, v in limits.items()}, now
            )

    async def admit(self, tenant: str, estimate: int) -> Admitted:
        with self._lock:
            now = self._clock()
            requests, tokens = self._requests.get(tenant), self._tokens.get(tenant)
            for bucket in (requests, tokens):
                if bucket is not None:
                    bucket.refill(now)
            refuse_if_short(tenant, requests, tokens, estimate)
            if requests is not None:
                requests.level -= 1
            if tokens is None:
                return Admitted(headers(requests, tokens), 0)
            tokens.level -= estimate
            return Admitted(headers(requests, tokens), estimate)

    async def settle(self, tenant: str, reserved: int, used: int) -> None:
        with self._lock:
            bucket = self._tokens.get(tenant)
            if bucket is not None:
                bucket.refill(self._clock())
                # A refund may lift the level past the limit: the next refill cuts it back.
                bucket.level += reserved - used


def _buckets(
    current: dict[str, Bucket], per_minute: dict[str, int | None], now: float
) -> dict[str, Bucket]:
    return {
        tenant: current[tenant]
        if tenant in current and current[tenant].per_minute == limit
        else Bucket(limit, now)
        for tenant, limit in per_minute.items()
        if limit is not None
    }


def headers(requests: Bucket | None, tokens: Bucket | None) -> dict[str, str]:
    """The response's rate-limit headers for a tenant's buckets (None: no such limit)."""
    result = {}
    for kind, bucket in (("requests", requests), ("tokens", tokens)):
        if bucket is not None:
            result.update(bucket.headers(kind))
    return result


def refuse_if_short(
    tenant: str, requests: Bucket | None, tokens: Bucket | None, estimate: int
) -> None:
    """Raise the 429 for the first bucket (requests, then tokens) that cannot cover one
    request and its `estimate` of tokens, counted."""
    for kind, bucket, amount in (("requests", requests, 1), ("tokens", tokens, estimate)):
        if bucket is not None and bucket.level < bucket.needed(amount):
            REFUSED.labels(f"rate_limit_{kind}").inc()
            wait = bucket.seconds_until(bucket.needed(amount))
            used = bucket.per_minute - math.floor(bucket.level)
            short = "RPM" if kind == "requests" else "TPM"
            raise RateLimitError(
                f"Rate limit reached for tenant {tenant} on {kind} per min ({short}): "
                f"Limit {bucket.per_minute}, Used {used}, Requested {amount}. "
                f"Please try again in {format_duration(wait)}.",
                kind=kind,
                headers={
                    **headers(requests, tokens),
                    "Retry-After": str(max(1, math.ceil(wait))),
                },
            )


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 1):g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"
