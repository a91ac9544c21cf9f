"""Tenant B's wait for its first token, alone and under tenant A's flood, on the default pair.

Starts one server per source tree given (`--tree before=/tmp/wt-old --tree after=.`: each
runs that tree's `python -m server serve` on the default pair, with a key file of two
tenants), all side by side, and measures them in ABBA order (before, after, after, before
for two trees). Each pass on a server:

- solo: B sends --requests short streamed chats (8 tokens), one after another;
- chats: A keeps --chats chats with `n: 4` (96 tokens) in flight, each sent again as soon as
  it ends; once the engine runs --max-num-seqs of A's sequences and more of A's wait (in
  vLLM's queue or specserve's line), B sends the same short chats (the engine's share);
- renders: A keeps --renders render calls in flight instead (the front door's share).
A's answers are counted by kind and status (200, 429, 503...).

B's time to first token (p50, p95) per server and phase goes to <out>/fairness.md with the
ratio to solo, lscpu to <out>/lscpu.txt, every sample to <out>/samples.jsonl. B's
requests give up after --timeout seconds (counted, not waited for).

    .venv/bin/python scripts/bench_fairness.py --out docs/benchmarks/fairness-<commit>-<cpu> \\
        --tree before=/tmp/wt-before --tree after=.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

# The scripts folder is on sys.path when this file runs as a script.
from bench_loadtest import _start

from loadtest.launch import stop

PHASES = ("solo", "chats", "renders")
KEYS = {"a": "sk-bench-flood-0000000000", "b": "sk-bench-light-0000000000"}
SHORT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
WIDE = {
    "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    "max_tokens": 96,
    "n": 4,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a tree")
    parser.add_argument("--requests", type=int, default=6, help="B's chats per phase")
    parser.add_argument("--chats", type=int, default=12, help="A's n:4 chats in flight")
    parser.add_argument("--renders", type=int, default=24, help="A's render calls in flight")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the servers' engine's")
    parser.add_argument("--port", type=int, default=8300)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trees = dict(item.split("=", 1) for item in args.tree)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    (args.out / "lscpu.txt").write_text(lscpu)
    key_file = args.out / "keys.json"
    key_file.write_text(json.dumps({"keys": [{"key": k, "tenant": t} for t, k in KEYS.items()]}))
    servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        for i, (name, tree) in enumerate(trees.items()):
            port, metrics_port = args.port + 2 * i, args.port + 2 * i + 1
            command = [
                sys.executable, "-m", "server", "serve", "--port", str(port),
                "--metrics-port", str(metrics_port), "--api-key-file", str(key_file),
                "--lookup-index-tokens", "0",
            ]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            process, _ = _start(name, command, env, port, args.out)
            servers[name] = (process, port)
        names = list(trees)
        order = names + names[::-1]
        samples: list[dict[str, Any]] = []
        for number, name in enumerate(order):
            for phase in PHASES:
                port = servers[name][1]
                ttfts, statuses = asyncio.run(_phase(port, phase, args))
                print(f"[{name} pass {number}] {phase}: B TTFT {ttfts}; A {dict(statuses)}")
                samples.append(
                    {"server": name, "pass": number, "phase": phase, "ttft": ttfts, "a": statuses}
                )
    finally:
        for process, _ in servers.values():
            stop(process)
    with (args.out / "samples.jsonl").open("w") as file:
        file.writelines(json.dumps(sample) + "\n" for sample in samples)
    (args.out / "fairness.md").write_text(_table(samples, names, args))
    print((args.out / "fairness.md").read_text())


async def _phase(
    port: int, phase: str, args: argparse.Namespace
) -> tuple[list[float | None], Counter[str]]:
    """B's TTFTs (None: gave up) and A's answers by status, in one of the PHASES."""
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, headers=_auth("b")) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    a_statuses: Counter[str] = Counter()
    first_render = asyncio.Event()
    limits = httpx.Limits(max_connections=args.chats + args.renders + 4)
    async with (
        httpx.AsyncClient(base_url=url, headers=_auth("a"), timeout=None, limits=limits) as a,
        httpx.AsyncClient(base_url=url, headers=_auth("b"), timeout=args.timeout) as b,
    ):
        loops = []
        if phase == "chats":
            loops = [
                asyncio.create_task(_chat_loop(a, model, a_statuses)) for _ in range(args.chats)
            ]
            await _until_flooded(port + 1, args.max_num_seqs)
        if phase == "renders":
            loops = [
                asyncio.create_task(_render_loop(a, model, a_statuses, first_render))
                for _ in range(args.renders)
            ]
            await first_render.wait()
        ttfts = [await _ttft(b, model) for _ in range(args.requests)]
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    await _until_idle(port + 1)
    return ttfts, a_statuses


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def _ttft(client: httpx.AsyncClient, model: str) -> float | None:
    """One short streamed chat of B's: seconds to its first content, read to its end."""
    started = time.perf_counter()
    body = {**SHORT, "model": model, "stream": True, "temperature": 0}
    ttft = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                if ttft is None and _has_content(line):
                    ttft = time.perf_counter() - started
    except httpx.TimeoutException:
        return None
    return ttft


async def _chat_loop(client: httpx.AsyncClient, model: str, statuses: Counter[str]) -> None:
    body = {**WIDE, "model": model, "stream": True, "temperature": 1}
    while True:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            statuses[f"chat {response.status_code}"] += 1
            async for _ in response.aiter_lines():
                pass
        if response.status_code != 200:
            await asyncio.sleep(float(response.headers.get("retry-after", "1")))


def _has_content(line: str) -> bool:
    """Whether an SSE line carries generated text (the first chunk carries only the role)."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


async def _render_loop(
    client: httpx.AsyncClient, model: str, statuses: Counter[str], first: asyncio.Event
) -> None:
    while True:
        response = await client.post("/v1/chat/completions/render", json={**WIDE, "model": model})
        statuses[f"render {response.status_code}"] += 1
        first.set()
        if response.status_code != 200:
            await asyncio.sleep(float(response.headers.get("retry-after", "1")))


async def _metrics(metrics_port: int) -> dict[str, float]:
    """The server's unlabelled-or-first value of each metric family."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            values.setdefault(name, float(line.rsplit(" ", 1)[1]))
    return values


async def _until_flooded(metrics_port: int, max_num_seqs: int) -> None:
    """Wait until A's sequences fill the engine and more of them wait."""
    while True:
        values = await _metrics(metrics_port)
        waiting = values.get("vllm:num_requests_waiting", 0) + values.get(
            "specserve_requests_queued", 0
        )
        if values.get("vllm:num_requests_running", 0) >= max_num_seqs and waiting > 0:
            return
        await asyncio.sleep(0.2)


async def _until_idle(metrics_port: int) -> None:
    """Wait until A's cancelled requests have left the server (specserve_requests_running)."""
    while (await _metrics(metrics_port)).get("specserve_requests_running", 1) != 0:
        await asyncio.sleep(0.5)


def _table(samples: list[dict[str, Any]], names: list[str], args: argparse.Namespace) -> str:
    lines = [
        f"B: {args.requests} short streamed chats (8 tokens) per phase; A's flood: {args.chats} "
        f"chats with n: 4 (96 tokens), or {args.renders} render calls, in flight.",
        "",
        "| server | phase | B TTFT p50 s | B TTFT p95 s | B gave up | p50 / solo p50 "
        "| A's answers |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        p50s = {}
        for phase in PHASES:
            chosen = [s for s in samples if s["server"] == name and s["phase"] == phase]
            ttfts = [t for s in chosen for t in s["ttft"]]
            done = sorted(t for t in ttfts if t is not None)
            answers: Counter[str] = Counter()
            for s in chosen:
                answers.update(s["a"])
            p50s[phase] = statistics.median(done) if done else None
            p95 = done[min(len(done) - 1, round(0.95 * (len(done) - 1)))] if done else None
            ratio = (
                f"{p50s[phase] / p50s['solo']:.1f}x"
                if phase != "solo" and p50s[phase] and p50s["solo"]
                else "-"
            )
            lines.append(
                f"| {name} | {phase} | {_fmt(p50s[phase])} | {_fmt(p95)} | "
                f"{ttfts.count(None)} | {ratio} | {dict(sorted(answers.items())) or '-'} |"
            )
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
