"""Event-loop CPU per output token of OpenAI servers already running on this machine.

Each server's API process runs its HTTP front end and its engine client on one
thread (the event loop), and on a GPU that thread is what caps streamed
throughput. This script drives each server in turn with the same
`python -m loadtest run` (the order rotates every round), reads that thread's CPU
time from /proc around each run, and prints tokens per event-loop CPU second of
every server over the first one's, round by round, with a 95% interval. CPU
time, not wall time: a shared machine moves wall time far more.

Start the servers first (the same engine settings for each), e.g. specserve
`--no-speculation` and `python -m vllm.entrypoints.openai.api_server` on a tiny
model, where engine steps are short enough that front-end costs show:

    .venv/bin/python scripts/bench_frontend_cpu.py --out /tmp/fe-cpu \\
        --server vllm=http://127.0.0.1:8303 --server specserve=http://127.0.0.1:8302 \\
        --concurrency 16 64 --rounds 6
"""

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from loadtest.analysis import paired_speedup
from loadtest.report import paired


@dataclass
class Run:
    server: str
    level: int
    round: int
    cpu_s: float
    tokens: int

    def as_block(self) -> dict[str, float]:
        """In the shape `paired_speedup` takes: output tokens per event-loop CPU second."""
        return {"output_tokens": self.tokens, "duration_s": self.cpu_s}


def _listening_pid(port: int) -> int:
    """The process listening on this local port (its main thread is its event loop)."""
    listing = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    if "pid=" not in listing:
        raise SystemExit(f"nothing of ours listens on port {port}")
    return int(listing.split("pid=")[1].split(",")[0])


def _main_thread_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--server", action="append", required=True, help="NAME=URL; the first is the baseline"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests-per-slot", type=int, default=8, help="requests = this x level")
    parser.add_argument("--workload", default="coding-chat")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-stream", action="store_true")
    args = parser.parse_args()

    servers = dict(entry.split("=", 1) for entry in args.server)
    pids = {name: _listening_pid(urlparse(url).port or 80) for name, url in servers.items()}
    names = list(servers)
    runs: list[Run] = []
    for level in args.concurrency:
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                folder = args.out / f"{name}-c{level}-r{round_index}"
                command = [
                    sys.executable, "-m", "loadtest", "run", "--url", servers[name],
                    "--label", name, "--workload", args.workload, "--concurrency", str(level),
                    "--num-requests", str(args.requests_per_slot * level),
                    "--max-tokens", str(args.max_tokens), "--warmup", "0", "--no-settle",
                    "--seed", "0", "--no-progress", "--no-plots", "--output-dir", str(folder),
                    *(["--no-stream"] if args.no_stream else []),
                ]  # fmt: skip
                before = _main_thread_cpu_seconds(pids[name])
                subprocess.run(command, check=True, capture_output=True)
                cpu = _main_thread_cpu_seconds(pids[name]) - before
                results = json.loads((folder / "results.json").read_text())
                tokens = results["servers"][name]["summary"]["total_output_tokens"]
                runs.append(Run(name, level, round_index, cpu, tokens))
                print(
                    f"c{level} round {round_index} {name}: {cpu / tokens * 1e6:.1f} µs of "
                    f"event-loop CPU per output token ({tokens} tokens)",
                    flush=True,
                )
    (args.out / "runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    baseline = names[0]
    replies = "whole" if args.no_stream else "streamed"
    lines = [
        f"Tokens per event-loop CPU second over {baseline}'s, round by round "
        f"({args.workload}, {replies}, {args.max_tokens} tokens):",
        "",
        "| server | requests | µs per token | over " + baseline + " |",
        "|---|---|---|---|",
    ]
    for level in args.concurrency:
        for name in names:
            mine = [r.as_block() for r in runs if r.server == name and r.level == level]
            theirs = [r.as_block() for r in runs if r.server == baseline and r.level == level]
            cpu_s = sum(b["duration_s"] for b in mine)
            per_token = cpu_s / sum(b["output_tokens"] for b in mine) * 1e6
            versus = "-" if name == baseline else paired(paired_speedup(mine, theirs))
            lines.append(f"| {name} | {level} | {per_token:.1f} | {versus} |")
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
