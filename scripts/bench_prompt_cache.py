"""What prompt caching earns, and what the KV cache's block size costs, on the default pair.

Two tables, servers run one at a time:

- Block size: `specserve serve --no-speculation --block-size B` for B in --block-sizes, in ABBA
  order (32 64 96 128 128 96 64 32), --cycles times. Each server measures prefill (TTFT of
  ~940-token prompts that share nothing, one token out), decode (TPOT of prose at one request,
  output tokens/s at four) and how much of the prompts the cache served on multi-turn and
  shared-system-prompt.
  Each figure's ratio is over the largest block size's, pass by pass.
- Cache on against off: the default server (speculation on) and the same with
  `--no-prefix-caching`, in ABBA order (on, off, off, on), each running multi-turn and
  shared-system-prompt at 1 and 4 requests: TTFT, end-to-end time and output tokens/s; the
  ratios are on / off, pass by pass.

Every loadtest command is printed and appended to <out>/commands.txt, each run's results go to
<out>/<part>-pass<N>-<server>/<run>/, lscpu to <out>/lscpu.txt and both tables to
<out>/prompt-cache.md (`--tables-only` rebuilds them). Engine flags after `--` go to every
server.

    .venv/bin/python scripts/bench_prompt_cache.py --out loadtest-results/prompt-cache
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_loadtest import _fmt, _loadtest, _start

# The scripts folder is on sys.path when this file runs as a script.
from loadtest.launch import stop
from loadtest.workloads import SHARED_SYSTEM_PROMPT

CACHE_WORKLOADS = ("multi-turn", "shared-system-prompt")


def _unique_long_prompts(path: Path) -> Path:
    """The shared-system-prompt workload's prompts, each opened by its own line so that no two
    share a block: every prefill is computed in full."""
    lines = []
    for i, item in enumerate(SHARED_SYSTEM_PROMPT):
        (_, system), (_, task) = item.messages or ()
        messages = [
            {"role": "system", "content": f"Session {i:04d} of a fresh agent.\n{system}"},
            {"role": "user", "content": task},
        ]
        lines.append(json.dumps({"id": f"unique-long-{i}", "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _runs_for_block_size(unique_prompts: Path) -> dict[str, list[str]]:
    """Each block-size run: its name and its `loadtest run` flags. Nothing unrecorded goes
    first (it would fill the cache the run measures)."""
    once = ["--warmup", "0", "--no-settle", "--concurrency"]
    return {
        "prefill": ["--workload", str(unique_prompts), *once, "1", "--num-requests", "8",
                    "--max-tokens", "1"],
        "decode-c1": ["--workload", "prose", "--concurrency", "1", "--num-requests", "8",
                      "--max-tokens", "64"],
        "decode-c4": ["--workload", "prose", "--concurrency", "4", "--num-requests", "12",
                      "--max-tokens", "64"],
        "multi-turn": ["--workload", "multi-turn", *once, "1", "--num-requests", "16",
                       "--max-tokens", "8"],
        "shared-system-prompt": ["--workload", "shared-system-prompt", *once, "1",
                                 "--num-requests", "8", "--max-tokens", "8"],
    }  # fmt: skip


def _runs_for_cache() -> dict[str, list[str]]:
    runs = {}
    for workload in CACHE_WORKLOADS:
        for concurrency, requests in ((1, 16), (4, 32)):
            runs[f"{workload}-c{concurrency}"] = [
                "--workload", workload, "--concurrency", str(concurrency),
                "--num-requests", str(requests), "--max-tokens", "64", "--warmup", "0",
                "--no-settle",
            ]  # fmt: skip
    return runs


def _serve(port: int, flags: list[str], engine_flags: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(port), *flags, *engine_flags,
    ]  # fmt: skip


def _pass(
    out: Path,
    part: str,
    number: int,
    name: str,
    flags: list[str],
    runs: dict[str, list[str]],
    args: argparse.Namespace,
) -> None:
    folder = out / f"{part}-pass{number}-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    process, _ = _start(
        f"{part}-{name}", _serve(args.port, flags, args.engine_flags), dict(os.environ),
        args.port, folder,
    )  # fmt: skip
    try:
        for run, run_flags in runs.items():
            _loadtest(
                ["run", "--url", f"http://127.0.0.1:{args.port}", *run_flags, "--seed", "0",
                 "--no-progress", "--no-plots", "--output-dir", str(folder / run)],
                out / "commands.txt",
            )  # fmt: skip
    finally:
        stop(process)


def _summary(out: Path, part: str, name: str, run: str) -> list[dict[str, Any]]:
    """The run's summary from each pass of this server, in pass order."""
    summaries = []
    paths = out.glob(f"{part}-pass*-{name}/{run}/results.json")
    for path in sorted(
        paths, key=lambda p: int(p.parent.parent.name.split("-pass")[1].split("-")[0])
    ):
        servers = json.loads(path.read_text())["servers"]
        summaries.append(next(iter(servers.values()))["summary"])
    return summaries


def _ratio(a: list[dict[str, Any]], b: list[dict[str, Any]], *path: str) -> float | None:
    """Geometric mean of a's figure over b's, pass by pass (passes in the same order)."""
    ratios = []
    for x, y in zip(a, b, strict=False):
        value_a, value_b = x, y
        for key in path:
            value_a, value_b = value_a[key], value_b[key]
        if value_a and value_b and not math.isnan(value_a) and not math.isnan(value_b):
            ratios.append(math.log(value_a / value_b))
    return math.exp(statistics.fmean(ratios)) if ratios else None


def _mean(summaries: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for summary in summaries:
        value = summary
        for key in path:
            value = value[key]
        if value is not None and not math.isnan(value):
            values.append(value)
    return statistics.fmean(values) if values else None


def block_size_table(out: Path, sizes: list[int]) -> list[str]:
    reference = f"b{max(sizes)}"
    lines = [
        "### Block size (no speculation)",
        "",
        f"Ratios over block size {max(sizes)}, pass by pass (geometric mean). Prefill: TTFT of "
        "~940-token prompts that share nothing; decode: TPOT of prose at 1 request, output "
        "tokens/s at 4; cached share: prompt tokens the cache served over all prompt tokens.",
        "",
        "| block size | prefill TTFT ms | ratio | decode TPOT ms (c1) | ratio | tok/s (c4) | ratio "
        "| cached share multi-turn | TTFT ms multi-turn | cached share shared-system-prompt "
        "| TTFT ms shared-system-prompt |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        name = f"b{size}"

        def of(run: str, name: str = name) -> list[dict[str, Any]]:
            return _summary(out, "block-size", name, run)

        def ref(run: str) -> list[dict[str, Any]]:
            return _summary(out, "block-size", reference, run)

        lines.append(
            f"| {size} | {_fmt(_mean(of('prefill'), 'ttft_ms', 'mean'), 0)} | "
            f"{_fmt(_ratio(of('prefill'), ref('prefill'), 'ttft_ms', 'mean'))} | "
            f"{_fmt(_mean(of('decode-c1'), 'tpot_ms', 'mean'), 1)} | "
            f"{_fmt(_ratio(of('decode-c1'), ref('decode-c1'), 'tpot_ms', 'mean'))} | "
            f"{_fmt(_mean(of('decode-c4'), 'output_throughput'))} | "
            f"{_fmt(_ratio(of('decode-c4'), ref('decode-c4'), 'output_throughput'))} | "
            f"{_fmt(_mean(of('multi-turn'), 'cached_prompt_share'))} | "
            f"{_fmt(_mean(of('multi-turn'), 'ttft_ms', 'mean'), 0)} | "
            f"{_fmt(_mean(of('shared-system-prompt'), 'cached_prompt_share'))} | "
            f"{_fmt(_mean(of('shared-system-prompt'), 'ttft_ms', 'mean'), 0)} |"
        )
    return lines


def cache_table(out: Path) -> list[str]:
    lines = [
        "### Prompt cache on against off (speculation on)",
        "",
        "Each figure: on / off, pass by pass (geometric mean); absolute values are means over "
        "the passes.",
        "",
        "| workload | concurrency | cached share (on) | TTFT ms on / off | TTFT ratio | "
        "E2EL ms on / off | E2EL ratio | tok/s on / off | tok/s ratio | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in _runs_for_cache():
        on, off = _summary(out, "cache", "on", run), _summary(out, "cache", "off", run)
        workload, _, level = run.rpartition("-c")
        failed = sum(s["failed"] for s in on + off)
        lines.append(
            f"| {workload} | {level} | {_fmt(_mean(on, 'cached_prompt_share'))} | "
            f"{_fmt(_mean(on, 'ttft_ms', 'mean'), 0)} / {_fmt(_mean(off, 'ttft_ms', 'mean'), 0)} | "
            f"{_fmt(_ratio(on, off, 'ttft_ms', 'mean'))} | "
            f"{_fmt(_mean(on, 'e2el_ms', 'mean'), 0)} / {_fmt(_mean(off, 'e2el_ms', 'mean'), 0)} | "
            f"{_fmt(_ratio(on, off, 'e2el_ms', 'mean'))} | "
            f"{_fmt(_mean(on, 'output_throughput'))} / {_fmt(_mean(off, 'output_throughput'))} | "
            f"{_fmt(_ratio(on, off, 'output_throughput'))} | {failed} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", nargs="+", choices=["block-size", "cache"],
                        default=["block-size", "cache"])  # fmt: skip
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[32, 64, 96, 128])
    parser.add_argument(
        "--cycles", type=int, default=1, help="ABBA cycles of the block sizes (each two passes)"
    )
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--tables-only", action="store_true")
    parser.add_argument("engine_flags", nargs="*", help="`specserve serve` flags (after --)")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.tables_only:
        (out / "lscpu.txt").write_text(
            subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        )
        if "block-size" in args.parts:
            runs = _runs_for_block_size(_unique_long_prompts(out / "unique-long.jsonl"))
            order = [*args.block_sizes, *reversed(args.block_sizes)] * args.cycles
            for number, size in enumerate(order, start=1):
                flags = ["--no-speculation", "--block-size", str(size)]
                _pass(out, "block-size", number, f"b{size}", flags, runs, args)
        if "cache" in args.parts:
            for number, name in enumerate(("on", "off", "off", "on"), start=1):
                flags = [] if name == "on" else ["--no-prefix-caching"]
                _pass(out, "cache", number, name, flags, _runs_for_cache(), args)
    flags = (out / "lscpu.txt").read_text().splitlines()
    tables = ["```text", *[line for line in flags if line.startswith(("Model name", "Flags"))]]
    tables += ["```", ""]
    if any(out.glob("block-size-pass*")):
        tables += [*block_size_table(out, args.block_sizes), ""]
    if any(out.glob("cache-pass*")):
        tables += cache_table(out)
    text = "\n".join(tables) + "\n"
    (out / "prompt-cache.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
