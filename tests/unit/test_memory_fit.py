"""The KV cache made to fit the host (resolve's `_fit_to_host`) with vLLM's measure of free
memory stood in: kept where it fits, made smaller with the context shortened where the user
left it to the model, refused in one line where the weights themselves do not fit."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from server.autopilot.suffix_tree import BYTES_PER_TOKEN
from server.config import ConfigError, Settings
from server.engine import resolve
from server.engine.memory import (
    ENGINE_RUNTIME_BYTES,
    GB,
    GIB,
    lookup_trees_bound,
    weights_as_served,
)

# 2 layers, 2 KV heads of 64: 2 KiB of float32 KV per token; 4096 tokens of context.
CONFIG = {
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "hidden_size": 128, "max_position_embeddings": 4096, "torch_dtype": "float32",
}  # fmt: skip


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tensors = {"weight": torch.zeros(1000, 1000), "scale": torch.zeros(10, dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def _free(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    from vllm.utils import cpu_resource_utils

    info = SimpleNamespace(available_memory=available, total_memory=24 * GIB)
    monkeypatch.setattr(cpu_resource_utils, "get_memory_node_info", lambda: info)


def _settings(**values: object) -> Settings:
    return Settings(model="org/m", no_speculation=True, dtype="float32", **values)  # type: ignore[arg-type]


def test_weights_as_served_follow_the_dtype_for_floats_only(model: Path) -> None:
    assert weights_as_served(model, "float32") == 4_000_000 + 10
    assert weights_as_served(model, "bfloat16") == 2_000_000 + 10


def test_an_int8_head_is_served_as_a_byte_per_weight_and_a_scale_per_row(model: Path) -> None:
    head = {"lm_head.weight": torch.zeros(1000, 100), "other": torch.zeros(10)}
    save_file(head, str(model / "head.safetensors"))
    assert weights_as_served(model, "bfloat16", int8_head=True) == (
        2_000_000 + 10 + 1000 * 100 + 1000 * 4 + 2 * 10
    )
    assert weights_as_served(model, "bfloat16") == 2_000_000 + 10 + 2 * 1000 * 100 + 2 * 10


def test_a_cache_that_fits_is_left_alone(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _free(monkeypatch, 16 * GIB)
    assert resolve._fit_to_host(_settings(kv_cache_gib=4), [str(model)], None) == (4, None)


def test_a_cache_the_host_cannot_hold_shrinks_and_says_so(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _free(monkeypatch, ENGINE_RUNTIME_BYTES + 3 * GIB + GB // 10)
    with caplog.at_level(logging.WARNING):
        assert resolve._fit_to_host(_settings(kv_cache_gib=64), [str(model)], None) == (3, None)
    assert "KV cache 3 GiB instead of 64 (max model len the model's own): this host has" in (
        caplog.text
    )


def test_a_context_the_fitted_cache_cannot_hold_is_shortened_unless_the_user_set_it(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A token costs 1 MiB here: 3 GiB hold 2944 tokens, in blocks of 128 (one kept back).
    wide = {"num_key_value_heads": 1024, "hidden_size": 65536, "num_attention_heads": 1024}
    (model / "config.json").write_text(json.dumps({**CONFIG, **wide}))
    _free(monkeypatch, ENGINE_RUNTIME_BYTES + 3 * GIB + GB // 10)
    assert resolve._fit_to_host(_settings(kv_cache_gib=64), [str(model)], None) == (3, 2944)
    with pytest.raises(ConfigError, match="leaving 3 GiB for a KV cache of 64 GiB"):
        resolve._fit_to_host(_settings(kv_cache_gib=64, max_model_len=4096), [str(model)], None)


def test_the_lookups_trees_are_planned_for_at_their_bound(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Reply trees of 2M tokens and 16 requests' trees of the whole 4096-token context, at
    BYTES_PER_TOKEN: about 0.93 GB, which takes the fourth GiB of KV cache."""
    _free(monkeypatch, ENGINE_RUNTIME_BYTES + 4 * GIB + GB // 10)
    settings = _settings(kv_cache_gib=4, lookup_index_tokens=2_000_000, max_num_seqs=16)
    assert lookup_trees_bound(2_000_000, 16, 4096) == (2_000_000 + 16 * 4096) * BYTES_PER_TOKEN
    assert resolve._fit_to_host(settings, [str(model)], None) == (4, None)
    with caplog.at_level(logging.WARNING):
        assert resolve._fit_to_host(settings, [str(model)], "hybrid") == (3, None)
    assert "the lookups' trees up to 0.9 GB" in caplog.text


def test_a_host_that_cannot_hold_the_weights_is_refused_in_one_line(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _free(monkeypatch, ENGINE_RUNTIME_BYTES)
    with pytest.raises(ConfigError, match=r"^this host has .* GB free; the weights as served"):
        resolve._fit_to_host(_settings(), [str(model)], None)
