"""What specserve's front end costs per output token, with no model: the HTTP server over an
engine that makes tokens as fast as it can, against the same engine driven with no HTTP.

    python -m loadtest frontend --concurrency 1 8 64 --num-requests 128 --max-tokens 128

For each concurrency, streamed and whole (non-streaming) chat completions: the engine alone in
this process, then specserve serving the same engine in a child process (as `specserve serve`
runs it: admission, metrics, logs, drain), driven by the load-test client over loopback. Cost
is CPU time per output token (the server process's, from /proc), not wall time: on a shared
machine other tenants move wall time, much less the CPU a process burns itself. The
difference between the two is what the front end adds per token. A report, not a test: the
numbers belong to the machine they ran on.

With --profile, py-spy samples the server process during each cell (py-spy must be installed:
the `test` extra has it) and the report lists the functions the server's CPU per token went to.
"""

import argparse
import asyncio
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.client import send
from loadtest.records import RequestRecord
from loadtest.workloads import WorkItem
from server.engine.contract import (
    ChoiceDelta,
    EngineInfo,
    EngineOutput,
    GenerationRequest,
    ParsedReply,
    SamplingOptions,
    SpeculationInfo,
    SpeculationStats,
    TokenTimes,
)
from server.errors import InvalidRequestError

MODEL = "synthetic"
WORD = " token"
# What each reply's last output reports, so the per-response speculation summary is built.
SPECULATION = SpeculationStats(
    drafts=4, draft_tokens=16, accepted_tokens=12, accepted_per_position=[4, 3, 3, 2]
)
ITEM = WorkItem(
    "frontend", "chat", messages=(("user", "Write a function that merges two sorted lists."),)
)


class _PlainReplies:
    """Tool-call parser for replies that never call tools."""

    def parse(self, text: str) -> ParsedReply:
        return ParsedReply(text or None, [])

    def feed(self, text: str, token_ids: list[int]) -> str:
        return text


class SyntheticEngine:
    """The engine contract with no model: every reply is max_tokens tokens of one word, made
    as fast as the event loop allows, one step (a hand-off through the loop, as vLLM's output
    handler hands each engine step to the request's stream) per token."""

    def __init__(self) -> None:
        self._unfinished = 0

    def info(self) -> EngineInfo:
        return EngineInfo(
            model_name=MODEL,
            max_model_len=1 << 20,
            vocab_size=1 << 16,
            created=0,
            speculation=SpeculationInfo("draft_model", 4, 16, mode="auto"),
            dtype="none",
        )

    def tokenize(self, text: str) -> list[int]:
        return [1] * len(text.split())

    def decode(self, token_ids: list[int]) -> str:
        return WORD * len(token_ids)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return [1] * sum(len(str(m.get("content") or "").split()) for m in messages)

    def tool_call_parser(self) -> _PlainReplies:
        return _PlainReplies()

    def render_fill_in_the_middle(self, prefix: str, suffix: str) -> list[int]:
        raise InvalidRequestError("the synthetic engine has no fill-in-the-middle tokens")

    def validate(self, request: GenerationRequest) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        """One output per token; a reply that is not streamed in one output at the end,
        as the vLLM adapter asks vLLM for it."""
        self._unfinished += 1
        try:
            tokens = request.sampling.max_tokens
            prompt = len(request.prompt_token_ids)
            first = time.perf_counter()
            for produced in range(1, tokens + 1):
                await asyncio.sleep(0)
                last = produced == tokens
                if not (request.stream or last):
                    continue
                made = [produced] if request.stream else list(range(1, tokens + 1))
                choices = [
                    ChoiceDelta(
                        index,
                        WORD * len(made),
                        made,
                        finish_reason="length" if last else None,
                        speculation=SPECULATION if last else None,
                    )
                    for index in range(request.sampling.n)
                ]
                times = None if request.stream else TokenTimes(first, time.perf_counter())
                yield EngineOutput(prompt, choices, times)
        finally:
            self._unfinished -= 1

    async def check_health(self) -> bool:
        return True

    def unfinished_requests(self) -> int:
        return self._unfinished

    def memory(self) -> dict[str, Any] | None:
        return None

    def autopilot_state(self) -> dict[str, Any] | None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


@dataclass(frozen=True)
class Cost:
    """Output tokens made, and the wall and CPU seconds it took."""

    tokens: int
    wall_seconds: float
    cpu_seconds: float
    failed: int = 0

    @property
    def cpu_microseconds_per_token(self) -> float:
        return 1e6 * self.cpu_seconds / self.tokens if self.tokens else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds else float("nan")


async def _closed_loop(
    requests: int, concurrency: int, one: Callable[[int], Awaitable[None]]
) -> None:
    """`requests` calls of `one(index)`, `concurrency` of them in flight at a time."""
    indices = iter(range(requests))

    async def worker() -> None:
        for index in indices:
            await one(index)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def engine_alone(requests: int, concurrency: int, max_tokens: int) -> Cost:
    """The synthetic engine driven directly, in this process: the floor under the server."""
    engine = SyntheticEngine()
    prompt = engine.render_chat([{"role": r, "content": c} for r, c in ITEM.messages or ()])
    produced = 0

    async def one(index: int) -> None:
        nonlocal produced
        request = GenerationRequest(f"r{index}", prompt, SamplingOptions(max_tokens=max_tokens))
        async for output in engine.generate(request):
            produced += sum(len(choice.token_ids) for choice in output.choices)

    wall, cpu = time.perf_counter(), time.process_time()
    await _closed_loop(requests, concurrency, one)
    return Cost(produced, time.perf_counter() - wall, time.process_time() - cpu)


def _process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, every thread, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def through_server(
    client: httpx.AsyncClient,
    pid: int,
    requests: int,
    concurrency: int,
    max_tokens: int,
    stream: bool,
) -> Cost:
    """The same requests through specserve (process `pid`) with the load-test client."""
    payload = ITEM.payload(MODEL, max_tokens, 0.0, stream)
    records: list[RequestRecord] = []

    async def one(index: int) -> None:
        record = RequestRecord(index=index, item=ITEM.id, server="specserve")
        records.append(await send(client, ITEM, payload, record))

    wall, cpu = time.perf_counter(), _process_cpu_seconds(pid)
    await _closed_loop(requests, concurrency, one)
    cpu = _process_cpu_seconds(pid) - cpu
    tokens = sum(r.output_tokens for r in records if r.success)
    failed = sum(not r.success for r in records)
    return Cost(tokens, time.perf_counter() - wall, cpu, failed)


def serve(port: int, max_concurrent_requests: int) -> int:
    """specserve over the synthetic engine on 127.0.0.1:port (the benchmark's child)."""
    from server.cli import serve_engine
    from server.config import Settings
    from server.logs import configure_logging
    from server.traffic.runner import bind_listeners

    settings = Settings.model_validate(
        {
            "host": "127.0.0.1",
            "port": port,
            "metrics_port": port,
            "max_concurrent_requests": max_concurrent_requests,
            "max_num_seqs": max_concurrent_requests,
        }
    )
    configure_logging(settings.log_format)
    listeners = bind_listeners(settings.host, settings.port, None)
    return serve_engine(settings, SyntheticEngine(), None, listeners)


async def _wait_ready(client: httpx.AsyncClient, child: subprocess.Popen[bytes]) -> None:
    while True:
        if child.poll() is not None:
            raise RuntimeError(f"the synthetic server exited with status {child.returncode}")
        try:
            if (await client.get("/ready")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run(args: argparse.Namespace) -> str:
    """Every cell; returns the report (markdown)."""
    port = _free_port()
    most = max(args.concurrency)
    log = (args.output_dir / "server.log").open("wb")
    child = subprocess.Popen(
        [sys.executable, "-m", "loadtest.frontend", "--serve", str(port), "--slots", str(most)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    rows = []
    profiles: list[tuple[str, Path, Cost]] = []
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        ) as client:
            await _wait_ready(client, child)
            # Unrecorded: first-request costs (imports, connection setup) stay out.
            await through_server(client, child.pid, most, most, 8, True)
            for concurrency in args.concurrency:
                alone = await engine_alone(args.num_requests, concurrency, args.max_tokens)
                for stream in (True, False):
                    cell = f"c{concurrency}-{'streamed' if stream else 'whole'}"
                    profile = args.output_dir / f"profile-{cell}.txt"
                    profiler = _start_profiler(child.pid, profile) if args.profile else None
                    served = await through_server(
                        client, child.pid, args.num_requests, concurrency, args.max_tokens, stream
                    )
                    if profiler is not None:
                        _stop_profiler(profiler)
                        profiles.append((cell, profile, served))
                    rows.append((concurrency, stream, alone, served))
                    print(_row(*rows[-1]), flush=True)
    finally:
        child.terminate()
        child.wait(timeout=30)
        log.close()
    return _report(args, rows) + "".join(_profile_report(*profile) for profile in profiles)


def _start_profiler(pid: int, output: Path) -> subprocess.Popen[bytes]:
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("--profile needs py-spy: pip install 'specserve[test]'")
    command = [py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "250"]
    command += ["--nonblocking", "--output", str(output)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_profiler(profiler: subprocess.Popen[bytes]) -> None:
    profiler.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
    profiler.wait(timeout=120)


_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::\d+)?\)$")


def _function(frame: str) -> str:
    """`name (path/to/module.py:123)` as `name (module.py)`: lines of one function add up."""
    match = _FRAME.match(frame)
    if match is None:
        return frame
    return f"{match['function']} ({Path(match['file']).name})"


def top_functions(raw: str, count: int = 15) -> list[tuple[str, float, float]]:
    """The `count` functions that were on top of the stack (running their own code, not a
    callee's) in the largest share of a py-spy raw profile's samples: (function, share of
    samples with it on the stack, share with it on top)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        frames = [_function(frame) for frame in stack.split(";")]
        for name in set(frames):  # a recursive function counts once per sample
            inclusive[name] += int(samples)
        own[frames[-1]] += int(samples)
        total += int(samples)
    if not total:
        return []
    ranked = sorted(inclusive, key=lambda name: (-own[name], -inclusive[name], name))[:count]
    return [(name, inclusive[name] / total, own[name] / total) for name in ranked]


def _profile_report(cell: str, path: Path, served: Cost) -> str:
    """The busiest functions of one cell, in CPU microseconds per output token: the share of
    py-spy's samples times the server's measured CPU per token."""
    per_token = served.cpu_microseconds_per_token
    lines = [
        "",
        f"#### Profile, {cell}: where the server's {per_token:.0f} µs/token went",
        "",
        "| function | µs/token on top (its own code) | µs/token on the stack |",
        "|---|---|---|",
    ]
    for name, on_stack, on_top in top_functions(path.read_text()):
        name = name.replace("|", "\\|")
        lines.append(f"| `{name}` | {on_top * per_token:.1f} | {on_stack * per_token:.1f} |")
    return "\n".join(lines) + "\n"


def _row(concurrency: int, stream: bool, alone: Cost, served: Cost) -> str:
    front_end = served.cpu_microseconds_per_token - alone.cpu_microseconds_per_token
    return (
        f"| {concurrency} | {'streamed' if stream else 'whole'} | {served.tokens} "
        f"| {alone.cpu_microseconds_per_token:.1f} | {served.cpu_microseconds_per_token:.1f} "
        f"| **{front_end:.1f}** | {served.tokens_per_second:.0f} | {served.failed} |"
    )


def _report(args: argparse.Namespace, rows: list[tuple[int, bool, Cost, Cost]]) -> str:
    lines = [
        "### Front end alone: CPU microseconds per output token",
        "",
        f"Synthetic engine, chat completions of {args.max_tokens} tokens, "
        f"{args.num_requests} requests per cell; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}.",
        "engine alone = the synthetic engine driven in-process; server = the specserve "
        "process's CPU over the same requests over HTTP; front end = the difference.",
        "",
        "| concurrency | mode | tokens | engine alone µs/token | server µs/token "
        "| front end µs/token | server tokens/s | failed |",
        "|---|---|---|---|---|---|---|---|",
        *(_row(*row) for row in rows),
    ]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest frontend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--num-requests", type=int, default=128, help="requests per cell")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--output-dir", type=Path, help="default loadtest-results/frontend-<time>")
    parser.add_argument(
        "--profile", action="store_true", help="sample the server with py-spy in each cell"
    )
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--slots", type=int, default=64, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.serve is not None:
        sys.exit(serve(args.serve, args.slots))
    if min(args.concurrency) < 1 or args.num_requests < 1 or args.max_tokens < 1:
        build_parser().error("--concurrency, --num-requests and --max-tokens must be >= 1")
    if args.output_dir is None:
        args.output_dir = Path("loadtest-results") / time.strftime("frontend-%Y%m%d-%H%M%S")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(args))
    (args.output_dir / "summary.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
