"""What tests read about specserve's vLLM patches in their own process (server/vllm_plugins/
patching.py): what a replacement replaced, and whether a contained patch has failed."""

from collections.abc import Callable
from typing import Any

from server.vllm_plugins import patching


def original_of(function: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's own function behind a replacement (the function itself if not replaced)."""
    return getattr(function, patching.MARKER, function)


def failed(patch: str) -> bool:
    """Whether the patch failed in this process (its path is vLLM's own since)."""
    return patch in patching._failed
