"""Two specserve replicas (processes on the tiny pair) behind the real vllm-router on
loopback, with API keys and one Redis for their rate limits: replies plain and streamed
through the router, a repeated prefix kept on one replica by `cache_aware` (seen in
`cached_tokens` and the replicas' counters), one tenant's limit held once across both,
and failover: a drained replica finishes its streams and gets no new request, a killed
one fails only the streams it held, and each rejoins once it is ready again."""

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from loadtest.launch import wait_until_up
from loadtest.promscrape import samples
from loadtest.router import healthy_workers, router_command, wait_all_healthy
from tests.integration.conftest import STARTUP_SECONDS, TinyModels, tiny_serve_command
from tests.net import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

KEY, LIMITED_KEY = "sk-router-team", "sk-router-limited"
REQUESTS_PER_MINUTE = 6
# Long enough that every stream is still running when a replica goes away.
LONG_STREAM_TOKENS = 1500
CHAT = "/v1/chat/completions"


@dataclass
class Replica:
    """One `specserve serve` process on fixed ports, so that it can be started again at the
    URL the router knows."""

    command: list[str]
    log: Path
    port: int
    metrics_port: int
    popen: subprocess.Popen[str] | None = field(default=None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        # A server process sets vLLM's CPU variables for its own ranks (see conftest.serving).
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
        with self.log.open("a") as out:
            self.popen = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env
            )

    def wait_ready(self) -> None:
        assert self.popen is not None
        wait_until_up(self.popen, f"{self.url}/ready", STARTUP_SECONDS, self.log)

    def kill(self) -> None:
        """SIGKILL the server and every process under it (its engine): a crash."""
        assert self.popen is not None
        for child in psutil.Process(self.popen.pid).children(recursive=True):
            child.kill()
        self.popen.kill()
        self.popen.wait()

    def counter(self, name: str, **labels: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        return sum(
            value
            for sample_labels, value in samples(text).get(name, [])
            if labels.items() <= sample_labels.items()
        )


class Timeline:
    """Seconds from its creation to each named event, for the test's printout."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.events: list[str] = []

    def mark(self, event: str) -> None:
        self.events.append(f"{event} +{time.monotonic() - self.start:.1f} s")

    def __str__(self) -> str:
        return ", ".join(self.events)


@dataclass
class Router:
    base_url: str
    popen: subprocess.Popen[str]

    def client(self, key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0)

    async def wait_health(self, replica: Replica, healthy: bool) -> None:
        """Until the router's health check has seen `replica` as healthy (or not)."""
        for _ in range(600):
            if healthy_workers(self.base_url)[replica.url] is healthy:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the router never took {replica.url} as healthy={healthy}")


@pytest.fixture(scope="module")
def replicas(tiny: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    directory = tmp_path_factory.mktemp("router")
    redis = RedisServer(directory)
    redis.start()
    keys = directory / "keys.json"
    entries = [
        {"key": KEY, "tenant": "team"},
        {"key": LIMITED_KEY, "tenant": "limited", "requests_per_minute": REQUESTS_PER_MINUTE},
    ]
    keys.write_text(json.dumps({"keys": entries}))
    group = []
    for name in ("a", "b"):
        port, metrics_port = free_port(), free_port()
        flags = (
            "--api-key-file", str(keys), "--rate-limit-store", redis.url,
            "--block-size", "32", "--drain-timeout-seconds", "120",
        )  # fmt: skip
        command = tiny_serve_command(tiny, port, metrics_port, *flags)
        group.append(Replica(command, directory / f"replica-{name}.log", port, metrics_port))
    try:
        for replica in group:
            replica.start()
        for replica in group:
            replica.wait_ready()
        yield group
    finally:
        for replica in group:
            if replica.popen is not None and replica.popen.poll() is None:
                replica.kill()
        redis.stop()


@contextlib.contextmanager
def routing(replicas: list[Replica], policy: str, log: Path) -> Iterator[Router]:
    port = free_port()
    command = router_command([r.url for r in replicas], port, free_port(), policy)
    with log.open("w") as out:
        popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)
    router = Router(f"http://127.0.0.1:{port}", popen)
    try:
        wait_all_healthy(popen, router.base_url, STARTUP_SECONDS, log)
        yield router
    finally:
        popen.terminate()
        popen.wait(timeout=30)


@pytest.fixture(scope="module")
def cache_aware(
    replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Router]:
    with routing(replicas, "cache_aware", tmp_path_factory.mktemp("cache-aware") / "log") as router:
        yield router


@pytest.fixture(scope="module")
def round_robin(
    replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Router]:
    with routing(replicas, "round_robin", tmp_path_factory.mktemp("round-robin") / "log") as router:
        yield router


def ask(content: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }


async def test_plain_and_streamed_replies_pass_through_with_keys_checked_by_the_replicas(
    cache_aware: Router,
) -> None:
    client = cache_aware.client()
    chat = await client.chat.completions.create(**ask("hello through the router"))
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
    stream = await client.chat.completions.create(
        **ask("a stream through the router"), stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    completion = await client.completions.create(model="tiny", prompt="one two", max_tokens=3)
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    # The router forwards the client's Authorization; the replica refuses a wrong key.
    with pytest.raises(openai.AuthenticationError):
        await cache_aware.client("sk-wrong").chat.completions.create(**ask("no key"))
    # vllm-router 0.1.17 forwards /v1/responses without the client's Authorization (only its
    # own --api-key, unset here): with keys on, Responses must go to a replica directly.
    with pytest.raises(openai.AuthenticationError):
        await client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    # A parameter the router adds (at its default) passes; the same one asking for more is
    # refused by name, as OpenAI-style errors coming back through the router.
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        await client.chat.completions.create(**ask("eos"), extra_body={"ignore_eos": True})


async def test_a_repeated_prefix_stays_on_one_replica_under_cache_aware(
    replicas: list[Replica], cache_aware: Router, round_robin: Router
) -> None:
    system = " ".join(f"rule {i}: answer briefly and cite the source." for i in range(30))

    async def misses(router: Router, topic: str) -> tuple[list[int], list[float]]:
        before = [
            r.counter("specserve_prompt_cached_tokens_total", tenant="team") for r in replicas
        ]
        cached = []
        for i in range(6):
            messages: list[Any] = [
                {"role": "system", "content": f"{topic}. {system}"},
                {"role": "user", "content": f"question {i}"},
            ]
            reply = await router.client().chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=2,
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
        after = [r.counter("specserve_prompt_cached_tokens_total", tenant="team") for r in replicas]
        return cached, [a - b for a, b in zip(after, before, strict=True)]

    affine, affine_by_replica = await misses(cache_aware, "Topic: routing")
    spread, spread_by_replica = await misses(round_robin, "Topic: gardening")
    print(f"\ncache_aware cached tokens {affine} by replica {affine_by_replica}")
    print(f"round_robin cached tokens {spread} by replica {spread_by_replica}")
    # cache_aware: the first request computes the prefix, every later one finds it.
    assert affine[0] == 0 and all(tokens > 0 for tokens in affine[1:])
    assert sorted(affine_by_replica) == [0, sum(affine)]
    # round_robin: each replica computes the prefix once for itself.
    assert spread.count(0) == 2 and all(tokens > 0 for tokens in spread_by_replica)


async def test_cache_aware_routes_by_prefix_not_by_load(
    replicas: list[Replica], cache_aware: Router
) -> None:
    """With a long stream in flight on the replica holding a prefix, the next request with that
    prefix still goes there. Least-loaded routing, what the router falls back to when replicas
    cannot render prompts into token ids, would send it to the idle replica, which misses."""
    # Short enough that the long stream fits in the tiny model's 2048 tokens.
    system = " ".join(f"clause {i}: keep the reply short and exact." for i in range(15))

    def request(user: str, max_tokens: int) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return {"model": "tiny", "messages": messages, "max_tokens": max_tokens}

    client = cache_aware.client()
    before = [r.counter("specserve_prompt_cached_tokens_total", tenant="team") for r in replicas]
    await client.chat.completions.create(**request("first question", 2))
    started = asyncio.Event()
    stream = asyncio.create_task(
        long_stream(client, started, request("a long story", LONG_STREAM_TOKENS))
    )
    waiting = asyncio.create_task(started.wait())
    await asyncio.wait([stream, waiting], timeout=120, return_when=asyncio.FIRST_COMPLETED)
    assert started.is_set(), stream.result() if stream.done() else "no token in 120 s"
    busy = [r.counter("specserve_requests_in_flight", endpoint=CHAT) for r in replicas]
    reply = await client.chat.completions.create(**request("second question", 2))
    assert await stream == "done"
    after = [r.counter("specserve_prompt_cached_tokens_total", tenant="team") for r in replicas]
    cached = [a - b for a, b in zip(after, before, strict=True)]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    print(f"\nin flight by replica {busy}; cached tokens by replica {cached}")
    # The stream followed the prefix to its replica, and so did the request sent meanwhile.
    assert sorted(busy) == [0, 1]
    assert (reply.usage.prompt_tokens_details.cached_tokens or 0) > 0
    assert cached[busy.index(1)] > 0 and cached[busy.index(0)] == 0


async def test_one_tenant_limit_holds_across_both_replicas(
    replicas: list[Replica], round_robin: Router
) -> None:
    client = round_robin.client(LIMITED_KEY)
    before = [r.counter("specserve_requests_total", endpoint=CHAT, status="200") for r in replicas]
    started = time.monotonic()
    statuses = []
    for i in range(2 * REQUESTS_PER_MINUTE):
        try:
            await client.chat.completions.create(**ask(f"limited {i}", 2))
            statuses.append(200)
        except openai.RateLimitError:
            statuses.append(429)
    elapsed = time.monotonic() - started
    after = [r.counter("specserve_requests_total", endpoint=CHAT, status="200") for r in replicas]
    served = [a - b for a, b in zip(after, before, strict=True)]
    refilled = math.floor(REQUESTS_PER_MINUTE * elapsed / 60)
    print(
        f"\nadmitted {statuses.count(200)} of {len(statuses)} in {elapsed:.1f} s",
        f"({served} by replica)",
    )
    assert REQUESTS_PER_MINUTE <= statuses.count(200) <= REQUESTS_PER_MINUTE + refilled
    assert REQUESTS_PER_MINUTE + refilled < 2 * REQUESTS_PER_MINUTE, "too slow to tell"
    # Both replicas admitted some: the limit held across them, not on one of them.
    assert all(count > 0 for count in served)


async def long_stream(
    client: openai.AsyncOpenAI, started: asyncio.Event, request: dict[str, Any]
) -> str:
    """`request` streamed (set `started` at its first token): "done" when it ended normally,
    else the error that ended it."""
    try:
        stream = await client.chat.completions.create(**request, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                started.set()
        return "done"
    except (openai.APIError, httpx.HTTPError) as exc:
        return type(exc).__name__


@contextlib.asynccontextmanager
async def streams_on_both(
    router: Router, replicas: list[Replica]
) -> AsyncIterator[list[asyncio.Task[str]]]:
    """Four long streams through round_robin, two on each replica, all producing tokens."""
    client = router.client()
    events = [asyncio.Event() for _ in range(4)]
    tasks = [
        asyncio.create_task(long_stream(client, e, ask(f"long story {i}", LONG_STREAM_TOKENS)))
        for i, e in enumerate(events)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
    running = [r.counter("specserve_requests_in_flight", endpoint=CHAT) for r in replicas]
    assert running == [2, 2], running
    yield tasks


async def rejoins(replica: Replica, router: Router, timeline: Timeline) -> None:
    """Start `replica` again: once ready, the router takes it back and sends it requests."""
    replica.start()
    replica.wait_ready()
    timeline.mark("restarted and ready")
    await router.wait_health(replica, healthy=True)
    timeline.mark("back in rotation")
    served_before = replica.counter("specserve_requests_total", endpoint=CHAT)
    for i in range(4):
        await router.client().chat.completions.create(**ask(f"after rejoining {i}"))
    assert replica.counter("specserve_requests_total", endpoint=CHAT) > served_before


async def test_a_draining_replica_finishes_its_streams_and_gets_no_new_request(
    replicas: list[Replica], round_robin: Router
) -> None:
    draining = replicas[0]
    async with streams_on_both(round_robin, replicas) as streams:
        assert draining.popen is not None
        draining.popen.send_signal(signal.SIGTERM)  # the server drains: /ready answers 503
        timeline = Timeline()
        await round_robin.wait_health(draining, healthy=False)
        timeline.mark("out of rotation")
        served_before = draining.counter("specserve_requests_total", endpoint=CHAT)
        new = [
            await round_robin.client().chat.completions.create(**ask(f"during drain {i}"))
            for i in range(6)
        ]
        assert len(new) == 6
        assert draining.counter("specserve_requests_total", endpoint=CHAT) == served_before
        outcomes = await asyncio.gather(*streams)
    print(f"\nstreams during the drain: {outcomes}")
    assert outcomes == ["done"] * 4
    assert draining.popen.wait(timeout=120) == 0
    timeline.mark("drained and exited")
    await rejoins(draining, round_robin, timeline)
    print(f"after SIGTERM: {timeline}")


async def test_a_killed_replica_fails_only_its_own_streams(
    replicas: list[Replica], round_robin: Router
) -> None:
    killed = replicas[1]
    client = round_robin.client()
    async with streams_on_both(round_robin, replicas) as streams:
        killed.kill()
        timeline = Timeline()
        # Until the router's health check sees the crash, a new request may still be sent
        # there (the router retries it elsewhere); count what the client sees meanwhile.
        before_seen = []
        while healthy_workers(round_robin.base_url)[killed.url]:
            try:
                await client.chat.completions.create(**ask("before the check"))
                before_seen.append("ok")
            except openai.APIError as exc:
                before_seen.append(type(exc).__name__)
        timeline.mark("out of rotation")
        after_seen = []
        for i in range(8):
            await client.chat.completions.create(**ask(f"after the check {i}"))
            after_seen.append("ok")
        outcomes = await asyncio.gather(*streams)
    print(
        f"\nstreams: {outcomes}; new requests before the check saw the crash: {before_seen};",
        f"after: {after_seen}",
    )
    # The two streams on the killed replica end in an error, never as a clean short reply.
    assert outcomes.count("done") == 2
    await rejoins(killed, round_robin, timeline)
    print(f"after SIGKILL: {timeline}")
