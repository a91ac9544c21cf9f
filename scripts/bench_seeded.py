"""Seeded against unseeded sampled requests on one running specserve, side by side.

Starts `specserve serve` (flags after `--`), then for each temperature and
prompt sends one seeded and one unseeded chat request per round, alternating
which goes first (ABBA), one request at a time. A seeded request takes
server/vllm_plugins/seeded_sampling.py's path (noise keyed by position, drafts
accepted where they equal the target's keyed choice); an unseeded one vLLM's
rejection sampler. Rounds go in pairs sharing a seed, each pair another one:
the pair's two replies, at different places in the order, must be the same
text. Prints output tokens/s, the ratio seeded/unseeded with the range of
per-round ratios, the draft acceptance of each and how many seeded pairs gave
the same text; writes the rows and `lscpu` to --out.

    .venv/bin/python scripts/bench_seeded.py --rounds 6 --out loadtest-results/seeded
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from bench_loadtest import _start

# The scripts folder is on sys.path when this file runs as a script.
from loadtest.launch import stop

PROMPTS = {
    "code": "Write a Python function that parses a CSV file into a list of dicts, "
    "with type hints and a docstring.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


async def _one(client: httpx.AsyncClient, body: dict[str, Any], seed: int | None) -> dict[str, Any]:
    start = time.perf_counter()
    response = await client.post("/v1/chat/completions", json={**body, "seed": seed})
    seconds = time.perf_counter() - start
    response.raise_for_status()
    reply = response.json()
    return {
        "seconds": seconds,
        "tokens": reply["usage"]["completion_tokens"],
        "accepted": reply["speculation"]["accepted_tokens"],
        "drafted": reply["speculation"]["draft_tokens"],
        "text": reply["choices"][0]["message"]["content"],
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    drafted = sum(r["drafted"] for r in runs)
    return {
        "tokens_per_second": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs),
        "acceptance": sum(r["accepted"] for r in runs) / drafted if drafted else 0.0,
    }


async def _measure(port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for temperature in args.temperatures:
            for name, prompt in PROMPTS.items():
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": args.max_tokens,
                    "temperature": temperature,
                }
                seeded, unseeded = [], []
                for round_index in range(args.rounds):
                    # Rounds 2i and 2i+1 share a seed, sent first and then second: the two
                    # replies must be the same text.
                    pair = [(seeded, 1000 + round_index // 2), (unseeded, None)]
                    for runs, seed in pair if round_index % 2 == 0 else pair[::-1]:
                        runs.append(await _one(client, body, seed))
                per_round = [
                    (s["tokens"] / s["seconds"]) / (u["tokens"] / u["seconds"])
                    for s, u in zip(seeded, unseeded, strict=True)
                ]
                row = {
                    "temperature": temperature,
                    "prompt": name,
                    "seeded": _summary(seeded),
                    "unseeded": _summary(unseeded),
                    "per_round_ratios": per_round,
                    "seeded_pairs_identical": [
                        seeded[i]["text"] == seeded[i + 1]["text"]
                        for i in range(0, len(seeded) - 1, 2)
                    ],
                    "runs": {"seeded": seeded, "unseeded": unseeded},
                }
                print(_line(row), flush=True)
                rows.append(row)
    return rows


def _line(row: dict[str, Any]) -> str:
    seeded, unseeded = row["seeded"], row["unseeded"]
    ratio = seeded["tokens_per_second"] / unseeded["tokens_per_second"]
    low, high = min(row["per_round_ratios"]), max(row["per_round_ratios"])
    return (
        f"T={row['temperature']:<4} {row['prompt']:<6} seeded {seeded['tokens_per_second']:6.2f} "
        f"tok/s (acceptance {seeded['acceptance']:.2f})  unseeded "
        f"{unseeded['tokens_per_second']:6.2f} tok/s (acceptance {unseeded['acceptance']:.2f})  "
        f"seeded/unseeded {ratio:.2f} (rounds {low:.2f}-{high:.2f})  same seed, same text: "
        f"{sum(row['seeded_pairs_identical'])} of {len(row['seeded_pairs_identical'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("serve_args", nargs="*", help="extra `specserve serve` flags (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lscpu.txt").write_text(
        subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    )
    command = [sys.executable, "-m", "server", "serve", "--port", str(args.port)]
    command += ["--metrics-port", str(args.port), *args.serve_args]
    server, _ = _start("server", command, dict(os.environ), args.port, args.out)
    try:
        rows = asyncio.run(_measure(args.port, args))
    finally:
        stop(server)
    record = {
        "command": command,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
