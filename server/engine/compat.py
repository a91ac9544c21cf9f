"""Checks run before any weights load: draft/target compatibility and context length.

Speculation verifies draft token ids against the target, so both models must
share one tokenizer: same vocabulary and the same special tokens. A mismatch
is refused with one message naming both vocabulary sizes.
"""

import json
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
