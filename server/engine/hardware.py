"""What the engine runs in, chosen for the hardware it runs on (API process).

Owns the `auto` decisions. `--dtype`: on a GPU the model's own dtype (vLLM's
"auto"); on a CPU bfloat16 only where the CPU multiplies bf16 natively
(`avx512_bf16` or `amx_bf16`), float32 elsewhere, because emulated bf16 is
slower than float32 (on an AVX2-only CPU prefill is several times slower and
verifying K+1 draft tokens costs about twice one). `--quantization` (the target) and
`--draft-quantization`: int8 where the CPU has int8 dot-product units (measured faster
there, docs/benchmarks.md; an AVX2-only CPU is unmeasured); on a GPU the checkpoints' own
weights (fp8, untested on a GPU here, only when asked). A setting the user made always
wins. Reads the CPU flags from /proc/cpuinfo (vllm_plugins/cpu_flags.py); imports neither vllm
nor torch.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from server.vllm_plugins.cpu_flags import read_cpu_flags

DtypeSetting = Literal["bfloat16", "float32", "auto"]

# x86 flags (as /proc/cpuinfo spells them) of CPUs that multiply bf16 natively.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype handed to vLLM and why, for the startup log and /health."""

    dtype: DtypeSetting  # "auto" only on a GPU: the model's own dtype
    reason: str


def choose_dtype(
    requested: DtypeSetting, *, on_gpu: bool, cpu_flags: Iterable[str] | None = None
) -> DtypeChoice:
    """Resolve `--dtype`; `cpu_flags` None reads /proc/cpuinfo (tests pass their own)."""
    if requested != "auto":
        return DtypeChoice(requested, "set by --dtype")
    if on_gpu:
        return DtypeChoice("auto", "GPU: the model's own dtype")
    flags = read_cpu_flags() if cpu_flags is None else frozenset(cpu_flags)
    if flags is None:
        return DtypeChoice("float32", "CPU flags unknown (no /proc/cpuinfo): float32 is safe")
    for flag in NATIVE_BF16_FLAGS:
        if flag in flags:
            return DtypeChoice("bfloat16", f"CPU has {flag}: bf16 is native")
    return DtypeChoice(
        "float32",
        "CPU lacks avx512_bf16 and amx_bf16: bf16 would be emulated, float32 is faster",
    )


# x86 flags of CPUs with int8 dot-product units, which vLLM's int8 kernels use.
INT8_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")


@dataclass(frozen=True)
class QuantizationChoice:
    """How a model's weights are stored and why, for the startup log."""

    quantization: Literal["none", "int8", "int4", "fp8"]  # fp8: vLLM's own, on a GPU
    reason: str


def _int8_dot_flag(cpu_flags: Iterable[str] | None) -> str | None:
    flags = read_cpu_flags() if cpu_flags is None else frozenset(cpu_flags)
    return next((flag for flag in INT8_DOT_FLAGS if flags is not None and flag in flags), None)


def choose_draft_quantization(
    requested: Literal["auto", "none", "int8", "fp8"],
    *,
    on_gpu: bool,
    local_draft: bool,
    cpu_flags: Iterable[str] | None = None,
) -> QuantizationChoice:
    """Resolve `--draft-quantization`; `cpu_flags` None reads /proc/cpuinfo."""
    if requested != "auto":
        return QuantizationChoice(requested, "set by --draft-quantization")
    if on_gpu:
        return QuantizationChoice(
            "none", "GPU: the draft's own weights (fp8 only when asked: --draft-quantization fp8)"
        )
    if not local_draft:
        return QuantizationChoice("none", "the draft is not a local folder to export from")
    flag = _int8_dot_flag(cpu_flags)
    if flag is not None:
        return QuantizationChoice("int8", f"CPU has {flag}: int8 dot products")
    return QuantizationChoice(
        "none", "CPU lacks int8 dot-product units (amx_int8, avx512_vnni, avx_vnni)"
    )


def choose_target_quantization(
    requested: Literal["auto", "none", "int8", "int4", "fp8"],
    *,
    on_gpu: bool,
    local_target: bool,
    cpu_flags: Iterable[str] | None = None,
) -> QuantizationChoice:
    """Resolve `--quantization`; `cpu_flags` None reads /proc/cpuinfo.

    The target's output is what users get, so `auto` quantizes it only where it was
    measured within the fidelity bound (perplexity within 2% of the unquantized target's
    on the shipped texts) and faster: int8 on a CPU with int8 dot products. On a GPU the
    checkpoint's own weights load as they are (vLLM applies a quantization_config they
    carry)."""
    if requested != "auto":
        return QuantizationChoice(requested, "set by --quantization")
    if on_gpu:
        return QuantizationChoice("none", "GPU: the checkpoint's own weights")
    if not local_target:
        return QuantizationChoice("none", "the target is not a local folder to export from")
    flag = _int8_dot_flag(cpu_flags)
    if flag is not None:
        return QuantizationChoice("int8", f"CPU has {flag}: int8 dot products")
    return QuantizationChoice(
        "none", "CPU lacks int8 dot-product units (amx_int8, avx512_vnni, avx_vnni)"
    )
