"""vllm-router in front of specserve replicas, as the tests and benchmarks run it: its
command line (the flags docs/multi-node.md explains), and waiting until it routes to
every replica.

The router is the `router` extra's `vllm-router` 0.1.17, installed beside the Python
running this (the same virtualenv)."""

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.launch import ServerStartError, wait_until_up


def router_command(
    workers: list[str], port: int, metrics_port: int, policy: str, check_seconds: int = 1
) -> list[str]:
    """`vllm-router` on loopback over `workers` (base URLs). Health checks hit specserve's
    /ready every `check_seconds`, so a replica that drains or dies leaves the rotation after
    one failed check and rejoins after one good one."""
    return [
        str(Path(sys.executable).parent / "vllm-router"),
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers,
        "--policy", policy,
        "--health-check-endpoint", "/ready",
        "--health-check-interval-secs", str(check_seconds),
        "--health-check-timeout-secs", str(max(2, check_seconds)),
        "--health-failure-threshold", "1",
        "--health-success-threshold", "1",
        "--worker-startup-timeout-secs", "600",
        "--worker-startup-check-interval", "1",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", "info",
    ]  # fmt: skip


def healthy_workers(base_url: str) -> dict[str, bool]:
    """Worker URL -> whether the router's health check takes it as healthy now."""
    workers = httpx.get(f"{base_url}/workers", timeout=5).json()["workers"]
    return {worker["url"]: worker["is_healthy"] for worker in workers}


def wait_all_healthy(
    process: subprocess.Popen[Any], base_url: str, timeout_seconds: float, log: Path
) -> None:
    """Wait until the router answers and takes every one of its workers as healthy."""
    wait_until_up(process, f"{base_url}/readiness", timeout_seconds, log)
    deadline = time.monotonic() + timeout_seconds
    while not all(healthy_workers(base_url).values()):
        if process.poll() is not None or time.monotonic() > deadline:
            raise ServerStartError(f"router: not every worker healthy: {log.read_text()[-3000:]}")
        time.sleep(0.2)
