"""The cpu_embedding_memory patch on vLLM's own embedding method and CPU matmul dispatch (in a
fresh process, as vLLM's worker loads it): input embeddings unpacked, the target's head packed
without its plain weight, a trimmed draft's head unpacked, an untrimmed draft's as vLLM does;
every head still multiplies as before; a tokenizer vLLM loads keeps no Python copy of its
vocabulary, and its copies share its caches, each deep copy with a Rust tokenizer of its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.vllm_plugins import patching
from tests.tiny_models import build_tokenizer

PROBE = """
import json

import torch
from vllm.compilation.backends import set_model_tag
from vllm.model_executor.layers import vocab_parallel_embedding as embedding
from vllm.plugins import load_general_plugins

load_general_plugins()
torch.manual_seed(0)


def layer(kind):
    module = object.__new__(kind)
    torch.nn.Module.__init__(module)
    module.weight = torch.nn.Parameter(torch.randn(4096, 256), requires_grad=False)
    return module


def loaded(kind, tag=None):
    module = layer(kind)
    weight = module.weight.detach().clone()
    method = embedding.UnquantizedEmbeddingMethod()
    if tag is None:
        method.process_weights_after_loading(module)
    else:
        with set_model_tag(tag):
            method.process_weights_after_loading(module)
    x = torch.randn(3, 256)
    expected = x @ weight.T
    product = module.cpu_linear(x, module.weight, None)
    error = (product - expected).abs().max() / expected.abs().max()
    return {
        "plain_weight": module.weight.numel() > 0,
        "unpacked": module.cpu_linear is torch.nn.functional.linear,
        "multiplies_as_before": bool(error < 1e-5),
        "int8_error": round(float(error), 4) if error >= 1e-5 else 0,
    }


print(json.dumps({
    "embedding": loaded(embedding.VocabParallelEmbedding),
    "target_head": loaded(embedding.ParallelLMHead),
    "draft_head": loaded(embedding.ParallelLMHead, "draft_model"),
}))
"""


def _probe(patches: list[str], int8_head: bool = False) -> dict[str, dict[str, bool]]:
    settings: dict[str, object] = {"patches": patches, "int8_head": int8_head}
    if "draft_vocab" in patches:
        settings["draft_vocab"] = {"ranking": "unused", "size": 1024}
    environment = {**os.environ, patching.SETTINGS_ENV: json.dumps(settings)}
    environment.pop("VLLM_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True, check=True
    )
    result: dict[str, dict[str, bool]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("trimmed", [False, True])
def test_each_vocabulary_sized_weight_is_held_once(trimmed: bool) -> None:
    patches = ["cpu_embedding_memory", *(["draft_vocab"] * trimmed)]
    found = _probe(patches)
    assert found["embedding"] == {
        "plain_weight": True,
        "unpacked": True,
        "multiplies_as_before": True,
        "int8_error": 0,
    }
    assert found["target_head"] == {
        "plain_weight": False,
        "unpacked": False,
        "multiplies_as_before": True,
        "int8_error": 0,
    }
    # The trimmed head gathers rows of the draft's plain weight; without it vLLM's packed copy.
    assert found["draft_head"] == {
        "plain_weight": True,
        "unpacked": trimmed,
        "multiplies_as_before": True,
        "int8_error": 0,
    }


def test_the_int8_targets_head_multiplies_in_int8_and_the_rest_as_before() -> None:
    found = _probe(["cpu_embedding_memory"], int8_head=True)
    head = found["target_head"]
    assert head["plain_weight"] is False and head["unpacked"] is False
    # Per-row weight and per-token activation scales: about 1% of the largest logit.
    assert 0 < head["int8_error"] < 0.03, head
    assert found["embedding"]["multiplies_as_before"] and found["embedding"]["unpacked"]
    assert found["draft_head"]["multiplies_as_before"]


def test_without_the_patch_vllm_keeps_both_copies_of_every_one() -> None:
    packed_and_plain = {
        "plain_weight": True,
        "unpacked": False,
        "multiplies_as_before": True,
        "int8_error": 0,
    }
    # The int8 head is the patch's: without it, asking for one changes nothing.
    assert _probe([], int8_head=True) == {
        "embedding": packed_and_plain,
        "target_head": packed_and_plain,
        "draft_head": packed_and_plain,
    }


TOKENIZER_PROBE = """
import copy
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from vllm.plugins import load_general_plugins
from vllm.tokenizers import get_tokenizer
from vllm.tokenizers.hf import maybe_make_thread_pool

load_general_plugins()
tokenizer = get_tokenizer(sys.argv[1])
text = "def fibonacci(n):\\n    return [n, n + 1]  # done"
ids = tokenizer.encode(text)
shallow, deep = copy.copy(tokenizer), copy.deepcopy(tokenizer)
# As vLLM's renderer pools it: threads that set truncation on their copy while others encode.
pooled = maybe_make_thread_pool(copy.copy(tokenizer), 2)


def encode(call):
    cut = call % 3 == 0
    return pooled(text * 50, truncation=cut, max_length=8 if cut else None)["input_ids"]


with ThreadPoolExecutor(8) as threads:
    lengths = {len(encoded) for encoded in threads.map(encode, range(400))}
print(json.dumps({
    "class": type(tokenizer).__mro__[1].__name__,
    "holds_what_it_was_built_from": any(hasattr(tokenizer, name) for name in ("_vocab", "_merges")),
    "ids": ids,
    "text": tokenizer.decode(ids),
    "copies_share_the_vocabulary": all(
        clone.get_vocab() is tokenizer.get_vocab() for clone in (shallow, deep)
    ),
    "deep_copy_has_its_own_rust_tokenizer": deep._tokenizer is not tokenizer._tokenizer,
    "copies_encode_as_before": shallow.encode(text) == deep.encode(text) == ids,
    "pooled_lengths": sorted(lengths),
    "full_length": len(tokenizer.encode(text * 50)),
}))
"""


def _tokenizer_probe(folder: Path, patches: list[str]) -> dict[str, object]:
    environment = {**os.environ, patching.SETTINGS_ENV: json.dumps({"patches": patches})}
    environment.pop("VLLM_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", TOKENIZER_PROBE, str(folder)],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_tokenizer_vllm_loads_drops_its_python_vocabulary_and_encodes_as_before(
    tmp_path: Path,
) -> None:
    # A class that, like Qwen2's, builds its Rust tokenizer from a Python vocabulary and merges.
    build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"})
    )
    trimmed = _tokenizer_probe(tmp_path, ["cpu_embedding_memory"])
    whole = _tokenizer_probe(tmp_path, [])
    assert trimmed["class"] == whole["class"] == "Qwen2Tokenizer"
    assert whole["holds_what_it_was_built_from"] is True
    assert trimmed["holds_what_it_was_built_from"] is False
    assert trimmed["ids"] == whole["ids"] and trimmed["text"] == whole["text"]


def test_copies_of_a_tokenizer_share_its_caches_and_a_deep_copy_owns_its_rust_tokenizer(
    tmp_path: Path,
) -> None:
    build_tokenizer(tmp_path)
    shared = _tokenizer_probe(tmp_path, ["cpu_embedding_memory"])
    whole = _tokenizer_probe(tmp_path, [])
    # vLLM caches each copy anew, a vocabulary dict per copy; the patch's copies share one.
    assert whole["copies_share_the_vocabulary"] is False
    assert shared["copies_share_the_vocabulary"] is True
    for probe in (shared, whole):
        assert probe["deep_copy_has_its_own_rust_tokenizer"] is True
        assert probe["copies_encode_as_before"] is True
        # Eight threads through the pool, a third of them truncating: each got whole or cut.
        assert probe["pooled_lengths"] == [8, probe["full_length"]]
