"""Results on disk: JSON with every request record, a Markdown summary, PNG plots.

Plots use matplotlib's Agg backend (no display needed): latency CDFs per
server, acceptance by draft position, and for sweeps output throughput and
TPOT against the load level.
"""

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.analysis import ROWS, SPEC_ROWS, lookup, ratio

DEFINITIONS = (
    "Metrics as vLLM's serving benchmark defines them: TTFT = request sent -> first chunk "
    "with generated text; ITL = every gap between text chunks; TPOT = (E2EL - TTFT) / "
    "(output tokens - 1); E2EL = request sent -> last text chunk; throughputs over the "
    "wall time of the requests; goodput = requests/s meeting every SLO. Failed requests "
    "(HTTP errors such as 429/503, stream errors, timeouts) are counted, not timed. "
    "Speculation from /metrics counter deltas: acceptance rate = accepted / draft tokens, "
    "mean acceptance length = 1 + accepted / drafts, position p = accepted at p / drafts."
)


def _json_safe(value: Any) -> Any:
    """NaN is not JSON: write null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(_json_safe(data), indent=1) + "\n")


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):  # counts
        return str(value)
    return f"{value:.{digits}f}"


def paired(result: dict[str, Any] | None) -> str:
    """A round-by-round speedup with its 95% interval, e.g. "1.03 (0.99-1.07, 8 rounds)"."""
    if result is None:
        return "-"
    interval = f"{fmt(result['low'])}-{fmt(result['high'])}, " if result["low"] is not None else ""
    return f"{fmt(result['speedup'])} ({interval}{result['rounds']} rounds)"


def side_by_side(servers: dict[str, dict[str, Any]]) -> str:
    """Markdown table of every figure per server; with two, a ratio column A/B."""
    labels = list(servers)
    header = ["metric", *labels]
    two = len(labels) == 2
    if two:
        header.append(f"{labels[0]} / {labels[1]}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, path in ROWS:
        values = [lookup(servers[s]["summary"], path) for s in labels]
        if all(v is None for v in values):
            continue  # e.g. goodput without SLOs
        cells = [label, *(fmt(v) for v in values)]
        if two:
            cells.append(fmt(ratio(values[0], values[1])))
        lines.append("| " + " | ".join(cells) + " |")
    for label, key in SPEC_ROWS:
        values = [
            (servers[s].get("speculation") or {}).get(key) for s in labels
        ]  # None: no speculation counters
        cells = [label, *(fmt(v) for v in values)]
        if two:
            cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    positions = [
        " ".join(
            fmt(p) for p in (servers[s].get("speculation") or {}).get("acceptance_by_position", [])
        )
        or "-"
        for s in labels
    ]
    lines.append(
        "| " + " | ".join(["acceptance by position", *positions, *([""] if two else [])]) + " |"
    )
    return "\n".join(lines)


def failures(servers: dict[str, dict[str, Any]]) -> str:
    parts = []
    for label, result in servers.items():
        by_status = result["summary"]["failures_by_status"]
        if by_status:
            detail = ", ".join(f"{k}: {v}" for k, v in sorted(by_status.items()))
            parts.append(f"- {label}: failures {detail}")
        chunks = result["summary"]["output_tokens_from_chunks"]
        if chunks:
            parts.append(
                f"- {label}: {chunks} responses had no usage; their output tokens are "
                "chunk counts (an undercount when chunks hold several tokens)"
            )
    return "\n".join(parts)


def run_markdown(title: str, config: dict[str, Any], servers: dict[str, dict[str, Any]]) -> str:
    lines = [f"# {title}", "", _config_line(config), "", side_by_side(servers), ""]
    notes = failures(servers)
    if notes:
        lines += [notes, ""]
    lines += [DEFINITIONS, ""]
    return "\n".join(lines)


def sweep_markdown(
    config: dict[str, Any], levels: list[dict[str, Any]], suggestion: dict[str, Any]
) -> str:
    labels = list(levels[0]["servers"]) if levels else []
    lines = ["# loadtest sweep", "", _config_line(config), ""]
    header = ["level", *(f"{s} tok/s" for s in labels), *(f"{s} TPOT p50 (ms)" for s in labels)]
    header += ["speedup", "round by round (95%)"]
    header += [f"{labels[0]} acceptance" if labels else "acceptance"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for level in levels:
        servers = level["servers"]
        acceptance = (servers[labels[0]].get("speculation") or {}).get("acceptance_rate")
        cells = [
            fmt(level["level"]),
            *(fmt(servers[s]["summary"]["output_throughput"]) for s in labels),
            *(fmt(servers[s]["summary"]["tpot_ms"]["p50"]) for s in labels),
            fmt(level["speedup"]),
            paired(level.get("paired_speedup")),
            fmt(acceptance),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""]
    stop = suggestion.get("stops_paying_at")
    lines.append(
        f"Speculation stops paying at {suggestion['kind']} {fmt(stop)}."
        if stop is not None
        else "Speculation paid at every level measured."
    )
    if suggestion.get("num_speculative_tokens_per_batch_size") is not None:
        table = json.dumps(suggestion["num_speculative_tokens_per_batch_size"])
        lines += [
            "",
            "Suggested vLLM schedule (K=0: no speculation):",
            "",
            f'```json\n"num_speculative_tokens_per_batch_size": {table}\n```',
        ]
    for level in levels:
        lines += [
            "",
            f"## {suggestion['kind']} {fmt(level['level'])}",
            "",
            side_by_side(servers=level["servers"]),
        ]
    lines += ["", DEFINITIONS, ""]
    return "\n".join(lines)


def _config_line(config: dict[str, Any]) -> str:
    return "Settings: " + ", ".join(f"{k} `{v}`" for k, v in config.items() if v is not None)


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def plot_latency_cdfs(path: Path, servers: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (key, title) in zip(
        axes, [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")], strict=True
    ):
        for label, result in servers.items():
            done = [r for r in result["records"] if r["success"]]
            values = (
                [g for r in done for g in r["itl"]]
                if key == "itl"
                else [r[key] for r in done if r[key] is not None]
            )
            _cdf(ax, [v * 1000 for v in values], label)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_acceptance(path: Path, series: dict[str, Any]) -> bool:
    """Acceptance rate by draft position, one line per server or level; False if none."""
    series = {k: v for k, v in series.items() if v}  # servers without speculation drop out
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, rates in series.items():
        points = [(i, r) for i, r in enumerate(rates) if r is not None]
        ax.plot([p for p, _ in points], [r for _, r in points], marker="o", label=label)
    ax.set_xlabel("draft position (0 = first proposed)")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_sweep(path: Path, kind: str, levels: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = [level["level"] for level in levels]
    for label in levels[0]["servers"]:
        summaries = [level["servers"][label]["summary"] for level in levels]
        left.plot(x, [s["output_throughput"] for s in summaries], marker="o", label=label)
        right.plot(x, [s["tpot_ms"]["p50"] for s in summaries], marker="o", label=label)
    left.set_title("Output throughput")
    left.set_ylabel("tokens/s")
    right.set_title("TPOT p50")
    right.set_ylabel("ms")
    for ax in (left, right):
        ax.set_xlabel(kind)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
