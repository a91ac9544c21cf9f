"""Batch-1 and batch-N speed of specserve with and without speculation, in one run.

Starts `specserve serve` once without speculation and once per K, on the same
model and flags, sends the same greedy code and prose chat prompts to each, and
prints output tokens per second for each, the ratio to no speculation and the
draft acceptance rate the responses reported. With
--concurrency N it also sends N requests at once and reports the aggregate
rate, which shows where speculation stops paying (pass a large
--speculation-max-batch-size so the server keeps speculating at that batch).
It also reports startup time and the peak resident memory of each server.

    .venv/bin/python scripts/bench_speculation.py --max-tokens 128
    .venv/bin/python scripts/bench_speculation.py --num-speculative-tokens 1 2 3 \\
        --concurrency 1 2 -- --speculation-max-batch-size 64
"""

import argparse
import asyncio
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

PROMPTS = {
    "code": "Write a Python function that parses a CSV file into a list of dicts, "
    "with type hints and a docstring.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


@dataclass
class Result:
    label: str
    startup_seconds: float
    peak_rss_gib: float
    rates: dict[tuple[str, int], float]  # (prompt, concurrency) -> output tokens/s
    acceptance: dict[tuple[str, int], float]  # (prompt, concurrency) -> accepted / drafted


def _tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{current}/task/{current}/children") as children:
                pending.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


async def _one(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> tuple[int, int, int]:
    """Output tokens, accepted and drafted tokens of one greedy chat request."""
    response = await client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    )
    response.raise_for_status()
    body = response.json()
    speculation = body["speculation"]
    return (
        body["usage"]["completion_tokens"],
        speculation["accepted_tokens"],
        speculation["draft_tokens"],
    )


async def _measure(
    port: int, max_tokens: int, concurrency: list[int]
) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], float]]:
    rates, acceptance = {}, {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await _one(client, model, "Say hello.", 8)  # warm-up
        for n in concurrency:
            for name, prompt in PROMPTS.items():
                start = time.perf_counter()
                counts = await asyncio.gather(
                    *(_one(client, model, prompt, max_tokens) for _ in range(n))
                )
                rates[(name, n)] = sum(c[0] for c in counts) / (time.perf_counter() - start)
                drafted = sum(c[2] for c in counts)
                acceptance[(name, n)] = sum(c[1] for c in counts) / drafted if drafted else 0.0
    return rates, acceptance


def _run(
    label: str,
    serve_args: list[str],
    port: int,
    max_tokens: int,
    concurrency: list[int],
    log_dir: Path | None,
) -> Result:
    command = [sys.executable, "-m", "server", "serve", "--port", str(port)]
    command += ["--metrics-port", str(port), *serve_args]  # no second port to collide
    print(f"[{label}] {' '.join(command)}", flush=True)
    log_file = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_file = (log_dir / f"{label.replace(' ', '-').replace('=', '')}.log").open("w")
    start = time.perf_counter()
    server = subprocess.Popen(
        command,
        stdout=log_file or subprocess.DEVNULL,
        stderr=subprocess.STDOUT if log_file else subprocess.DEVNULL,
    )
    peak = 0
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"[{label}] server exited with {server.returncode}")
            peak = max(peak, _tree_rss_bytes(server.pid))
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        startup = time.perf_counter() - start
        rates, acceptance = asyncio.run(_measure(port, max_tokens, concurrency))
        peak = max(peak, _tree_rss_bytes(server.pid))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        if log_file is not None:
            log_file.close()
    result = Result(label, startup, peak / 2**30, rates, acceptance)
    print(f"[{label}] {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        nargs="+",
        default=[3],
        help="one speculative run per K",
    )
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep each server's log here",
    )
    parser.add_argument("serve_args", nargs="*", help="extra `specserve serve` flags (after --)")
    args = parser.parse_args()
    runs = [("no speculation", [*args.serve_args, "--no-speculation"])]
    runs += [
        (f"K={k}", [*args.serve_args, "--num-speculative-tokens", str(k)])
        for k in args.num_speculative_tokens
    ]
    results = [
        _run(label, serve_args, args.port, args.max_tokens, args.concurrency, args.log_dir)
        for label, serve_args in runs
    ]
    baseline, speculative = results[0], results[1:]
    header = f"{'prompt':<8}{'batch':>6}{'no-spec tok/s':>15}"
    header += "".join(f"{r.label + ' tok/s':>13}{'ratio':>7}{'accept':>8}" for r in speculative)
    print(f"\n{header}")
    for key, base_rate in baseline.rates.items():
        name, n = key
        row = f"{name:<8}{n:>6}{base_rate:>15.2f}"
        row += "".join(
            f"{r.rates[key]:>13.2f}{r.rates[key] / base_rate:>7.2f}{r.acceptance[key]:>8.2f}"
            for r in speculative
        )
        print(row)
    for result in results:
        print(
            f"{result.label}: startup {result.startup_seconds:.0f} s, "
            f"peak RSS {result.peak_rss_gib:.1f} GiB"
        )


if __name__ == "__main__":
    main()
