"""Tiny random-weight Llama checkpoints for fast, offline vLLM tests.

This module owns the generation of every model folder the test suite loads:
a small byte-level BPE tokenizer trained on an embedded text corpus (no
downloads), and ``LlamaForCausalLM`` checkpoints with seeded random weights,
written in the Hugging Face layout (``config.json``, ``generation_config.json``,
``model.safetensors`` in float32, ``tokenizer.json``, ``tokenizer_config.json``
with a Jinja ``chat_template``).

Public API:

* :func:`build_tokenizer` - write the tokenizer files into a folder.
* :func:`build_model` - write a full checkpoint (weights + tokenizer).
* :func:`build_pair` - a target and a draft sharing the tokenizer, with
  independent weights (the draft is almost always rejected).
* :func:`build_close_draft` - a draft equal to the target plus weight noise
  (about half of its tokens are accepted).
* :func:`build_incompatible_draft` - a draft whose tokenizer (and so vocab
  size) differs from the target's, which vLLM must refuse as a draft.
* :func:`tokenizer_vocab_size` - vocabulary size of a saved tokenizer.

Sizes are the smallest vLLM's CPU attention backend accepts: it only supports
head sizes in ``{32, 64, 80, 96, 112, 128, ...}`` (``head_dim=16`` loads but
fails at the first forward pass with "Unsupported CPU attention
configuration"), so the default is ``hidden_size=64`` with two query heads of
32 and one KV head (grouped-query attention). The output head is initialised with a large standard
deviation so that the next-token distribution at temperature 1 is sharp (a few
tokens hold most of the mass), which makes sampled-distribution comparisons
meaningful. The rows of the output head for the special tokens are zeroed so
that ``</s>`` and friends are almost never generated (generations run to
``max_tokens``).

Everything is deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"
#: Special tokens, in id order (``<s>`` is 0, ``</s>`` is 1, ...).
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, PAD_TOKEN)
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
UNK_TOKEN_ID = 2
PAD_TOKEN_ID = 3

#: Vocabulary size asked of the BPE trainer for the normal tokenizer.
DEFAULT_VOCAB_SIZE = 512
#: Vocabulary size of the deliberately incompatible tokenizer.
INCOMPATIBLE_VOCAB_SIZE = 384

MAX_POSITION_EMBEDDINGS = 2048
#: Relative weight noise of :func:`build_close_draft` (partial draft acceptance).
CLOSE_DRAFT_NOISE = 0.15

#: Renders ``[{"role": ..., "content": ...}, ...]`` as ``role: content</s>``
#: lines, preceded by ``<s>``; ``add_generation_prompt`` appends ``assistant:``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

TRAINING_TEXT = '''\
The quick brown fox jumps over the lazy dog. A server answers requests from many
clients at the same time, and each request asks the model to continue a piece of
text. The model reads the prompt, one token at a time, and predicts the next token.
When the answer is long, the server streams the tokens back as soon as they are ready,
so that the user does not have to wait for the whole reply before reading it.

Speculative decoding makes generation faster without changing what is generated.
A small draft model proposes a few tokens, and the large target model checks all of
them in a single forward pass. Tokens that the target agrees with are accepted; the
first token it rejects is replaced by a token sampled from a corrected distribution.
Because of this rejection step, the output follows exactly the distribution of the
target model, whatever the quality of the draft model. A good draft only makes it
faster, since more of its proposals are accepted.

Hello world! How are you today? I am fine, thank you. The weather is nice and the
sun is shining. We went to the market in the morning, bought some bread, cheese and
apples, and then walked home along the river. In the evening we read a book, wrote
a letter to a friend, and listened to music until it was time to sleep.

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


class Request:
    def __init__(self, prompt: str, max_tokens: int = 16) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output: list[str] = []

    def is_finished(self) -> bool:
        return len(self.output) >= self.max_tokens


async def handle(request: Request) -> dict[str, object]:
    for index in range(request.max_tokens):
        token = await generate_next_token(request.prompt, index)
        if token is None:
            break
        request.output.append(token)
    return {"text": "".join(request.output), "finished": request.is_finished()}


if __name__ == "__main__":
    import json
    print(json.dumps({"model": "tiny", "values": fibonacci(10)}, indent=2))
'''


def build_tokenizer(folder: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
    """Train a byte-level BPE tokenizer on :data:`TRAINING_TEXT`; save it to ``folder``.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (bos/eos/unk/pad
    tokens and :data:`CHAT_TEMPLATE`) and ``special_tokens_map.json``, loadable
    by ``transformers.AutoTokenizer.from_pretrained(folder)`` and by vLLM.
    Encoding prepends ``<s>`` (like Llama); the chat template emits ``<s>``
    itself, as chat prompts are tokenized without special tokens.

    Byte-level means any text round-trips, though rare characters cost several
    tokens. The actual vocabulary may be slightly smaller than ``vocab_size``
    if the corpus runs out of merges; use :func:`tokenizer_vocab_size`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = TRAINING_TEXT.splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    tokenizer.save(str(folder / "tokenizer.json"))

    special = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(folder / "tokenizer_config.json", config)
    _write_json(folder / "special_tokens_map.json", special)


def tokenizer_vocab_size(folder: Path) -> int:
    """Number of tokens (specials included) of the tokenizer saved in ``folder``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )


def build_model(
    folder: Path,
    seed: int,
    hidden_size: int = 64,
    layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    logit_scale: float = 4.0,
    tokenizer_vocab: int = DEFAULT_VOCAB_SIZE,
    noise: float = 0.0,
    noise_seed: int | None = None,
) -> Path:
    """Write a random-weight ``LlamaForCausalLM`` checkpoint (and tokenizer) to ``folder``.

    Args:
        folder: created if missing; existing files are overwritten.
        seed: weights come from ``torch.manual_seed(seed)``; same seed, same weights.
        hidden_size, layers, num_heads, num_kv_heads, intermediate_size: model
            shape. ``hidden_size // num_heads`` must be a head size vLLM's CPU
            attention backend supports (32, 64, 80, 96, 112, 128, ...).
        logit_scale: standard deviation of the logits for a unit-RMS final
            hidden state. About 4 gives a few tokens most of the mass at
            temperature 1; 0.1 would be close to uniform.
        tokenizer_vocab: vocabulary size asked of :func:`build_tokenizer`.
            Models built with different values have incompatible tokenizers.
        noise, noise_seed: if ``noise`` > 0, every weight matrix gets Gaussian
            noise of ``noise`` times its init standard deviation, drawn from
            ``noise_seed`` (default ``seed + 1``): the result is a model close
            to, but different from, the one built with ``noise=0``.

    Returns ``folder``. Weights are float32 ``model.safetensors``;
    ``config.json`` has ``vocab_size`` equal to the tokenizer's,
    ``max_position_embeddings=2048`` and ``tie_word_embeddings=False``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dim = hidden_size // num_heads
    if head_dim * num_heads != hidden_size or num_heads % num_kv_heads:
        raise ValueError(f"bad head layout: {hidden_size=} {num_heads=} {num_kv_heads=}")

    build_tokenizer(folder, vocab_size=tokenizer_vocab)
    vocab_size = tokenizer_vocab_size(folder)

    # Residual-branch weights use ~1/sqrt(hidden) so that attention and MLP
    # outputs matter (the next token depends on context, not only on the
    # current token), while staying small enough to keep activations tame.
    init_std = 1.0 / math.sqrt(hidden_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=init_std,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        dtype="float32",
    )

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    noise_generator = torch.Generator().manual_seed(seed + 1 if noise_seed is None else noise_seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        # Explicit init, independent of the transformers version's own init.
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name == "lm_head.weight":
                std = logit_scale / math.sqrt(hidden_size)
            elif name == "model.embed_tokens.weight":
                std = 1.0
            else:
                std = init_std
            value = torch.randn(param.shape, generator=generator)
            if noise > 0:
                value += noise * torch.randn(param.shape, generator=noise_generator)
            param.copy_(value * std)
            if name == "lm_head.weight":
                param[: len(SPECIAL_TOKENS)] = 0.0

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    # Overwrite the generation config: only token ids, no sampling defaults,
    # since vLLM would otherwise apply them as default sampling parameters.
    _write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
        },
    )
    return folder


def build_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Build ``(target, draft)`` under ``root`` for draft-model speculation.

    Both share the tokenizer and architecture; the draft has independent random
    weights (seed ``seed + 1``), so it almost never agrees with the target:
    measured greedy agreement 0%, sampled acceptance ~2% per token (nearly every
    draft token is rejected). For partial acceptance use
    :func:`build_close_draft`; for a draft that always agrees, pass the target
    path itself as the draft model (100% acceptance under greedy decoding).
    """
    target = build_model(root / "target", seed=seed)
    draft = build_model(root / "draft", seed=seed + 1)
    return target, draft


def build_close_draft(root: Path, seed: int = 0, noise: float = CLOSE_DRAFT_NOISE) -> Path:
    """Build ``root / "close_draft"``: the target of ``build_pair(root, seed)`` plus noise.

    Same tokenizer and shape as the target; each weight gets Gaussian noise of
    ``noise`` times its init standard deviation. With the default noise, both
    accepted and rejected draft tokens occur. Measured with vLLM and
    ``num_speculative_tokens=3`` on a few prompts: first-position acceptance
    about 37% greedy and 25% at temperature 1 (on the training text, next-token
    agreement is about 50% greedy, ``sum(min(p, q))`` about 60%).
    """
    return build_model(root / "close_draft", seed=seed, noise=noise, noise_seed=seed + 1000)


def build_incompatible_draft(root: Path, seed: int = 2) -> Path:
    """Build ``root / "incompatible_draft"``: a draft whose tokenizer differs.

    Its tokenizer is trained with a vocabulary of
    :data:`INCOMPATIBLE_VOCAB_SIZE` tokens, so its ``vocab_size`` differs from
    the models of :func:`build_model`'s default and vLLM refuses it as a draft
    ("Target and draft model should have the same vocabulary size").
    """
    return build_model(
        root / "incompatible_draft", seed=seed, tokenizer_vocab=INCOMPATIBLE_VOCAB_SIZE
    )


def _write_json(path: Path, data: Mapping[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
