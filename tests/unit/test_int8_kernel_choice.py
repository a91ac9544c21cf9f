"""Which CPUs get vLLM's sgl int8 kernel in bf16 from specserve (cpu_fix.vnni_without_amx)."""

import pytest

from server.vllm_plugins.cpu_fix import vnni_without_amx

AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}


@pytest.mark.parametrize(
    ("cpu", "flags", "takes_it"),
    [
        ("AMD Zen 3 (AVX2 only)", {"avx2", "fma"}, False),
        ("AMD Zen 4 / Zen 5", AVX512 | {"avx512_vnni", "avx512_bf16", "avx_vnni"}, True),
        ("Intel Ice Lake (VNNI, no bf16)", AVX512 | {"avx512_vnni"}, False),
        # vLLM gives AMX CPUs the kernel itself.
        ("Intel with AMX", AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"}, False),
    ],
)
def test_only_vnni_and_bf16_without_amx(cpu: str, flags: set[str], takes_it: bool) -> None:
    assert vnni_without_amx(frozenset(flags)) is takes_it, cpu
