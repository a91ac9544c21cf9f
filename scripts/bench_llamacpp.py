"""specserve against llama.cpp's llama-server on the same GGUF pair, side by side in one run.

llama-server serves the embedded pair's GGUF files themselves (Q4_K_M, joined from the chunk
packages as `specserve models pull` joins them, cached under <cache>/gguf): once with the
target only and once with the 0.5B draft (`-md`), each with `-np` set to the largest
concurrency measured, as a user would for that many clients, and all cores as threads.
Both stay up while each specserve configuration (--specserve; default: its defaults without the
hybrid's index of earlier replies, see DEFAULT_CONFIGURATION) runs in
turn: for each workload and concurrency, `python -m loadtest compare` runs it against each
llama-server in alternating rounds (ABBA), greedy, streamed.

Writes every results.json under <out>, the commands (and each server's RSS after its runs) to
commands.txt, lscpu.txt, the server logs, and <out>/llamacpp.md: tokens/s and TTFT p50 of each,
and each specserve configuration's paired ratio to each llama-server (95% interval).

    scripts/build_llama_server.sh .venv/llama.cpp
    .venv/bin/python scripts/bench_llamacpp.py --out /work/llamacpp-bench
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
from bench_loadtest import _loadtest, _start

from loadtest.launch import stop
from loadtest.report import fmt, paired
from server.config import DEFAULT_CACHE_DIR
from server.weights.embedded import DRAFT, TARGET, EmbeddedModel, fetch_gguf

ROOT = Path(__file__).resolve().parent.parent
SPECSERVE_PORT, DRAFTED_PORT, TARGET_ONLY_PORT = 8331, 8332, 8333
LABELS = {DRAFTED_PORT: "llama-server-draft", TARGET_ONLY_PORT: "llama-server"}
# specserve's defaults but for the hybrid's index of earlier replies: every cell sends the same
# seeded prompts again, and specserve would then propose its own earlier replies to them, which
# measures the replay, not a new request (lookups in the request's own prompt stay on).
DEFAULT_CONFIGURATION = "specserve=--lookup-index-tokens 0"


def _gguf(model: EmbeddedModel) -> Path:
    path = DEFAULT_CACHE_DIR / "gguf" / f"{model.name}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        fetch_gguf(model, partial)
        partial.rename(path)
    return path


def _llama_server(binary: str, port: int, slots: int, draft: Path | None) -> list[str]:
    threads = str(len(os.sched_getaffinity(0)))
    command = [binary, "-m", str(_gguf(TARGET)), "--host", "127.0.0.1", "--port", str(port)]
    # 4096 tokens of context per slot, as specserve's prompts and replies here need far less.
    command += ["-t", threads, "-tb", threads, "-np", str(slots), "-c", str(4096 * slots)]
    return command + (["-md", str(draft)] if draft else [])


def table(out: Path) -> str:
    lines = [
        "| workload | concurrency | specserve | tok/s | llama-server-draft tok/s | "
        "llama-server tok/s | / llama-server-draft | / llama-server | "
        "TTFT p50 ms: specserve / -draft / target only | specserve acceptance |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[str, int, str], dict[str, dict]] = {}
    # specserve's drafted and accepted tokens, pooled over its two comparisons of a cell.
    spec: dict[tuple[str, int, str], list[float]] = {}
    for path in sorted(out.glob("*/results.json")):
        data = json.loads(path.read_text())
        ours, other = data["servers"]
        key = (data["config"]["workload"], int(data["config"]["load"].split()[-1]), ours)
        cell = cells.setdefault(key, {})
        cell[other] = data["servers"][other]["summary"] | {"ratio": data["paired_speedup"]}
        cell[ours] = data["servers"][ours]["summary"]
        counts = data["servers"][ours].get("speculation") or {}
        pooled = spec.setdefault(key, [0.0, 0.0])
        pooled[0] += counts.get("accepted_tokens", 0.0)
        pooled[1] += counts.get("draft_tokens", 0.0)
    for (workload, level, ours), cell in sorted(cells.items()):
        mine, drafted, plain = (cell.get(k, {}) for k in (ours, *LABELS.values()))
        throughput = [fmt(s.get("output_throughput")) for s in (mine, drafted, plain)]
        ttft = [fmt(s.get("ttft_ms", {}).get("p50"), 0) for s in (mine, drafted, plain)]
        ratios = [paired(s["ratio"]) if "ratio" in s else "-" for s in (drafted, plain)]
        accepted, drafted_tokens = spec[(workload, level, ours)]
        acceptance = fmt(accepted / drafted_tokens) if drafted_tokens else "-"
        lines.append(
            f"| {workload} | {level} | {ours} | {' | '.join(throughput)} | {' | '.join(ratios)} "
            f"| {' / '.join(ttft)} | {acceptance} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--llama-server",
        default=str(ROOT / ".venv" / "llama.cpp" / "llama-server"),
        help="the binary (default: what scripts/build_llama_server.sh built, else PATH's)",
    )
    parser.add_argument("--workloads", nargs="+", default=["coding-chat", "prose"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--specserve",
        action="append",
        metavar="LABEL=FLAGS",
        help="a specserve configuration, run in turn against the same llama-servers, e.g. "
        f"'int8=--quantization int8' (default: '{DEFAULT_CONFIGURATION}')",
    )
    parser.add_argument("--tables-only", action="store_true")
    args = parser.parse_args()
    if not args.tables_only:
        _run(args)
    markdown = table(args.out)
    (args.out / "llamacpp.md").write_text(markdown)
    print(markdown)


def _run(args: argparse.Namespace) -> None:
    binary = (
        args.llama_server if Path(args.llama_server).is_file() else shutil.which("llama-server")
    )
    if binary is None:
        raise SystemExit("no llama-server: run scripts/build_llama_server.sh .venv/llama.cpp")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    record = args.out / "commands.txt"
    (args.out / "lscpu.txt").write_text(subprocess.check_output(["lscpu"], text=True))
    version = subprocess.run([binary, "--version"], capture_output=True, text=True)
    with record.open("a") as commands:
        commands.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}\n")
        commands.write(f"# llama-server --version: {version.stderr.strip()}\n")
    slots = max(args.concurrency)
    draft = _gguf(DRAFT)
    llama_servers = [
        ("llama-server-draft", _llama_server(binary, DRAFTED_PORT, slots, draft), DRAFTED_PORT),
        ("llama-server", _llama_server(binary, TARGET_ONLY_PORT, slots, None), TARGET_ONLY_PORT),
    ]
    started = []
    try:
        for name, command, port in llama_servers:
            started.append(_launch(name, command, port, args.out))
        for configuration in args.specserve or [DEFAULT_CONFIGURATION]:
            label, _, flags = configuration.partition("=")
            command = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1"]
            command += ["--port", str(SPECSERVE_PORT), "--metrics-port", str(SPECSERVE_PORT)]
            specserve = _launch(label, command + flags.split(), SPECSERVE_PORT, args.out)
            try:
                _compare_all(args, label)
                _record_rss(label, specserve, args.out)
            finally:
                stop(specserve)
        for (name, _, _), process in zip(llama_servers, started, strict=True):
            _record_rss(name, process, args.out)
    finally:
        for process in reversed(started):
            stop(process)


def _record_rss(name: str, process: subprocess.Popen[bytes], out: Path) -> None:
    """Resident memory of the server's whole process tree after its runs, to commands.txt."""
    root = psutil.Process(process.pid)
    rss = root.memory_info().rss + sum(
        child.memory_info().rss for child in root.children(recursive=True)
    )
    with (out / "commands.txt").open("a") as commands:
        commands.write(f"# {name} RSS after its runs: {rss / 2**30:.2f} GiB (process tree)\n")


def _launch(name: str, command: list[str], port: int, out: Path) -> subprocess.Popen[bytes]:
    with (out / "commands.txt").open("a") as commands:
        commands.write(f"{' '.join(command)} &\n")
    process, seconds = _start(name, command, dict(os.environ), port, out / "logs")
    with (out / "commands.txt").open("a") as commands:
        commands.write(f"# {name} healthy after {seconds:.0f} s\n")
    return process


def _compare_all(args: argparse.Namespace, label: str) -> None:
    for workload in args.workloads:
        for level in args.concurrency:
            for port, other in LABELS.items():
                _loadtest(
                    [
                        "compare", "--a", f"http://127.0.0.1:{SPECSERVE_PORT}",
                        "--a-label", label, "--b", f"http://127.0.0.1:{port}",
                        "--b-label", other, "--workload", workload,
                        "--concurrency", str(level), "--rounds", str(args.rounds),
                        "--num-requests", str(max(level, 2) * args.rounds),
                        "--max-tokens", str(args.max_tokens), "--temperature", "0",
                        "--warmup", "1", "--seed", "0", "--no-progress", "--no-plots",
                        "--output-dir", str(args.out / f"{label}-vs-{other}-{workload}-c{level}"),
                    ],
                    args.out / "commands.txt",
                )  # fmt: skip


if __name__ == "__main__":
    main()
