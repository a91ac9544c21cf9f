"""Never slower: speculation `auto` (with each kind of draft) and fixed K=2 / K=4 against
no speculation.

The `specserve serve` configurations on the default pair:

- no-spec: `--no-speculation`
- auto:    the default: the autopilot picks K per engine step, with the default draft
           (`--draft-quantization auto`, `--draft-vocab auto`: on a CPU with int8 dot
           products the int8 draft with its head trimmed to 32k ids) and lookups
           (`--speculative-method hybrid`)
- auto-draft-only: auto with the draft alone (`--speculative-method draft_model`)
- auto-vocab-16k, auto-vocab-64k: auto with the head trimmed to 16,384 or 65,536 ids
           (`--draft-vocab N`), beside the default's 32,768
- auto-int8-full-head: auto with `--draft-quantization int8 --draft-vocab none`
- auto-unquantized: auto with `--draft-quantization none --draft-vocab none` (the draft
           in the engine's dtype with its whole head: the default before the cheap drafts)
- fixed-2: `--speculation fixed --num-speculative-tokens 2
           --speculation-max-batch-size <max-num-seqs>` (speculating at every batch size)
- fixed-4: the same with K=4

run one at a time (in float32, the dtype `auto` picks on CPUs without native
bf16, two servers do not fit in 24 GB), in ABBA order over the whole run:
no-spec, auto, fixed-2, fixed-4, fixed-4, fixed-2, auto, no-spec. Each server
runs `python -m loadtest run` per workload (coding-chat and prose by default)
at every concurrency level, with the same seeded prompts, so drift over the
run hits every configuration alike and each ratio comes from one run.

Every command is printed and written to <out>/commands.txt; each run's
results go to <out>/pass<N>-<config>/<workload>-c<level>/, and
<out>/autopilot.md holds one table: output tokens/s over no-spec's per
configuration, auto / best fixed, auto's acceptance and K mix, and how many
greedy replies equal no-spec's (`--tables-only` rebuilds it). Engine flags
after `--` go to every server.

    .venv/bin/python scripts/bench_autopilot.py --out loadtest-results/autopilot \\
        --concurrency 1 2 4 8 --max-tokens 32 -- --max-model-len 4096

Server restarts an hour apart let machine drift into every ratio (the same
configuration measured twice differed by up to 29% per cell here). `--paired R`
measures each configuration against K=0 on its own server, without that
drift: per workload and concurrency a `loadtest compare` of the configuration
against the same server's requests with speculation off (`{"speculation":
{"max_draft_tokens": 0}}`: K=0, the draft idle, what `--no-speculation` runs)
in R alternating rounds (ABBA) of `concurrency` requests each. auto runs on an
auto server; fixed-2 and fixed-4 on one fixed server at the larger K, fixed-2
as its requests capped at 2 (`max_draft_tokens`: the step's K is 2, the draft
proposes 2). Results go to <out>/paired/<config>/<workload>-c<level>/, each auto
server's /health at the end of its run to <out>/paired/<config>/health.json, and
<out>/paired.md gives each configuration's round-by-round ratio over K=0 with
its 95% interval per cell, auto / best fixed as the ratio of those ratios, and
per auto configuration its cost model: the draft's seconds per position against a
plain step, and acceptance by position.

    .venv/bin/python scripts/bench_autopilot.py --out loadtest-results/autopilot-paired \\
        --paired 8 --concurrency 1 2 4 8 --max-tokens 32 -- --max-model-len 4096
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

import httpx
from bench_loadtest import _loadtest, _start

from loadtest.analysis import ratio

# The scripts folder is on sys.path when this file runs as a script.
from loadtest.launch import stop
from loadtest.report import fmt, paired
from loadtest.workloads import BUNDLED

CONFIGS = (
    "auto",
    "auto-draft-only",
    "auto-vocab-16k",
    "auto-vocab-64k",
    "auto-int8-full-head",
    "auto-unquantized",
    "fixed-2",
    "fixed-4",
)
AUTO_CONFIGS = tuple(c for c in CONFIGS if c.startswith("auto"))
DRAFT_FLAGS = {
    "auto": [],
    "auto-draft-only": ["--speculative-method", "draft_model"],
    "auto-vocab-16k": ["--draft-vocab", "16384"],
    "auto-vocab-64k": ["--draft-vocab", "65536"],
    "auto-int8-full-head": ["--draft-quantization", "int8", "--draft-vocab", "none"],
    "auto-unquantized": ["--draft-quantization", "none", "--draft-vocab", "none"],
}
PORT = 8101
AUTO_FLOOR, BEST_FLOOR = 0.97, 0.95  # marked below these
SPECULATION_OFF = {"speculation": {"max_draft_tokens": 0}}


def _flags(config: str, max_num_seqs: int) -> list[str]:
    if config in DRAFT_FLAGS:
        return ["--speculation", "auto", *DRAFT_FLAGS[config]]
    return [
        "--speculation", "fixed", "--num-speculative-tokens", str(_fixed_k(config)),
        "--speculation-max-batch-size", str(max_num_seqs),
    ]  # fmt: skip


def _cpu(out: Path) -> list[str]:
    saved = out / "lscpu.txt"
    text = saved.read_text() if saved.is_file() else subprocess.check_output(["lscpu"], text=True)
    return [line for line in text.splitlines() if line.startswith(("Model name:", "Flags:"))]


def _mark(value: float | None, floor: float) -> str:
    return f"**{fmt(value)}** ⚠" if value is not None and value < floor else fmt(value)


def _auto_speculation(runs: list[dict[str, Any]]) -> tuple[str, str]:
    """Acceptance rate / mean acceptance length, and the K mix, of the auto server."""
    summaries = [r["speculation"] for run in runs for r in run["records"] if r.get("speculation")]
    drafts = sum(s.get("drafts", 0) for s in summaries)
    accepted = sum(s.get("accepted_tokens", 0) for s in summaries)
    rate = ratio(accepted, sum(s.get("draft_tokens", 0) for s in summaries))
    length = 1 + accepted / drafts if drafts else None
    steps: Counter[int] = Counter()
    for s in summaries:
        steps.update({int(k): n for k, n in (s.get("steps_by_k") or {}).items()})
    total = sum(steps.values())
    mix = ", ".join(f"K{k} {100 * n / total:.0f}%" for k, n in sorted(steps.items()) if total)
    return f"{fmt(rate)} / {fmt(length)}", mix or "-"


def _throughput(runs: list[dict[str, Any]]) -> float | None:
    """Output tokens/s over all of a configuration's runs of one cell."""
    tokens = sum(run["summary"]["total_output_tokens"] for run in runs)
    seconds = sum(run["summary"]["duration_s"] for run in runs)
    return tokens / seconds if seconds else None


def _identical(runs: list[dict[str, Any]], plain: list[dict[str, Any]]) -> str:
    """Greedy replies equal to no-spec's for the same prompt (same seeded sequence)."""
    reference = {
        (r["index"], r["item"]): r["text"] for run in plain for r in run["records"] if r["success"]
    }
    pairs = [
        (r["text"], reference[(r["index"], r["item"])])
        for run in runs
        for r in run["records"]
        if r["success"] and (r["index"], r["item"]) in reference
    ]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def table(out: Path) -> str:
    """<out>/autopilot.md from the results.json files under <out>/pass*-<config>/."""
    cells: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    for path in sorted(out.glob("pass*/*/results.json")):
        config = path.parent.parent.name.split("-", 1)[1]
        data = json.loads(path.read_text())
        level = int(path.parent.name.rsplit("-c", 1)[1])
        key = (data["config"]["workload"], level)
        cells.setdefault(key, {}).setdefault(config, []).append(data["servers"][config])
    lines = [
        "### Speculation auto vs fixed K, each against no speculation",
        "",
        "```text",
        *_cpu(out),
        "```",
        "",
        "Output tokens/s over the no-speculation server's, each configuration's two runs "
        "(ABBA order over the whole benchmark) pooled; auto / best fixed = auto's ratio over "
        f"the larger of fixed-2's and fixed-4's. ⚠: auto below {AUTO_FLOOR}x no-spec or below "
        f"{BEST_FLOOR}x best fixed. Acceptance and K mix (engine steps by K) from auto's "
        "per-response speculation summaries; identical text: greedy replies equal to "
        f"no-spec's for the same prompt ({' / '.join(CONFIGS)}); failed: requests of all "
        "the cell's runs.",
        "",
        f"| workload | concurrency | no-spec tok/s | {' | '.join(CONFIGS)} | "
        "auto / best fixed | auto acceptance rate / mean length | auto K mix | "
        "identical text | failed |",
        "|---|---|---|" + "---|" * len(CONFIGS) + "---|---|---|---|---|",
    ]
    for (workload, concurrency), runs in sorted(cells.items()):
        plain = _throughput(runs.get("no-spec", []))
        gains = {c: ratio(_throughput(runs[c]), plain) if c in runs else None for c in CONFIGS}
        fixed = [g for c, g in gains.items() if c.startswith("fixed-") and g is not None]
        vs_best = ratio(gains["auto"], max(fixed)) if fixed and gains["auto"] else None
        acceptance, mix = _auto_speculation(runs["auto"]) if "auto" in runs else ("-", "-")
        identical = " / ".join(
            _identical(runs[c], runs.get("no-spec", [])) if c in runs else "-" for c in CONFIGS
        )
        failed = sum(run["summary"]["failed"] for group in runs.values() for run in group)
        columns = [_mark(gains["auto"], AUTO_FLOOR), *(fmt(gains[c]) for c in CONFIGS[1:])]
        lines.append(
            f"| {workload} | {concurrency} | {fmt(plain)} | {' | '.join(columns)} | "
            f"{_mark(vs_best, BEST_FLOOR)} | {acceptance} | {mix} | {identical} | {failed} |"
        )
    return "\n".join(lines) + "\n"


def paired_table(out: Path) -> str:
    """<out>/paired.md from the compare results under <out>/paired/<config>/."""
    cells: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for path in sorted(out.glob("paired/*/*/results.json")):
        data = json.loads(path.read_text())
        level = int(path.parent.name.rsplit("-c", 1)[1])
        cells.setdefault((data["config"]["workload"], level), {})[path.parent.parent.name] = data
    lines = [
        "### Speculation auto and fixed K, each against K=0 on its own server, round by round",
        "",
        "```text",
        *_cpu(out),
        "```",
        "",
        "Output tokens/s of each configuration over the same server's requests with "
        'speculation off (`{"speculation": {"max_draft_tokens": 0}}`: K=0, the draft idle), '
        "geometric mean of the per-round ratios of alternating rounds (ABBA) and its 95% "
        "interval; auto / best fixed = auto's ratio over the larger of fixed-2's and "
        "fixed-4's; auto / draft-only = auto's ratio over auto-draft-only's (the ratio of two "
        f"servers' ratios, no interval). ⚠: auto's interval lies below {AUTO_FLOOR}x, auto / "
        f"draft-only below {AUTO_FLOOR}, or auto / best fixed below {BEST_FLOOR}. K=0 tok/s "
        "from the auto server's K=0 side; acceptance rate / mean acceptance length and K "
        "mix from each auto configuration's speculating side; "
        "identical text: greedy replies equal to the same server's K=0 ones "
        f"({' / '.join(CONFIGS)}); failed: requests of every side.",
        "",
        f"| workload | concurrency | K=0 tok/s | {' | '.join(f'{c} / K=0' for c in CONFIGS)} | "
        "auto / best fixed | auto / draft-only | "
        f"{' | '.join(f'{c} acceptance / length | {c} K mix' for c in AUTO_CONFIGS)} | "
        "identical text | failed |",
        "|---|---|---|" + "---|" * (len(CONFIGS) + 2 + 2 * len(AUTO_CONFIGS)) + "---|---|",
    ]
    for (workload, concurrency), runs in sorted(cells.items()):
        results = {c: runs[c]["paired_speedup"] if c in runs else None for c in CONFIGS}
        auto = results["auto"]
        flag = " ⚠" if auto and auto["high"] is not None and auto["high"] < AUTO_FLOOR else ""
        fixed = [r["speedup"] for c, r in results.items() if c.startswith("fixed-") and r]
        vs_best = ratio(auto["speedup"], max(fixed)) if auto and fixed else None
        draft_only = results["auto-draft-only"]
        vs_draft = ratio(auto["speedup"], draft_only["speedup"]) if auto and draft_only else None
        sides = {c: runs[c]["servers"] for c in CONFIGS if c in runs}
        plain = sides["auto"]["off"]["summary"]["output_throughput"] if "auto" in sides else None
        speculation = [
            " | ".join(_auto_speculation([sides[c][c]])) if c in sides else "- | -"
            for c in AUTO_CONFIGS
        ]
        identical = " / ".join(
            _identical([sides[c][c]], [sides[c]["off"]]) if c in sides else "-" for c in CONFIGS
        )
        failed = sum(s["summary"]["failed"] for group in sides.values() for s in group.values())
        columns = [f"{paired(auto)}{flag}", *(paired(results[c]) for c in CONFIGS[1:])]
        lines.append(
            f"| {workload} | {concurrency} | {fmt(plain)} | {' | '.join(columns)} | "
            f"{_mark(vs_best, BEST_FLOOR)} | {_mark(vs_draft, AUTO_FLOOR)} | "
            f"{' | '.join(speculation)} | {identical} | {failed} |"
        )
    return "\n".join(lines) + "\n" + _cost_table(out)


def _cost_table(out: Path) -> str:
    """Per auto configuration, its autopilot's cost model and acceptance at the end of its
    run (<out>/paired/<config>/health.json)."""
    lines = [
        "",
        "### The autopilot's cost model per auto configuration, at the end of its run",
        "",
        "Draft s / position: the fitted cost of one draft position at one request; plain "
        "step s: the fitted plain target step at one request; verify s / token: what one "
        "more verified token adds to a step; acceptance by position: the autopilot's "
        "estimate; own-id proposals: the trimmed head's proposals of a request's own ids "
        "outside the kept ones, of all its proposals; accepted / verified by source: proposed "
        "tokens over the whole run (both sides, every workload), from the draft and from "
        "lookups, and the lookups' cost per engine step.",
        "",
        "| configuration | draft s / position | plain step s | draft / plain | "
        "verify s / token | acceptance by position | own-id proposals | "
        "draft accepted / verified | lookup accepted / verified | lookup µs / step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config in AUTO_CONFIGS:
        path = out / "paired" / config / "health.json"
        if not path.is_file():
            continue
        state = json.loads(path.read_text())["details"]["autopilot"]
        draft, plain = state.get("draft_seconds_per_token"), state.get("plain_step_seconds")
        rates = ", ".join(f"{r:.2f}" for r in state.get("acceptance_by_position", []))
        own = (
            f"{state['draft_head_own_proposals']} / {state['draft_head_proposals']}"
            if "draft_head_proposals" in state
            else "-"
        )
        sources = state.get("verified_by_source", {})
        by_source = [
            f"{s['accepted']} / {s['verified']}" if (s := sources.get(source)) else "-"
            for source in ("draft", "lookup")
        ]
        lookup_seconds = state.get("lookup_seconds_per_step")
        lines.append(
            f"| {config} | {fmt(draft, 4)} | {fmt(plain, 4)} | {fmt(ratio(draft, plain))} | "
            f"{fmt(state.get('verify_seconds_per_token'), 4)} | {rates} | {own} | "
            f"{' | '.join(by_source)} | "
            f"{fmt(None if lookup_seconds is None else lookup_seconds * 1e6, 1)} |"
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
    parser.add_argument(
        "--configs", nargs="+", choices=["no-spec", *CONFIGS], default=["no-spec", *CONFIGS]
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=list(BUNDLED), default=["coding-chat", "prose"]
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--num-requests", type=int, help="per server per level and pass (default max(4, 2 x level))"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=int, help="default: the server's own")
    parser.add_argument(
        "--paired",
        type=int,
        metavar="ROUNDS",
        help="each configuration against per-request K=0 on its own server, ROUNDS rounds",
    )
    parser.add_argument(
        "--tables-only", action="store_true", help="rebuild <out>/autopilot.md or paired.md"
    )
    args = parser.parse_args(argv)
    if args.tables_only and not args.out.is_dir():
        parser.error(f"--tables-only: no results folder {args.out}")
    if not args.tables_only:
        (_run_paired if args.paired else _run)(args, engine_extra)
    name, markdown = (
        ("paired.md", paired_table(args.out)) if args.paired else ("autopilot.md", table(args.out))
    )
    (args.out / name).write_text(markdown)
    print(markdown)


def _start_recording(args: argparse.Namespace) -> Path:
    """<out>/logs, commands.txt and lscpu.txt; returns commands.txt."""
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    record = args.out / "commands.txt"
    with record.open("a") as commands:
        commands.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}\n")
        commands.write("lscpu > lscpu.txt\n")
    print("$ lscpu", flush=True)
    (args.out / "lscpu.txt").write_text(subprocess.check_output(["lscpu"], text=True))
    return record


def _serve(
    args: argparse.Namespace, engine_extra: list[str], record: Path, name: str, flags: list[str]
) -> subprocess.Popen[bytes]:
    # /metrics on the API port, where loadtest reads the speculation counters by default.
    command = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(PORT)]
    command += ["--metrics-port", str(PORT)]
    command += [*flags, "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_gib is not None:
        command += ["--kv-cache-gib", str(args.kv_cache_gib)]
    command += engine_extra
    with record.open("a") as commands:
        commands.write(f"python {' '.join(command[1:])} &\n")
    return _start(name, command, dict(os.environ), PORT, args.out / "logs")[0]


def _run_paired(args: argparse.Namespace, engine_extra: list[str]) -> None:
    record = _start_recording(args)
    fixed = sorted((c for c in args.configs if c.startswith("fixed-")), key=_fixed_k)
    groups = [(c, [c]) for c in AUTO_CONFIGS if c in args.configs]
    if fixed:
        groups.append((fixed[-1], fixed))  # one server at the largest K serves every fixed K
    for server_config, configs in groups:
        name = f"specserve-{server_config}"
        server = _serve(args, engine_extra, record, name, _flags(server_config, args.max_num_seqs))
        url = f"http://127.0.0.1:{PORT}"
        try:
            for config in configs:
                body = {} if config == server_config else _capped(config)
                for workload in args.workloads:
                    for level in args.concurrency:
                        _loadtest(
                            [
                                "compare", "--a", url, "--a-label", config,
                                "--a-body", json.dumps(body), "--b", url, "--b-label", "off",
                                "--b-body", json.dumps(SPECULATION_OFF),
                                "--workload", workload, "--concurrency", str(level),
                                "--rounds", str(args.paired),
                                "--num-requests", str(args.num_requests or level * args.paired),
                                "--max-tokens", str(args.max_tokens), "--seed", "0",
                                "--no-progress", "--no-plots", "--output-dir",
                                str(args.out / "paired" / config / f"{workload}-c{level}"),
                            ],
                            record,
                        )  # fmt: skip
            if server_config in AUTO_CONFIGS:
                health = httpx.get(f"{url}/health", timeout=30).text
                (args.out / "paired" / server_config / "health.json").write_text(health)
        finally:
            stop(server)


def _fixed_k(config: str) -> int:
    return int(config.removeprefix("fixed-"))


def _capped(config: str) -> dict[str, Any]:
    """The request body that makes a fixed server at a larger K run this config's K."""
    return {"speculation": {"max_draft_tokens": _fixed_k(config)}}


def _run(args: argparse.Namespace, engine_extra: list[str]) -> None:
    record = _start_recording(args)
    order = [*args.configs, *reversed(args.configs)]
    for number, config in enumerate(order):
        flags = ["--no-speculation"] if config == "no-spec" else _flags(config, args.max_num_seqs)
        server = _serve(args, engine_extra, record, f"specserve-{config}-{number}", flags)
        try:
            for workload in args.workloads:
                for level in args.concurrency:
                    count = args.num_requests or max(4, 2 * level)
                    _loadtest(
                        [
                            "run", "--url", f"http://127.0.0.1:{PORT}", "--label", config,
                            "--workload", workload, "--concurrency", str(level),
                            "--num-requests", str(count), "--max-tokens", str(args.max_tokens),
                            "--seed", "0", "--no-progress", "--no-plots", "--output-dir",
                            str(args.out / f"pass{number}-{config}" / f"{workload}-c{level}"),
                        ],
                        record,
                    )  # fmt: skip
        finally:
            stop(server)


if __name__ == "__main__":
    main()
