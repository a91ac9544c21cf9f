"""Fixtures for the deployment tests: the real tools, and the chart rendered by helm.

The tools are installed by the project (`make tools`, the `test` extra): a missing
one fails the test, so CI can never pass without having run them.
"""

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "rel"
NAMESPACE = "llm"

Manifests = list[dict[str, Any]]


def tool(name: str) -> str:
    """Path of a tool: the venv's bin folder first (where `make tools` puts them)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `make tools` (or `make install`)")
    return found


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120)


def render(*values_files: Path, **sets: str) -> Manifests:
    """`helm template` of the chart; fails the test on a helm error."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for values in values_files:
        args += ["--values", str(values)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def only(manifests: Manifests, kind: str) -> dict[str, Any]:
    matching = [m for m in manifests if m["kind"] == kind]
    assert len(matching) == 1, f"expected one {kind}, got {len(matching)}"
    return matching[0]


def kinds(manifests: Manifests) -> set[str]:
    return {m["kind"] for m in manifests}


@pytest.fixture(scope="session")
def rendered() -> Callable[..., Manifests]:
    """render(), memoised: each values combination runs helm once per session."""
    cache: dict[tuple[Any, ...], Manifests] = {}

    def cached(*values_files: Path, **sets: str) -> Manifests:
        key = (values_files, tuple(sorted(sets.items())))
        if key not in cache:
            cache[key] = render(*values_files, **sets)
        return cache[key]

    return cached
