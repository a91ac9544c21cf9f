"""Never slower: speculation `auto` and fixed K=2 / K=4, each against no speculation.

One `specserve serve --no-speculation` server (port 8101) stays up throughout;
each speculative configuration in turn gets its own server on port 8102:

- auto:    `--speculation auto` (the default: the autopilot picks K per engine step)
- fixed-2: `--speculation fixed --num-speculative-tokens 2
           --speculation-max-batch-size <max-num-seqs>` (speculating at every batch size)
- fixed-4: the same with K=4

and is compared with the no-speculation server by `python -m loadtest sweep
--a <config> --b no-spec` per workload (coding-chat and prose by default) at
every concurrency level. A sweep runs each level in alternating rounds, ABBA
order (A B, then B A; loadtest/runner.py `measure`), both servers getting the
same seeded prompts, so each ratio is measured side by side in one run. Only
two servers are ever up at once (~10 GB each). Levels are grouped by request
count (default max(4, 2 * concurrency) per server per level), one sweep per
group. Servers run as `python -m server serve` (what `specserve` runs).

Every command is printed and written to <out>/commands.txt; each sweep's
results go to <out>/<config>/<workload>-c<levels>/, and <out>/autopilot.md
holds one table: output tokens/s ratio vs no-spec per configuration, auto /
best fixed, and the auto server's acceptance and K mix (`--tables-only`
rebuilds it). Engine flags after `--` go to every server.

    .venv/bin/python scripts/bench_autopilot.py --out loadtest-results/autopilot \\
        --concurrency 1 2 4 8 --max-tokens 64 -- --dtype float32
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# The scripts folder is on sys.path when this file runs as a script.
from bench_loadtest import _loadtest, _start, _stop

from loadtest.analysis import ratio
from loadtest.report import fmt
from loadtest.workloads import BUNDLED

CONFIGS = ("auto", "fixed-2", "fixed-4")
PLAIN_PORT, SPEC_PORT = 8101, 8102
AUTO_FLOOR, BEST_FLOOR = 0.97, 0.95  # marked below these


def _flags(config: str, max_num_seqs: int) -> list[str]:
    if config == "auto":
        return ["--speculation", "auto"]
    k = config.removeprefix("fixed-")
    return [
        "--speculation", "fixed", "--num-speculative-tokens", k,
        "--speculation-max-batch-size", str(max_num_seqs),
    ]  # fmt: skip


def _cpu(out: Path) -> list[str]:
    saved = out / "lscpu.txt"
    text = saved.read_text() if saved.is_file() else subprocess.check_output(["lscpu"], text=True)
    return [line for line in text.splitlines() if line.startswith(("Model name:", "Flags:"))]


def _mark(value: float | None, floor: float) -> str:
    return f"**{fmt(value)}** ⚠" if value is not None and value < floor else fmt(value)


def _auto_speculation(server: dict[str, Any]) -> tuple[str, str]:
    """Acceptance rate / mean acceptance length, and the K mix, of the auto server."""
    summaries = [r["speculation"] for r in server["records"] if r.get("speculation")]
    drafts = sum(s.get("drafts", 0) for s in summaries)
    figures = server.get("speculation") or {}
    rate, length = figures.get("acceptance_rate"), figures.get("mean_acceptance_length")
    if rate is None and drafts:  # no /metrics counters: the per-request summaries
        accepted = sum(s.get("accepted_tokens", 0) for s in summaries)
        rate = ratio(accepted, sum(s.get("draft_tokens", 0) for s in summaries))
        length = 1 + accepted / drafts
    steps: Counter[int] = Counter()
    for s in summaries:
        steps.update({int(k): n for k, n in (s.get("steps_by_k") or {}).items()})
    total = sum(steps.values())
    mix = ", ".join(f"K{k} {100 * n / total:.0f}%" for k, n in sorted(steps.items()) if total)
    return f"{fmt(rate)} / {fmt(length)}", mix or "-"


def _identical(level: dict[str, Any], config: str) -> str:
    """Requests whose greedy text equals the no-speculation server's for the same
    prompt (both servers run the same seeded request sequence)."""
    plain = {r["index"]: r for r in level["servers"]["no-spec"]["records"] if r["success"]}
    pairs = [
        (r["text"], plain[r["index"]]["text"])
        for r in level["servers"][config]["records"]
        if r["success"] and r["index"] in plain and r["item"] == plain[r["index"]]["item"]
    ]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def table(out: Path) -> str:
    """<out>/autopilot.md from the results.json files under <out>/<config>/."""
    rows: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for path in sorted(out.glob("*/*/results.json")):
        if path.parent.parent.name in CONFIGS:
            data = json.loads(path.read_text())
            for level in data["levels"]:
                key = (data["config"]["workload"], level["level"])
                rows.setdefault(key, {})[path.parent.parent.name] = level
    lines = [
        "### Speculation auto vs fixed K, each against no speculation",
        "",
        "```text",
        *_cpu(out),
        "```",
        "",
        "Output tokens/s over the no-speculation server's in the same sweep (ABBA rounds); "
        "auto / best fixed = auto's ratio over the larger of fixed-2's and fixed-4's. "
        f"⚠: auto below {AUTO_FLOOR}x no-spec or below {BEST_FLOOR}x best fixed. "
        "Auto acceptance from its /metrics counters; K mix: engine steps by K summed over "
        "the requests' own speculation summaries; identical text: greedy replies equal to the "
        "no-speculation server's for the same prompt (auto / fixed-2 / fixed-4); failed: "
        "requests of all the row's servers.",
        "",
        "| workload | concurrency | auto | fixed-2 | fixed-4 | auto / best fixed | "
        "auto acceptance rate / mean length | auto K mix | identical text | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, concurrency), levels in sorted(rows.items()):
        gains = {c: levels[c]["speedup"] if c in levels else None for c in CONFIGS}
        fixed = [g for c, g in gains.items() if c != "auto" and g is not None]
        vs_best = ratio(gains["auto"], max(fixed)) if fixed else None
        acceptance, mix = ("-", "-")
        if "auto" in levels:
            acceptance, mix = _auto_speculation(levels["auto"]["servers"]["auto"])
        identical = " / ".join(_identical(levels[c], c) if c in levels else "-" for c in CONFIGS)
        failed = sum(
            s["summary"]["failed"] for level in levels.values() for s in level["servers"].values()
        )
        lines.append(
            f"| {workload} | {fmt(concurrency)} | {_mark(gains['auto'], AUTO_FLOOR)} | "
            f"{fmt(gains['fixed-2'])} | {fmt(gains['fixed-4'])} | {_mark(vs_best, BEST_FLOOR)} | "
            f"{acceptance} | {mix} | {identical} | {failed} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    argv = sys.argv[1:]
    engine_extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [-- engine flags for every specserve server]",
    )
    parser.add_argument("--out", type=Path, default=Path("loadtest-results/autopilot"))
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument(
        "--workloads", nargs="+", choices=list(BUNDLED), default=["coding-chat", "prose"]
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--num-requests", type=int, help="per server per level (default max(4, 2 * concurrency))"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=int, help="default: the server's own")
    parser.add_argument("--tables-only", action="store_true", help="rebuild <out>/autopilot.md")
    args = parser.parse_args(argv)
    if args.tables_only and not args.out.is_dir():
        parser.error(f"--tables-only: no results folder {args.out}")
    if not args.tables_only:
        _run(args, engine_extra)
    markdown = table(args.out)
    (args.out / "autopilot.md").write_text(markdown)
    print(markdown)


def _run(args: argparse.Namespace, engine_extra: list[str]) -> None:
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    record = args.out / "commands.txt"
    with record.open("a") as commands:
        commands.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}\n")
        commands.write("lscpu > lscpu.txt\n")
    print("$ lscpu", flush=True)
    (args.out / "lscpu.txt").write_text(subprocess.check_output(["lscpu"], text=True))
    engine = ["--max-num-seqs", str(args.max_num_seqs), *engine_extra]
    if args.kv_cache_gib is not None:
        engine = ["--kv-cache-gib", str(args.kv_cache_gib), *engine]

    def serve(name: str, port: int, flags: list[str]) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(port), *flags, *engine]
        with record.open("a") as commands:
            commands.write(f"python {' '.join(command[1:])} &\n")
        return _start(name, command, dict(os.environ), port, logs)[0]

    groups: dict[int, list[str]] = {}
    for level in args.concurrency:
        groups.setdefault(args.num_requests or max(4, 2 * level), []).append(str(level))
    plain = serve("specserve-no-spec", PLAIN_PORT, ["--no-speculation"])
    try:
        for config in args.configs:
            spec = serve(f"specserve-{config}", SPEC_PORT, _flags(config, args.max_num_seqs))
            try:
                for workload in args.workloads:
                    for count, levels in groups.items():
                        _loadtest(
                            [
                                "sweep", "--a", f"http://127.0.0.1:{SPEC_PORT}",
                                "--a-label", config, "--b", f"http://127.0.0.1:{PLAIN_PORT}",
                                "--b-label", "no-spec", "--workload", workload,
                                "--concurrency", *levels, "--num-requests", str(count),
                                "--max-tokens", str(args.max_tokens),
                                "--max-batch", str(args.max_num_seqs), "--rounds", "2",
                                "--warmup", "1", "--seed", "0", "--no-progress", "--output-dir",
                                str(args.out / config / f"{workload}-c{'-'.join(levels)}"),
                            ],
                            record,
                        )  # fmt: skip
            finally:
                _stop(spec)
    finally:
        _stop(plain)


if __name__ == "__main__":
    main()
