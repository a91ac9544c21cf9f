"""Drive servers with a workload: arrival process, bounds, warm-up, alternation.

One `measure` call serves `run` (one server), `compare` (two servers) and each
level of `sweep`. With two servers the work is split into rounds and the
servers take turns in ABBA order (A B, B A, A B, ...), so drift on a shared or
noisy machine (other jobs, thermal limits) lands on both sides alike. Each
server gets its own copy of the seeded request sequence, so both see the same
prompts in the same order. Speculation counters are scraped around each of a
server's blocks, so the other server's turns never count. An unrecorded
settling block per server at the measured load comes first when asked for:
the first block at a new load is slow (see `measure`).
"""

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from loadtest import promscrape
from loadtest.client import send
from loadtest.metrics import summarize
from loadtest.records import RequestRecord
from loadtest.workloads import RequestSequence, WorkItem

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Load:
    """Closed loop with `concurrency` requests always in flight, or open loop:
    arrivals at `request_rate` per second (inf = all at once), gaps drawn from
    a gamma distribution of shape `burstiness` (1 = Poisson; < 1 burstier),
    optionally capped at `max_concurrency` in flight, as in vLLM's benchmark."""

    concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        text = f"request rate {self.request_rate}/s, burstiness {self.burstiness}"
        if self.max_concurrency is not None:
            text += f", at most {self.max_concurrency} in flight"
        return text

    def gap(self, rng: random.Random) -> float:
        if math.isinf(self.request_rate):
            return 0.0
        # Gamma(shape k, scale 1/(rate k)) has mean 1/rate for every k.
        scale = 1.0 / (self.request_rate * self.burstiness)
        return rng.gammavariate(self.burstiness, scale)


@dataclass(frozen=True)
class Options:
    max_tokens: int = 64
    temperature: float = 0.0
    stream: bool = True
    timeout: float = 600.0
    api_key: str | None = None
    model: str | None = None  # None: the first model the server lists


@dataclass
class Server:
    label: str
    url: str
    client: httpx.AsyncClient
    model: str
    records: list[RequestRecord] = field(default_factory=list)
    duration: float = 0.0
    speculation: promscrape.SpecCounters | None = None
    speculative_tokens: int | None = None  # K, if the server says (specserve does)
    # Fields added to every request body, e.g. specserve's per-request
    # {"speculation": {"max_draft_tokens": 0}}: two "servers" on one URL.
    extra_body: dict[str, Any] = field(default_factory=dict)
    # Each block of requests (one per round): output tokens and seconds, so
    # alternating rounds can be compared pair by pair.
    blocks: list[dict[str, float]] = field(default_factory=list)
    # Where its Prometheus metrics are: a path on `url`, or a URL of its own
    # (specserve serves them on a port apart from the API).
    metrics_url: str = "/metrics"


async def open_server(
    label: str,
    url: str,
    options: Options,
    extra_body: dict[str, Any] | None = None,
    metrics_url: str | None = None,
) -> Server:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    client = httpx.AsyncClient(
        base_url=url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(options.timeout),
        # Enough connections for any load; the default pool (100) would queue
        # requests client-side and count that wait as server latency.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )
    model = options.model
    if model is None:
        response = await client.get("/v1/models")
        response.raise_for_status()
        model = str(response.json()["data"][0]["id"])
    server = Server(label, url, client, model, extra_body=extra_body or {})
    if metrics_url is not None:
        server.metrics_url = metrics_url
    text = await promscrape.scrape(client, server.metrics_url)
    if text is not None:
        server.speculative_tokens = promscrape.speculative_tokens(text)
    return server


async def warm_up(server: Server, items: list[WorkItem], count: int, options: Options) -> None:
    """Sequential requests that are not recorded: first-request costs stay out.
    A few tokens each are enough for that, and keep warm-up cheap on slow hosts."""
    for i in range(count):
        item = items[i % len(items)]
        record = RequestRecord(index=-1, item=item.id, server=server.label)
        payload = item.payload(server.model, WARMUP_TOKENS, options.temperature, False)
        payload.update(server.extra_body)
        payload["max_tokens"] = min(payload["max_tokens"], WARMUP_TOKENS)
        await send(server.client, item, payload, record)
        if not record.success:
            print(f"[{server.label}] warm-up request failed: {record.error}", flush=True)


async def run_block(
    server: Server,
    sequence: RequestSequence,
    count: int | None,
    seconds: float | None,
    load: Load,
    options: Options,
    rng: random.Random,
    origin: float,
    progress: tqdm | None,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Send `count` requests, or keep sending for `seconds`; wait for all to end."""
    before = await promscrape.scrape(server.client, server.metrics_url)
    first = len(server.records)
    start = clock()
    deadline = start + seconds if seconds is not None else math.inf
    launched = 0

    def more() -> bool:
        return (count is None or launched < count) and clock() < deadline

    async def one(item: WorkItem) -> None:
        record = RequestRecord(
            index=len(server.records), item=item.id, server=server.label, start=clock() - origin
        )
        server.records.append(record)
        payload = item.payload(
            server.model, options.max_tokens, options.temperature, options.stream
        )
        payload.update(server.extra_body)
        await send(server.client, item, payload, record, clock)
        if progress is not None:
            progress.update(1)

    if load.concurrency is not None:

        async def worker() -> None:
            nonlocal launched
            while more():
                launched += 1
                await one(sequence.take(1)[0])

        await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    else:
        limit = asyncio.Semaphore(load.max_concurrency or 1_000_000)

        async def limited(item: WorkItem) -> None:
            async with limit:
                await one(item)

        tasks = []
        due = start
        while more():
            launched += 1
            tasks.append(asyncio.create_task(limited(sequence.take(1)[0])))
            due += load.gap(rng)
            if due > clock():
                await asyncio.sleep(due - clock())
        await asyncio.gather(*tasks)
    seconds_taken = clock() - start
    server.duration += seconds_taken
    tokens = sum(r.output_tokens for r in server.records[first:] if r.success)
    server.blocks.append({"output_tokens": tokens, "duration_s": seconds_taken})
    after = await promscrape.scrape(server.client, server.metrics_url)
    if before is not None and after is not None:
        old, new = promscrape.parse(before), promscrape.parse(after)
        if old is not None and new is not None:
            delta = new - old
            server.speculation = delta if server.speculation is None else server.speculation + delta


async def measure(
    servers: list[Server],
    items: list[WorkItem],
    load: Load,
    options: Options,
    *,
    num_requests: int | None,
    duration: float | None,
    rounds: int,
    seed: int,
    show_progress: bool,
    settle: bool = False,
) -> None:
    """Run the workload on every server, in alternating rounds; fills each Server.

    settle: first, each server runs one unrecorded block at this load (as many requests as it
    keeps in flight, the first prompts of the sequence). The first block at a new concurrency
    is slow: measured against itself (one server, the same requests on both sides, four in
    flight), side A's first round took 7.6-7.8 s per request against 6.2-6.4 s for every later
    block, so without it side A's ratio reads a few percent low.
    """
    if (num_requests is None) == (duration is None):
        raise ValueError("give exactly one of num_requests, duration")
    origin = time.perf_counter()
    if settle:
        in_flight = load.concurrency or load.max_concurrency or 1
        for server in servers:
            unrecorded = dataclasses.replace(
                server, records=[], duration=0.0, speculation=None, blocks=[]
            )
            await run_block(
                unrecorded, RequestSequence(items, seed), in_flight, None, load, options,
                random.Random(seed), origin, None,
            )  # fmt: skip
    sequences = {s.label: RequestSequence(items, seed) for s in servers}
    rngs = {s.label: random.Random(seed) for s in servers}
    total = num_requests * len(servers) if num_requests is not None else None
    progress = tqdm(total=total, unit="req", disable=not show_progress, dynamic_ncols=True)
    try:
        for round_index in range(rounds):
            order = servers if round_index % 2 == 0 else servers[::-1]
            for server in order:
                count = None
                if num_requests is not None:
                    # Spread the requests over the rounds; early rounds take the remainder.
                    count = num_requests // rounds + (round_index < num_requests % rounds)
                seconds = duration / rounds if duration is not None else None
                progress.set_description(f"{server.label} round {round_index + 1}/{rounds}")
                await run_block(
                    server,
                    sequences[server.label],
                    count,
                    seconds,
                    load,
                    options,
                    rngs[server.label],
                    origin,
                    progress,
                )
    finally:
        progress.close()


def server_result(server: Server, slos: dict[str, float]) -> dict[str, Any]:
    return {
        "url": server.url,
        "model": server.model,
        "speculative_tokens": server.speculative_tokens,
        "summary": summarize(server.records, server.duration, slos),
        "speculation": server.speculation.figures() if server.speculation else None,
        "blocks": server.blocks,
        "records": [r.to_json() for r in server.records],
    }
