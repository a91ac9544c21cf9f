"""Publishable speculation and front-end numbers, measured with loadtest.

1. Starts `specserve serve` with speculation (`--speculation fixed`: K=2,
   speculation up to a batch of 1; bf16, as vLLM's server below) and with
   `--no-speculation`, on the default pair, and
   runs `python -m loadtest sweep` (a compare at each concurrency level, in
   alternating rounds) for every bundled workload at concurrency 1 and a
   higher one.
2. Stops the speculative server, starts vLLM's own OpenAI server with the
   engine settings specserve uses on CPU (eager, bf16, seed 0, same
   max-num-seqs and KV cache, all cores bound, Intel OpenMP preloaded), and
   compares specserve without speculation against it, streamed and whole
   replies, one full batch per server per round (two requests at
   concurrency 1): what our front end costs.

`--model` runs both parts on another target (the speculation sweep needs the
bundled pair's draft, so pair it with `--skip-speculation`): a tiny model
makes engine steps short enough that the front ends' per-token costs show, as
on a GPU.

Every loadtest command is printed and written to <out>/commands.txt; each
run's results.json, summary.md and plots go to a folder under <out>, and
<out>/tables.md gathers the headline tables (`--tables-only` rebuilds it).

    .venv/bin/python scripts/bench_loadtest.py --out docs/benchmarks/results
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from loadtest.analysis import ratio
from loadtest.launch import stop, wait_until_up
from loadtest.report import paired
from loadtest.workloads import BUNDLED
from server.config import DEFAULT_CACHE_DIR
from server.weights.embedded import TARGET, model_dir

# Longest a server may take to load its models and calibrate (a cold start exports quantized
# copies first).
STARTUP_SECONDS = 1800


def _start(
    name: str,
    command: list[str],
    env: dict[str, str],
    port: int,
    logs: Path,
    cwd: Path | None = None,
) -> tuple[subprocess.Popen[bytes], float]:
    print(f"[{name}] {' '.join(command)}", flush=True)
    # Another server on the port would answer the health check in this one's place, and
    # every measurement would be of it.
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise SystemExit(f"[{name}] port {port} is already in use; stop what listens there")
    log = logs / f"{name}.log"
    process = subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=cwd
    )
    startup = wait_until_up(process, f"http://127.0.0.1:{port}/health", STARTUP_SECONDS, log)
    print(f"[{name}] healthy after {startup:.0f} s", flush=True)
    return process, startup


def _loadtest(args: list[str], record: Path) -> None:
    command = [sys.executable, "-m", "loadtest", *args]
    line = " ".join(command[1:])
    print(f"$ python {line}", flush=True)
    with record.open("a") as commands:
        commands.write(f"python {line}\n")
    started = time.perf_counter()
    subprocess.run(command, check=True)
    print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(out: Path) -> str:
    """Headline Markdown tables from the results.json files under `out`."""
    lines = [
        "### Speculation on vs off (specserve, default pair)",
        "",
        "| workload | concurrency | no-spec tok/s | spec tok/s | speedup | TPOT p50 ms "
        "no-spec / spec | TTFT p50 ms no-spec / spec | acceptance | mean acceptance length |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    schedules = []
    for path in sorted(out.glob("spec-vs-nospec-*/results.json")):
        data = json.loads(path.read_text())
        workload = data["config"]["workload"]
        for level in data["levels"]:
            spec, plain = level["servers"]["spec"], level["servers"]["no-spec"]
            s, p = spec["summary"], plain["summary"]
            figures = spec["speculation"] or {}
            failed = s["failed"] + p["failed"]
            lines.append(
                f"| {workload} | {level['level']} | {_fmt(p['output_throughput'])} | "
                f"{_fmt(s['output_throughput'])} | {_fmt(level['speedup'])} | "
                f"{_fmt(p['tpot_ms']['p50'], 0)} / {_fmt(s['tpot_ms']['p50'], 0)} | "
                f"{_fmt(p['ttft_ms']['p50'], 0)} / {_fmt(s['ttft_ms']['p50'], 0)} | "
                f"{_fmt(figures.get('acceptance_rate'))} | "
                f"{_fmt(figures.get('mean_acceptance_length'))} |"
                + (f" ({failed} failed)" if failed else "")
            )
        table = data["suggestion"]["num_speculative_tokens_per_batch_size"]
        schedules.append(f"- {workload}: `{json.dumps(table)}`")
    lines += ["", "Suggested `num_speculative_tokens_per_batch_size` per workload:", "", *schedules]
    lines += [
        "",
        "### Front end: specserve vs vLLM's OpenAI server (no speculation, same engine)",
        "",
        "Ratio: specserve's output tokens/s over vLLM's, round by round (95% interval). "
        "Latency: TPOT p50 for streamed replies, E2EL p50 for whole ones (a client sees "
        "no token of those before the last).",
        "",
        "| workload | replies | concurrency | vLLM tok/s | specserve tok/s | ratio | "
        "latency p50 ms vLLM / specserve | latency ratio | TTFT p50 ms vLLM / specserve |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    results = [json.loads(p.read_text()) for p in out.glob("specserve-vs-vllm-*/results.json")]
    results.sort(
        key=lambda data: (
            data["config"]["workload"],
            not data["config"]["stream"],
            int(data["config"]["load"].split()[-1]),
        )
    )
    for data in results:
        ours, theirs = (data["servers"][k]["summary"] for k in ("specserve", "vllm"))
        failed = ours["failed"] + theirs["failed"]
        latency = "tpot_ms" if data["config"]["stream"] else "e2el_ms"
        lines.append(
            f"| {data['config']['workload']} | "
            f"{'streamed' if data['config']['stream'] else 'whole'} | "
            f"{data['config']['load'].split()[-1]} | "
            f"{_fmt(theirs['output_throughput'])} | {_fmt(ours['output_throughput'])} | "
            f"{paired(data['paired_speedup'])} | "
            f"{_fmt(theirs[latency]['p50'], 0)} / {_fmt(ours[latency]['p50'], 0)} | "
            f"{_fmt(ratio(ours[latency]['p50'], theirs[latency]['p50']), 3)} | "
            f"{_fmt(theirs['ttft_ms']['p50'], 0)} / {_fmt(ours['ttft_ms']['p50'], 0)} |"
            + (f" ({failed} failed)" if failed else "")
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/results"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--num-requests", type=int, default=4, help="per server per level of the speculation sweep"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workloads", nargs="+", default=list(BUNDLED))
    parser.add_argument(
        "--overhead-workloads",
        nargs="+",
        default=["coding-chat", "code-completion"],
        help="workloads for specserve vs vLLM's server",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=model_dir(DEFAULT_CACHE_DIR, TARGET),
        help="target folder for both servers (the speculation sweep needs the bundled pair)",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--skip-speculation", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--tables-only", action="store_true", help="rebuild <out>/tables.md")
    args = parser.parse_args()
    if args.tables_only:
        (args.out / "tables.md").write_text(tables(args.out))
        print(tables(args.out))
        return

    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    record = args.out / "commands.txt"
    # bf16 and fixed K=2 up to a batch of 1, as vLLM's server below runs and as these
    # numbers were first measured (the defaults now pick the dtype and K per machine).
    engine = [
        "--model", str(args.model), "--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    # Each server's /metrics on its API port, where loadtest reads them by default.
    serve = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1"]
    with record.open("a") as commands:
        commands.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}\n")
    common = [
        "--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds),
        "--warmup", "1", "--seed", "0", "--no-progress",
    ]  # fmt: skip
    levels = [str(c) for c in args.concurrency]
    env = dict(os.environ)

    plain, _ = _start(
        "specserve-no-spec",
        [*serve, "--port", "8302", "--metrics-port", "8302", "--no-speculation", *engine],
        env,
        8302,
        logs,
    )
    try:
        if not args.skip_speculation:
            spec_flags = ["--port", "8301", "--metrics-port", "8301", "--speculation", "fixed"]
            spec_flags += engine
            spec, _ = _start("specserve-spec", [*serve, *spec_flags], env, 8301, logs)
            try:
                for workload in args.workloads:
                    _loadtest(
                        [
                            "sweep", "--a", "http://127.0.0.1:8301", "--a-label", "spec",
                            "--b", "http://127.0.0.1:8302", "--b-label", "no-spec",
                            "--workload", workload, "--concurrency", *levels,
                            "--max-batch", str(args.max_num_seqs),
                            "--num-requests", str(args.num_requests), *common,
                            "--output-dir", str(args.out / f"spec-vs-nospec-{workload}"),
                        ],
                        record,
                    )  # fmt: skip
            finally:
                stop(spec)
        if not args.skip_overhead:
            # What specserve's engine adapter sets on CPU (configure_cpu_runtime).
            vllm_env = dict(env)
            vllm_env.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND",
                ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
            )
            vllm_env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
            iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
            if iomp.is_file():
                vllm_env["LD_PRELOAD"] = str(iomp)
            vllm_command = [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--host", "127.0.0.1", "--port", "8303", "--model", str(args.model),
                "--served-model-name", args.model.name, "--dtype", args.dtype,
                "--seed", "0", "--max-num-seqs", str(args.max_num_seqs), "--enforce-eager",
            ]  # fmt: skip
            print(
                "[vllm] env VLLM_CPU_OMP_THREADS_BIND="
                f"{vllm_env['VLLM_CPU_OMP_THREADS_BIND']} VLLM_CPU_KVCACHE_SPACE="
                f"{vllm_env['VLLM_CPU_KVCACHE_SPACE']} LD_PRELOAD={vllm_env.get('LD_PRELOAD', '')}",
                flush=True,
            )
            vllm, _ = _start("vllm-server", vllm_command, vllm_env, 8303, logs)
            try:
                for workload in args.overhead_workloads:
                    for replies, flags in (("streamed", []), ("whole", ["--no-stream"])):
                        for level in args.concurrency:
                            name = f"specserve-vs-vllm-{workload}-{replies}-c{level}"
                            requests = max(level, 2) * args.rounds
                            _loadtest(
                                [
                                    "compare", "--a", "http://127.0.0.1:8302",
                                    "--a-label", "specserve",
                                    "--b", "http://127.0.0.1:8303", "--b-label", "vllm",
                                    "--workload", workload, "--concurrency", str(level),
                                    "--num-requests", str(requests), *flags, *common,
                                    "--output-dir", str(args.out / name),
                                ],
                                record,
                            )  # fmt: skip
            finally:
                stop(vllm)
    finally:
        stop(plain)
    (args.out / "tables.md").write_text(tables(args.out))
    print(tables(args.out))


if __name__ == "__main__":
    main()
