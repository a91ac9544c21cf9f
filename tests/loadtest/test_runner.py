"""Arrival processes, bounds and alternation, against scripted servers."""

import asyncio
import json
import random
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from loadtest import cli
from loadtest.runner import Load, Options, Server, measure, open_server, run_block
from loadtest.workloads import BUNDLED, RequestSequence, WorkItem, load_jsonl

ITEMS = BUNDLED["prose"]


class Scripted:
    """A streaming chat server that records what it was sent, and when."""

    def __init__(self, name: str, log: list[tuple[str, str]], delay: float = 0.01) -> None:
        self.name, self.log, self.delay = name, log, delay
        self.in_flight = self.most_in_flight = 0

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404)
        body = json.loads(request.content)
        self.log.append((self.name, body["messages"][0]["content"]))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        text = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=text.encode())

    def server(self) -> Server:
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler), base_url="http://t")
        return Server(self.name, "http://t", client, "m")


async def test_alternating_rounds_send_the_same_prompts_in_abba_order() -> None:
    log: list[tuple[str, str]] = []
    a, b = Scripted("a", log), Scripted("b", log)
    servers = [a.server(), b.server()]
    await measure(
        servers, ITEMS, Load(concurrency=1), Options(), num_requests=5, duration=None,
        rounds=3, seed=7, show_progress=False,
    )  # fmt: skip
    # 5 requests over 3 rounds: 2, 2, 1 per server; order A B, B A, A B.
    assert [name for name, _ in log] == list("aabbbbaaab")
    sent_a = [prompt for name, prompt in log if name == "a"]
    sent_b = [prompt for name, prompt in log if name == "b"]
    assert sent_a == sent_b
    for server in servers:
        assert [r.index for r in server.records] == [0, 1, 2, 3, 4]
        assert all(r.success for r in server.records)
        assert server.duration > 0
        assert server.speculation is None  # no /metrics


async def test_one_url_with_two_bodies_is_two_sides_with_blocks_per_round() -> None:
    bodies: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            bodies.append(json.loads(request.content))
        return await scripted.handler(request)

    scripted = Scripted("x", [])
    servers = []
    for label, extra in (("on", {}), ("off", {"speculation": {"max_draft_tokens": 0}})):
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t")
        servers.append(Server(label, "http://t", client, "m", extra_body=extra))
    await measure(
        servers, ITEMS, Load(concurrency=1), Options(), num_requests=4, duration=None,
        rounds=2, seed=0, show_progress=False,
    )  # fmt: skip
    # ABBA: on, off, off, on; two requests per block.
    assert ["speculation" in body for body in bodies] == [False] * 2 + [True] * 4 + [False] * 2
    for server in servers:
        assert [block["output_tokens"] for block in server.blocks] == [2, 2]
        assert all(block["duration_s"] > 0 for block in server.blocks)


async def test_settling_sends_an_unrecorded_block_per_server_at_the_load_first() -> None:
    log: list[tuple[str, str]] = []
    a, b = Scripted("a", log, delay=0.02), Scripted("b", log, delay=0.02)
    servers = [a.server(), b.server()]
    await measure(
        servers, ITEMS, Load(concurrency=3), Options(), num_requests=6, duration=None,
        rounds=2, seed=7, show_progress=False, settle=True,
    )  # fmt: skip
    # Three settling requests each (one per in-flight slot), then ABBA blocks of three.
    assert [name for name, _ in log] == list("aaabbbaaabbbbbbaaa")
    assert a.most_in_flight == b.most_in_flight == 3
    first_prompts = [prompt for _, prompt in log[6:9]]
    assert sorted(prompt for _, prompt in log[:3]) == sorted(first_prompts)
    for server in servers:
        assert [r.index for r in server.records] == list(range(6))
        assert len(server.blocks) == 2


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_fixed_concurrency_keeps_that_many_in_flight(concurrency: int) -> None:
    scripted = Scripted("a", [], delay=0.02)
    server = scripted.server()
    await measure(
        [server], ITEMS, Load(concurrency=concurrency), Options(), num_requests=9,
        duration=None, rounds=1, seed=0, show_progress=False,
    )  # fmt: skip
    assert len(server.records) == 9
    assert scripted.most_in_flight == concurrency


async def test_open_loop_respects_max_concurrency() -> None:
    scripted = Scripted("a", [], delay=0.02)
    server = scripted.server()
    await measure(
        [server], ITEMS, Load(max_concurrency=2), Options(), num_requests=6, duration=None,
        rounds=1, seed=0, show_progress=False,
    )  # fmt: skip
    assert len(server.records) == 6
    assert scripted.most_in_flight == 2


class OnClock(Scripted):
    """Each chat request takes `step` seconds of a clock only they move."""

    def __init__(self, step: float) -> None:
        super().__init__("a", [], delay=0.0)
        self.now, self.step = 0.0, step

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/metrics":
            self.now += self.step
        return await super().handler(request)


async def test_duration_bound_stops_sending() -> None:
    scripted = OnClock(step=0.25)
    server = scripted.server()
    await run_block(
        server, RequestSequence(ITEMS, 0), count=None, seconds=2.0, load=Load(concurrency=1),
        options=Options(), rng=random.Random(0), origin=0.0, progress=None,
        clock=lambda: scripted.now,
    )  # fmt: skip
    # Sequential requests of 0.25 s: those sent at 0, 0.25, ..., 1.75 s.
    assert len(server.records) == 8
    assert server.duration == 2.0


def test_poisson_and_bursty_gaps_have_the_requested_rate() -> None:
    rng = random.Random(0)
    poisson = [Load(request_rate=4.0).gap(rng) for _ in range(20000)]
    bursty = [Load(request_rate=4.0, burstiness=0.25).gap(rng) for _ in range(20000)]
    for gaps in (poisson, bursty):
        assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    # Coefficient of variation of a gamma of shape k is 1/sqrt(k): 1 and 2.
    assert statistics.stdev(poisson) / statistics.fmean(poisson) == pytest.approx(1.0, rel=0.05)
    assert statistics.stdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.08)
    assert Load().gap(rng) == 0.0  # infinite rate: all at once


def test_sequence_is_seeded_and_uses_every_item_equally() -> None:
    first = [i.id for i in RequestSequence(ITEMS, 3).take(2 * len(ITEMS))]
    again = RequestSequence(ITEMS, 3)
    assert first == [i.id for i in again.take(5) + again.take(2 * len(ITEMS) - 5)]
    assert first != [i.id for i in RequestSequence(ITEMS, 4).take(2 * len(ITEMS))]
    assert sorted(first) == sorted([i.id for i in ITEMS] * 2)


def test_a_session_s_turns_are_sent_in_order_one_after_the_other() -> None:
    """An agent sends turn 2 after turn 1: its prompt extends turn 1's (the prompt cache and
    the lookups see what a real agent's turns give them)."""
    items = BUNDLED["agent"]
    turns = {item.session for item in items}
    order = [i.id for i in RequestSequence(items, 5).take(2 * len(items))]
    assert sorted(order) == sorted([i.id for i in items] * 2)
    per_session = len(items) // len(turns)
    for start in range(0, len(order), per_session):
        block = order[start : start + per_session]
        assert block == sorted(block, key=lambda name: int(name.rsplit("turn", 1)[1]))
        assert len({name.rsplit("-turn", 1)[0] for name in block}) == 1
    assert order != [i.id for i in RequestSequence(items, 6).take(2 * len(items))]


def test_jsonl_workload(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"prompt": "def f(x):", "max_tokens": 5}\n\n'
        '{"id": "q", "messages": [{"role": "system", "content": "be brief"},'
        ' {"role": "user", "content": "hi"}]}\n'
    )
    items = load_jsonl(path)
    assert items[0] == WorkItem("mine-1", "completions", prompt="def f(x):", max_tokens=5)
    assert items[1].id == "q" and items[1].path == "/v1/chat/completions"
    payload = items[1].payload("m", 32, 0.0, True)
    assert payload["messages"][0] == {"role": "system", "content": "be brief"}
    assert payload["max_tokens"] == 32 and payload["stream_options"] == {"include_usage": True}
    assert items[0].payload("m", 32, 0.0, False)["max_tokens"] == 5


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"prompt": "a", "messages": []}',
        "{}",
        '{"prompt": 3}',
        '{"messages": [{"role": "user"}]}',
        '{"prompt": "a", "max_tokens": 0}',
    ],
)
def test_bad_jsonl_lines_are_refused_with_their_place(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_jsonl(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--url", "http://x", "--workload", "nope"],
        ["run", "--url", "http://x", "--num-requests", "0"],
        ["run", "--url", "http://x", "--num-requests", "3", "--duration", "5"],
        ["run", "--url", "http://x", "--goodput", "speed:3"],
        ["compare", "--a", "http://x", "--b", "http://y", "--num-requests", "1"],
        ["sweep", "--a", "http://x", "--b", "http://y"],
        ["run", "--url", "http://x", "--concurrency", "0"],
        ["run", "--url", "http://x", "--body", "[1]"],
        ["run", "--url", "http://x", "--body", '{"stream": false}'],
        ["run", "--url", "http://x", "--workload", "agent", "--body", '{"tools": []}'],
        ["compare", "--a", "http://x", "--b", "http://x", "--b-body", '{"max_tokens": 9}'],
    ],
)
def test_bad_command_lines_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(argv)
    assert exit_info.value.code == 2


@contextmanager
def _clients_through(transport: httpx.MockTransport) -> Iterator[None]:
    """Every client the runner opens sends its requests to `transport`."""
    real_client = httpx.AsyncClient
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "loadtest.runner.httpx.AsyncClient",
            lambda **kwargs: real_client(transport=transport, **kwargs),
        )
        yield


async def test_metrics_are_read_where_the_server_serves_them() -> None:
    """specserve serves /metrics on a port apart from the API: a URL of its own."""
    scraped: list[str] = []
    drafts = [0]

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/metrics":
            scraped.append(str(request.url))
            drafts[0] += 3
            text = (
                "specserve_speculative_tokens 2.0\n"
                f'specserve_spec_decode_drafts_total{{model="m"}} {drafts[0]}\n'
                f'specserve_spec_decode_draft_tokens_total{{model="m"}} {2 * drafts[0]}\n'
                f'specserve_spec_decode_accepted_tokens_total{{model="m"}} {drafts[0]}\n'
            )
            return httpx.Response(200, text=text)
        if request.url.port != 8000:
            return httpx.Response(404)
        return await Scripted("s", []).handler(request)

    with _clients_through(httpx.MockTransport(handler)):
        server = await open_server(
            "s", "http://t:8000", Options(model="m"), metrics_url="http://t:9400/metrics"
        )
    await run_block(
        server, RequestSequence(ITEMS, 0), 2, None, Load(concurrency=1), Options(),
        random.Random(0), 0.0, None,
    )  # fmt: skip
    assert set(scraped) == {"http://t:9400/metrics"}
    assert server.speculative_tokens == 2
    assert server.speculation is not None and server.speculation.drafts == 3


async def test_each_side_of_a_comparison_may_send_its_own_key() -> None:
    """Two tenants on one server: specserve keeps each tenant's earlier replies to itself."""
    args = cli.parse(
        ["compare", "--a", "http://t", "--b", "http://t", "--model", "m", "--warmup", "0",
         "--api-key", "k-both", "--b-api-key", "k-b"]
    )  # fmt: skip
    with _clients_through(httpx.MockTransport(lambda request: httpx.Response(404))):
        servers = await cli._open(args, Options(model="m", api_key=args.api_key),
                                  [("A", "http://t", {}), ("B", "http://t", {})])  # fmt: skip
    keys = [server.client.headers["authorization"] for server in servers]
    assert keys == ["Bearer k-both", "Bearer k-b"]
