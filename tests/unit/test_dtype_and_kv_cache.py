"""`--dtype auto` follows the hardware; the CPU KV cache follows the dtype."""

import json
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from server import cli
from server.app import create_app
from server.config import ConfigError
from server.engine import resolve as resolve_module
from server.engine.compat import (
    GIB,
    KvShape,
    check_kv_cache,
    default_kv_cache_gib,
    kv_cache_bytes,
    kv_cache_gib_for,
    longest_context_fitting,
)
from server.engine.contract import EngineInfo
from server.engine.hardware import choose_dtype, choose_target_quantization
from server.vllm_plugins.cpu_flags import read_cpu_flags
from tests.unit.scripted_engine import ScriptedEngine

AVX2_ONLY = ["fpu", "sse", "sse2", "avx", "f16c", "fma", "avx2", "bmi2", "vaes"]
AVX512_NO_BF16 = [*AVX2_ONLY, "avx512f", "avx512bw", "avx512_vnni"]
SAPPHIRE_RAPIDS = [*AVX512_NO_BF16, "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"]

# The default pair's config.json (as converted under ~/.cache/specserve/models):
# Qwen2.5-Coder-1.5B-Instruct: 28 layers, 2 KV heads, hidden 1536 / 12 heads;
# Qwen2.5-Coder-0.5B-Instruct: 24 layers, 2 KV heads, hidden 896 / 14 heads;
# both 32,768 tokens of context.
TARGET_CONFIG = {
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "num_attention_heads": 12,
    "hidden_size": 1536,
    "max_position_embeddings": 32768,
}
DRAFT_CONFIG = {
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "num_attention_heads": 14,
    "hidden_size": 896,
    "max_position_embeddings": 32768,
}
TARGET = KvShape(layers=28, kv_heads=2, head_dim=128)
DRAFT = KvShape(layers=24, kv_heads=2, head_dim=64)


@pytest.mark.parametrize(
    ("flags", "dtype", "reason"),
    [
        (SAPPHIRE_RAPIDS, "bfloat16", "CPU has amx_bf16: bf16 is native"),
        ([*AVX512_NO_BF16, "avx512_bf16"], "bfloat16", "CPU has avx512_bf16: bf16 is native"),
        (AVX512_NO_BF16, "float32", "bf16 would be emulated, float32 is faster"),
        (AVX2_ONLY, "float32", "CPU lacks avx512_bf16 and amx_bf16"),
    ],
)
def test_auto_on_cpu_follows_the_bf16_flags(flags: list[str], dtype: str, reason: str) -> None:
    choice = choose_dtype("auto", on_gpu=False, cpu_flags=flags)
    assert choice.dtype == dtype
    assert reason in choice.reason


def test_auto_on_gpu_is_the_models_own_dtype() -> None:
    choice = choose_dtype("auto", on_gpu=True, cpu_flags=AVX2_ONLY)
    assert (choice.dtype, choice.reason) == ("auto", "GPU: the model's own dtype")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("flags", [AVX2_ONLY, SAPPHIRE_RAPIDS])
@pytest.mark.parametrize("on_gpu", [False, True])
def test_an_explicit_dtype_always_wins(dtype: str, flags: list[str], on_gpu: bool) -> None:
    choice = choose_dtype(dtype, on_gpu=on_gpu, cpu_flags=flags)  # type: ignore[arg-type]
    assert (choice.dtype, choice.reason) == (dtype, "set by --dtype")


@pytest.mark.parametrize(
    ("flags", "local", "quantization", "reason"),
    [
        (SAPPHIRE_RAPIDS, True, "int8", "CPU has amx_int8"),
        (AVX512_NO_BF16, True, "int8", "CPU has avx512_vnni"),
        (AVX2_ONLY, True, "none", "CPU lacks int8 dot-product units"),
        (SAPPHIRE_RAPIDS, False, "none", "not a local folder to export from"),
    ],
)
def test_auto_target_quantization_on_cpu_is_int8_where_int8_dot_products_are(
    flags: list[str], local: bool, quantization: str, reason: str
) -> None:
    choice = choose_target_quantization("auto", on_gpu=False, local_target=local, cpu_flags=flags)
    assert choice.quantization == quantization
    assert reason in choice.reason


def test_auto_target_quantization_on_gpu_keeps_the_checkpoints_weights() -> None:
    choice = choose_target_quantization(
        "auto", on_gpu=True, local_target=True, cpu_flags=SAPPHIRE_RAPIDS
    )
    assert choice.quantization == "none"
    explicit = choose_target_quantization(
        "fp8", on_gpu=True, local_target=False, cpu_flags=AVX2_ONLY
    )
    assert (explicit.quantization, explicit.reason) == ("fp8", "set by --quantization")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    processor = "processor\t: {n}\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n\n"
    cpuinfo.write_text(processor.format(n=0) + processor.format(n=1))
    assert read_cpu_flags(cpuinfo) == {"fpu", "sse2", "avx2", "fma"}
    assert read_cpu_flags(tmp_path / "missing") is None
    unknown = choose_dtype("auto", on_gpu=False, cpu_flags=None)  # this machine's flags
    assert unknown.dtype in ("bfloat16", "float32")


def test_kv_shape_from_config_derives_head_dim() -> None:
    assert KvShape.from_config(TARGET_CONFIG) == TARGET
    assert KvShape.from_config(DRAFT_CONFIG) == DRAFT
    assert KvShape.from_config({**TARGET_CONFIG, "head_dim": 96}).head_dim == 96


def test_default_pair_needs_1_25_gib_in_bf16_and_2_5_in_float32() -> None:
    # Per token: target 2 x 28 x 2 x 128 = 14,336 values, draft 2 x 24 x 2 x 64 = 6,144.
    assert TARGET.bytes_per_token(2) + DRAFT.bytes_per_token(2) == 40_960
    # 32,768 tokens are 256 blocks of 128, plus the block vLLM keeps back.
    bf16 = kv_cache_bytes([TARGET, DRAFT], 2, 32768)
    float32 = kv_cache_bytes([TARGET, DRAFT], 4, 32768)
    assert bf16 == 257 * 128 * 40_960 and float32 == 2 * bf16
    assert round(bf16 / GIB, 2) == 1.25 and round(float32 / GIB, 2) == 2.51
    assert (default_kv_cache_gib(bf16), default_kv_cache_gib(float32)) == (2, 3)
    # Without speculation the target alone fits 2 GiB in float32.
    assert default_kv_cache_gib(kv_cache_bytes([TARGET], 4, 32768)) == 2
    # What 2 GiB holds in float32: 203 usable blocks.
    assert longest_context_fitting(2, [TARGET, DRAFT], 4) == 203 * 128


def test_a_kv_cache_too_small_is_refused_in_one_line_naming_both_fixes() -> None:
    with pytest.raises(ConfigError) as refused:
        check_kv_cache(2, [TARGET, DRAFT], "float32", 32768)
    message = str(refused.value)
    assert message == (
        "--kv-cache-gib 2 cannot hold one 32768-token sequence of target plus draft in "
        "float32 (2.51 GiB needed); set --kv-cache-gib 3 or more, or --max-model-len "
        "25984 or less"
    )
    check_kv_cache(2, [TARGET, DRAFT], "bfloat16", 32768)
    check_kv_cache(2, [TARGET, DRAFT], "float32", 25984)
    with pytest.raises(ConfigError):
        check_kv_cache(2, [TARGET, DRAFT], "float32", 25985)


def _model(folder: Path, config: dict[str, int]) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_kv_size_follows_the_dtype_from_the_model_folders(tmp_path: Path) -> None:
    pair = [_model(tmp_path / "target", TARGET_CONFIG), _model(tmp_path / "draft", DRAFT_CONFIG)]
    assert kv_cache_gib_for(None, pair, "bfloat16", None) == 2
    assert kv_cache_gib_for(None, pair, "float32", None) == 3
    assert kv_cache_gib_for(None, pair, "float32", 8192) == 2
    assert kv_cache_gib_for(4, pair, "float32", None) == 4
    with pytest.raises(ConfigError, match="32768-token"):
        kv_cache_gib_for(2, pair, "float32", None)
    # A hub id has no local shape: the size goes through unchecked.
    assert kv_cache_gib_for(None, ["org/model"], "float32", None) == 2
    assert kv_cache_gib_for(1, ["org/model"], "float32", None) == 1


def test_serve_refuses_a_small_kv_cache_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolve_module, "has_gpu", lambda: False)
    target = _model(tmp_path / "target", TARGET_CONFIG)
    flags = ["--model", target, "--speculative-method", "ngram", "--dtype", "float32"]
    status = cli.main(["serve", *flags, "--kv-cache-gib", "1"])
    assert status == 2
    refusal = [line for line in capsys.readouterr().err.splitlines() if "kv-cache-gib" in line]
    assert refusal == [
        "specserve: --kv-cache-gib 1 cannot hold one 32768-token sequence of the target in "
        "float32 (1.76 GiB needed); set --kv-cache-gib 2 or more, or --max-model-len "
        "18560 or less"
    ]


async def test_health_shows_the_dtype_and_why(client: httpx.AsyncClient) -> None:
    body = (await client.get("/health")).json()
    assert body == {
        "status": "ok",
        "details": {
            "model": "scripted",
            "dtype": "float32",
            "dtype_reason": "set by --dtype",
            "engine": {
                "speculation": "vllm",
                "runner": "v1",
                "async_scheduling": False,
                "compiled": False,
                "patches": [],
                "reason": "scripted",
            },
            "memory": None,
            "autopilot": None,
        },
    }


class _BfloatEngine(ScriptedEngine):
    def info(self) -> EngineInfo:
        return replace(super().info(), model_name="dtype-info-model", dtype="bfloat16")


async def test_dtype_info_metric_is_exported_at_startup() -> None:
    app = create_app(_BfloatEngine())
    labels = {"model": "dtype-info-model", "dtype": "bfloat16"}
    async with app.router.lifespan_context(app):
        assert REGISTRY.get_sample_value("specserve_engine_dtype_info", labels) == 1
