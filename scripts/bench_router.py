"""What vllm-router costs and what its routing earns, on two replicas of the default pair.

Two replicas (`specserve serve`, each bound to its own core with VLLM_CPU_OMP_THREADS_BIND,
API keys for --tenants tenants) run for the whole benchmark; routers come and go in front.

- Overhead: one short chat request at a time, streamed, one output token; the time to first
  token directly from replica a, through a round_robin router over a alone and through a
  cache_aware router over a alone (which first asks a to render the prompt), in ABC CBA order
  per round, --overhead-rounds rounds. Each prompt is new, so no arm gets a cache hit. The
  added time is each request's TTFT less the mean of its round's direct ones.
- Routing: a multi-tenant shared-prefix workload. Each tenant has its own key and its own
  long system prompt (the shared-system-prompt workload's, opened by a line naming the
  tenant and the pass, so nothing is shared across tenants or passes); --requests-per-tenant
  tasks per tenant in one seeded random order (the same in every pass), two requests in flight
  (one per replica), through a cache_aware router over both replicas and a round_robin one, in
  ABBA order over passes. Per pass: how many requests each replica served, the share of prompt
  tokens the replicas served from their caches (usage `cached_tokens`), and TTFT.

lscpu goes to <out>/lscpu.txt, every request's record to <out>/requests.jsonl, the tables to
<out>/router.md (`--tables-only` rebuilds them).

    .venv/bin/python scripts/bench_router.py --out loadtest-results/router
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

# The scripts folder is on sys.path when this file runs as a script.
from bench_loadtest import _start

from loadtest.launch import stop
from loadtest.promscrape import samples
from loadtest.router import router_command
from loadtest.workloads import SHARED_SYSTEM_PROMPT


def _key(tenant: int) -> str:
    return f"sk-bench-tenant-{tenant}"


@contextmanager
def _replicas(out: Path, tenants: int, engine_flags: list[str]) -> Iterator[list[str]]:
    keys = out / "keys.json"
    entries = [{"key": _key(t), "tenant": f"tenant-{t}"} for t in range(tenants)]
    keys.write_text(json.dumps({"keys": entries}))
    processes, urls = [], []
    try:
        for core, (port, metrics_port) in enumerate(((8401, 8402), (8403, 8404))):
            command = [
                sys.executable, "-m", "server", "serve", "--port", str(port),
                "--metrics-port", str(metrics_port), "--api-key-file", str(keys), *engine_flags,
            ]  # fmt: skip
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
            processes.append(_start(f"replica-{core}", command, env, port, out)[0])
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for process in processes:
            stop(process)


@contextmanager
def _router(out: Path, workers: list[str], policy: str, port: int) -> Iterator[str]:
    """A router on `port` (metrics on the next one); up once its /health says every worker is
    healthy."""
    command = router_command(workers, port, port + 1, policy)
    process, _ = _start(f"router-{policy}-{port}", command, dict(os.environ), port, out)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


def _served_model(url: str) -> str:
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {_key(0)}"})
    name: str = models.json()["data"][0]["id"]
    return name


async def _chat(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    request: tuple[str, list[dict[str, str]]],
    max_tokens: int,
) -> dict[str, Any]:
    """One streamed chat request (model, messages): TTFT (first content), end-to-end time,
    and usage."""
    model, messages = request
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft, usage = None, None
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    assert usage is not None and ttft is not None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": ttft,
        "e2e": time.perf_counter() - started,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens", 0),
    }


async def _overhead(out: Path, replica: str, model: str, rounds: int) -> list[dict[str, Any]]:
    records = []
    with (
        _router(out, [replica], "round_robin", 8411) as round_robin,
        _router(out, [replica], "cache_aware", 8413) as cache_aware,
    ):
        arms = {"direct": replica, "round_robin": round_robin, "cache_aware": cache_aware}
        order = [*arms, *reversed(arms)]
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(rounds):
                for position, arm in enumerate(order):
                    content = f"Request {i}-{position}: name one prime number."
                    messages = [{"role": "user", "content": content}]
                    record = await _chat(client, arms[arm], _key(0), (model, messages), 1)
                    records.append({"part": "overhead", "arm": arm, "round": i, **record})
    return records


def _tenant_messages(tenant: int, run: str, task: int) -> list[dict[str, str]]:
    item = SHARED_SYSTEM_PROMPT[task % len(SHARED_SYSTEM_PROMPT)]
    (_, system), (_, question) = item.messages or ()
    opening = f"Deployment {run}, tenant {tenant}: the agent of this team.\n"
    return [{"role": "system", "content": opening + system}, {"role": "user", "content": question}]


async def _routing_pass(
    url: str, model: str, run: str, tenants: int, per_tenant: int, max_tokens: int
) -> list[dict[str, Any]]:
    work = [(t, task) for task in range(per_tenant) for t in range(tenants)]
    # Arrivals in no tenant's rhythm (round_robin over a fixed rotation of tenants would pin
    # each tenant to one replica); the same order in every pass.
    random.Random(0).shuffle(work)
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    records: list[dict[str, Any]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            tenant, task = queue.get_nowait()
            messages = _tenant_messages(tenant, run, task)
            record = await _chat(client, url, _key(tenant), (model, messages), max_tokens)
            records.append({"tenant": tenant, "task": task, **record})

    async with httpx.AsyncClient(timeout=1800) as client:
        await asyncio.gather(worker(client), worker(client))
    return records


async def _routing(
    out: Path,
    replicas: list[str],
    model: str,
    passes: int,
    tenants: int,
    per_tenant: int,
    max_tokens: int,
) -> list[dict[str, Any]]:
    records = []
    order = ["cache_aware", "round_robin", "round_robin", "cache_aware"]
    for number in range(passes):
        policy = order[number % 4]
        before = [_chat_requests(replica) for replica in replicas]
        with _router(out, replicas, policy, 8421 + 2 * number) as url:
            pass_records = await _routing_pass(
                url, model, f"{number}", tenants, per_tenant, max_tokens
            )
        split = [_chat_requests(r) - b for r, b in zip(replicas, before, strict=True)]
        records.append({"part": "split", "policy": policy, "pass": number, "by_replica": split})
        records += [
            {"part": "routing", "policy": policy, "pass": number, **r} for r in pass_records
        ]
        share = sum(r["cached_tokens"] for r in pass_records) / sum(
            r["prompt_tokens"] for r in pass_records
        )
        print(f"pass {number} {policy}: cached share {share:.2f}, by replica {split}", flush=True)
    return records


def _chat_requests(replica: str) -> float:
    """Chat requests the replica (its base URL; metrics on the next port) answered with 200."""
    host, port = replica.rsplit(":", 1)
    text = httpx.get(f"{host}:{int(port) + 1}/metrics").text
    return sum(
        value
        for labels, value in samples(text).get("specserve_requests_total", [])
        if labels.get("endpoint") == "/v1/chat/completions" and labels.get("status") == "200"
    )


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}"


def tables(records: list[dict[str, Any]]) -> list[str]:
    lines = ["## What the router adds per request", ""]
    overhead = [r for r in records if r["part"] == "overhead"]
    lines += [
        "| path | requests | TTFT median ms | added ms, mean (95% interval) |",
        "|---|---|---|---|",
    ]
    direct: dict[int, list[float]] = {r["round"]: [] for r in overhead}
    for r in overhead:
        if r["arm"] == "direct":
            direct[r["round"]].append(r["ttft"])
    for arm in ("direct", "round_robin", "cache_aware"):
        ttfts = [r["ttft"] for r in overhead if r["arm"] == arm]
        # Against the direct requests of the same round (ABC CBA: the same moment on average).
        added = [
            1000 * (r["ttft"] - statistics.mean(direct[r["round"]]))
            for r in overhead
            if r["arm"] == arm
        ]
        interval = "-"
        if arm != "direct":
            half = 1.96 * statistics.stdev(added) / len(added) ** 0.5
            mean = statistics.mean(added)
            interval = f"{mean:+.1f} ({mean - half:+.1f} to {mean + half:+.1f})"
        lines.append(f"| {arm} | {len(ttfts)} | {_ms(ttfts)} | {interval} |")
    lines += ["", "## Routing a multi-tenant shared-prefix workload", ""]
    lines += [
        "| pass | policy | requests | by replica | cached share | misses | TTFT median ms | "
        "TTFT mean ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    routing = [r for r in records if r["part"] == "routing"]
    for number in sorted({r["pass"] for r in routing}):
        rows = [r for r in routing if r["pass"] == number]
        share = sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)
        ttfts = [r["ttft"] for r in rows]
        misses = sum(1 for r in rows if r["cached_tokens"] == 0)
        (split,) = [
            r["by_replica"] for r in records if r["part"] == "split" and r["pass"] == number
        ]
        lines.append(
            f"| {number} | {rows[0]['policy']} | {len(rows)} | {'/'.join(f'{n:g}' for n in split)} "
            f"| {share:.2f} | {misses} | "
            f"{_ms(ttfts)} | {1000 * statistics.mean(ttfts):.1f} |"
        )
    for policy in ("cache_aware", "round_robin"):
        rows = [r for r in routing if r["policy"] == policy]
        if rows:
            share = sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)
            ttfts = [r["ttft"] for r in rows]
            lines.append(
                f"| all | {policy} | {len(rows)} | | {share:.2f} | "
                f"{sum(1 for r in rows if r['cached_tokens'] == 0)} | {_ms(ttfts)} | "
                f"{1000 * statistics.mean(ttfts):.1f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--overhead-rounds", type=int, default=20)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--requests-per-tenant", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tables-only", action="store_true")
    parser.add_argument("engine_flags", nargs="*", help="after --: flags for both replicas")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    records_path = args.out / "requests.jsonl"
    if not args.tables_only:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        (args.out / "lscpu.txt").write_text(lscpu)
        with _replicas(args.out, args.tenants, args.engine_flags) as replicas:
            model = _served_model(replicas[0])
            records = asyncio.run(_overhead(args.out, replicas[0], model, args.overhead_rounds))
            records += asyncio.run(
                _routing(
                    args.out, replicas, model, args.passes, args.tenants, args.requests_per_tenant,
                    args.max_tokens,
                )
            )  # fmt: skip
        records_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    text = "\n".join(tables(records)) + "\n"
    (args.out / "router.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
