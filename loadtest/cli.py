"""Command line: `python -m loadtest run|compare|sweep|frontend`.

    python -m loadtest run --url http://127.0.0.1:8000 --workload coding-chat \\
        --num-requests 50 --concurrency 4
    python -m loadtest compare --a http://127.0.0.1:8000 --a-label spec \\
        --b http://127.0.0.1:8001 --b-label no-spec --workload prose --num-requests 20
    python -m loadtest sweep --a http://127.0.0.1:8000 --b http://127.0.0.1:8001 \\
        --workload code-completion --concurrency 1 2 4 8 --num-requests 16

Each command writes results.json (every request record), summary.md and PNG
plots into --output-dir, and prints the summary.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from loadtest import analysis, frontend, report, workloads
from loadtest.metrics import parse_slos
from loadtest.runner import Load, Options, Server, measure, open_server, server_result, warm_up


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        default="coding-chat",
        help=f"bundled ({', '.join(workloads.BUNDLED)}) or a JSONL file of prompts",
    )
    bound = parser.add_mutually_exclusive_group()
    bound.add_argument("--num-requests", type=int, help="requests per server (default 20)")
    bound.add_argument("--duration", type=float, help="seconds of sending per server")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s (default inf)")
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson"
    )
    parser.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-stream", action="store_true", help="whole responses (no ITL)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded requests per server")
    parser.add_argument(
        "--no-settle",
        action="store_true",
        help="skip the unrecorded block per server at the measured load before the recorded ones",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", help="Bearer key for /v1/* and /metrics")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft, tpot, e2el"
    )
    parser.add_argument("--output-dir", type=Path, help="default loadtest-results/<command>-<time>")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-plots", action="store_true")


def _pair(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a", required=True, help="URL of server A (e.g. speculation on)")
    parser.add_argument("--b", required=True, help="URL of server B (e.g. the baseline)")
    parser.add_argument("--a-label", default="A")
    parser.add_argument("--b-label", default="B")
    parser.add_argument("--a-body", type=_json_object, default={}, help=BODY_HELP)
    parser.add_argument("--b-body", type=_json_object, default={}, help=BODY_HELP)
    parser.add_argument("--a-metrics-url", help=METRICS_HELP)
    parser.add_argument("--b-metrics-url", help=METRICS_HELP)
    parser.add_argument("--a-api-key", help=KEY_HELP)
    parser.add_argument("--b-api-key", help=KEY_HELP)


BODY_HELP = "JSON object merged into every request body (e.g. a per-request option)"
KEY_HELP = (
    "Bearer key of this side in place of --api-key: two tenants on one server, whose "
    "earlier replies specserve's lookups keep apart"
)
METRICS_HELP = (
    "the server's Prometheus metrics, for speculation figures (default: <url>/metrics; "
    "specserve serves them on its --metrics-port, e.g. http://127.0.0.1:9400/metrics)"
)
# What the runner sets itself: a body may not change what is measured or how.
RUNNER_FIELDS = {
    "model", "prompt", "messages", "suffix", "tools", "stream", "stream_options", "max_tokens",
}  # fmt: skip


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="drive one server")
    run.add_argument("--url", required=True)
    run.add_argument("--label", default="server")
    run.add_argument("--body", type=_json_object, default={}, help=BODY_HELP)
    run.add_argument("--metrics-url", help=METRICS_HELP)
    run.add_argument("--concurrency", type=int, help="closed loop: requests always in flight")
    _common(run)
    compare = commands.add_parser("compare", help="two servers in alternating rounds")
    _pair(compare)
    compare.add_argument("--concurrency", type=int)
    compare.add_argument("--rounds", type=int, default=2, help="alternations, ABBA order")
    _common(compare)
    sweep = commands.add_parser("sweep", help="compare at several load levels")
    _pair(sweep)
    levels = sweep.add_mutually_exclusive_group(required=True)
    levels.add_argument("--concurrency", type=int, nargs="+", help="closed-loop levels")
    levels.add_argument("--request-rates", type=float, nargs="+", help="open-loop levels, req/s")
    sweep.add_argument("--rounds", type=int, default=2)
    sweep.add_argument("--k", type=int, help="K for the schedule (default: A's, from /metrics)")
    sweep.add_argument("--max-batch", type=int, default=256, help="top of the schedule")
    sweep.add_argument(
        "--margin", type=float, default=0.0, help="speculation pays when speedup > 1 + margin"
    )
    _common(sweep)
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.num_requests is None and args.duration is None:
        args.num_requests = 20
    positive = {
        "--num-requests": args.num_requests,
        "--duration": args.duration,
        "--max-tokens": args.max_tokens,
        "--max-concurrency": args.max_concurrency,
        "--rounds": getattr(args, "rounds", 1),
        "--burstiness": args.burstiness,
        "--request-rate": args.request_rate,
    }
    for flag, value in positive.items():
        if value is not None and value <= 0:
            parser.error(f"{flag} must be positive")
    levels = args.concurrency if isinstance(args.concurrency, list) else [args.concurrency]
    if any(c is not None and c < 1 for c in levels):
        parser.error("--concurrency must be at least 1")
    if args.num_requests is not None and args.num_requests < getattr(args, "rounds", 1):
        parser.error("--num-requests must be at least --rounds")
    if args.warmup < 0:
        parser.error("--warmup cannot be negative")
    for flag in ("body", "a_body", "b_body"):
        taken = sorted(RUNNER_FIELDS & set(getattr(args, flag, None) or {}))
        if taken:
            parser.error(f"--{flag.replace('_', '-')} may not set {', '.join(taken)}")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    keys = [
        "workload", "num_requests", "duration", "request_rate", "burstiness",
        "max_concurrency", "max_tokens", "temperature", "no_stream", "warmup", "no_settle",
        "seed", "rounds", "goodput",
    ]  # fmt: skip
    config = {k: getattr(args, k, None) for k in keys}
    config["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate
    config["stream"] = not config.pop("no_stream")
    config["settle"] = not config.pop("no_settle")
    return config


async def _open(
    args: argparse.Namespace, options: Options, pairs: list[tuple[str, str, dict[str, Any]]]
) -> list[Server]:
    if args.command == "run":
        metrics_urls = {args.label: args.metrics_url}
        keys = {args.label: args.api_key}
    else:
        metrics_urls = {args.a_label: args.a_metrics_url, args.b_label: args.b_metrics_url}
        keys = {args.a_label: args.a_api_key, args.b_label: args.b_api_key}
    servers = [
        await open_server(
            label,
            url,
            dataclasses.replace(options, api_key=keys[label] or options.api_key),
            body,
            metrics_urls[label],
        )
        for label, url, body in pairs
    ]
    items = workloads.load(args.workload)
    for server in servers:
        await warm_up(server, items, args.warmup, options)
    return servers


async def _measure(
    args: argparse.Namespace, servers: list[Server], load: Load, options: Options
) -> dict[str, dict[str, Any]]:
    await measure(
        servers,
        workloads.load(args.workload),
        load,
        options,
        num_requests=args.num_requests,
        duration=args.duration,
        rounds=getattr(args, "rounds", 1),
        seed=args.seed,
        show_progress=not args.no_progress,
        settle=not args.no_settle,
    )
    slos = parse_slos(args.goodput)
    return {s.label: server_result(s, slos) for s in servers}


def _reset(servers: list[Server]) -> None:
    for server in servers:
        server.records, server.duration, server.speculation = [], 0.0, None
        server.blocks = []


async def _main(args: argparse.Namespace) -> Path:
    options = Options(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stream=not args.no_stream,
        timeout=args.timeout,
        api_key=args.api_key,
        model=args.model,
    )
    out = (
        args.output_dir
        or Path("loadtest-results") / f"{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    out.mkdir(parents=True, exist_ok=True)
    config = _config(args)
    base = {"command": sys.argv, "definitions": report.DEFINITIONS, "config": config}
    if args.command == "run":
        pairs = [(args.label, args.url, args.body)]
    else:
        pairs = [(args.a_label, args.a, args.a_body), (args.b_label, args.b, args.b_body)]
    config["extra_body"] = {label: body for label, _, body in pairs if body}
    servers = await _open(args, options, pairs)
    try:
        if args.command in ("run", "compare"):
            load = Load(args.concurrency, args.request_rate, args.burstiness, args.max_concurrency)
            config["load"] = load.describe()
            results = await _measure(args, servers, load, options)
            data: dict[str, Any] = {**base, "servers": results}
            if args.command == "compare":
                a, b = (results[label]["summary"] for label, _, _ in pairs)
                data["ratios"] = analysis.ratios(a, b)
                data["speedup"] = analysis.speedup(a, b)
                data["paired_speedup"] = analysis.paired_speedup(
                    *(results[label]["blocks"] for label, _, _ in pairs)
                )
            title = f"loadtest {args.command}: {args.workload}"
            markdown = report.run_markdown(title, config, results)
            if args.command == "compare":
                a_label, b_label = (label for label, _, _ in pairs)
                markdown += (
                    f"\nOutput tokens/s {a_label} / {b_label}, round by round: "
                    f"{report.paired(data['paired_speedup'])}\n"
                )
            if not args.no_plots:
                report.plot_latency_cdfs(out / "latency_cdf.png", results)
                report.plot_acceptance(
                    out / "acceptance_by_position.png",
                    {
                        k: (v["speculation"] or {}).get("acceptance_by_position")
                        for k, v in results.items()
                    },
                )
        else:
            data, markdown = await _sweep(args, servers, options, config, base, out)
    finally:
        for server in servers:
            await server.client.aclose()
    report.write_json(out / "results.json", data)
    (out / "summary.md").write_text(markdown)
    print(markdown)
    print(f"results in {out}/")
    return out


async def _sweep(
    args: argparse.Namespace,
    servers: list[Server],
    options: Options,
    config: dict[str, Any],
    base: dict[str, Any],
    out: Path,
) -> tuple[dict[str, Any], str]:
    kind = "concurrency" if args.concurrency else "request rate"
    values: list[float] = args.concurrency or args.request_rates
    levels: list[dict[str, Any]] = []
    for value in values:
        if kind == "concurrency":
            load = Load(concurrency=int(value))
        else:
            load = Load(None, value, args.burstiness, args.max_concurrency)
        print(f"== {kind} {value}", flush=True)
        _reset(servers)
        results = await _measure(args, servers, load, options)
        a, b = (results[s.label]["summary"] for s in servers)
        levels.append(
            {
                "level": value,
                "load": load.describe(),
                "servers": results,
                "ratios": analysis.ratios(a, b),
                "speedup": analysis.speedup(a, b),
                "paired_speedup": analysis.paired_speedup(
                    *(results[s.label]["blocks"] for s in servers)
                ),
            }
        )
    speedups: list[float | None] = [level["speedup"] for level in levels]
    suggestion: dict[str, Any] = {
        "kind": kind,
        "margin": args.margin,
        "stops_paying_at": analysis.stops_paying(values, speedups, args.margin),
        "num_speculative_tokens_per_batch_size": None,
    }
    k = args.k if args.k is not None else servers[0].speculative_tokens
    if kind == "concurrency" and k:
        suggestion["k"] = k
        suggestion["num_speculative_tokens_per_batch_size"] = analysis.schedule(
            [int(v) for v in values], speedups, k, args.margin, args.max_batch
        )
    elif kind == "concurrency":
        suggestion["note"] = (
            "K unknown: pass --k (server A did not export specserve_speculative_tokens)"
        )
    if not args.no_plots:
        report.plot_sweep(out / "sweep.png", kind, levels)
        report.plot_acceptance(
            out / "acceptance_by_position.png",
            {
                f"{servers[0].label} {kind} {level['level']}": (
                    level["servers"][servers[0].label]["speculation"] or {}
                ).get("acceptance_by_position")
                for level in levels
            },
        )
    data = {**base, "levels": levels, "suggestion": suggestion}
    return data, report.sweep_markdown(config, levels, suggestion)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    try:
        parse_slos(args.goodput)
        workloads.load(args.workload)
    except ValueError as exc:
        parser.error(str(exc))
    return args


async def execute(argv: list[str]) -> Path:
    """Run a command inside a running event loop; returns the output folder."""
    return await _main(parse(argv))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["frontend"]:  # no server to point at: a command of its own
        frontend.main(argv[1:])
        return
    asyncio.run(_main(parse(argv)))
