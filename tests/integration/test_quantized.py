"""Quantized copies (server/weights/quantized_export.py) on the real engine: vLLM runs int8 on
its int8 kernel and int4 on CPUWNA16 (W4A8 where the CPU has AMX or VNNI, cpu_fix.py), an
int8 draft leaves the target's greedy output unchanged, the quantized copy of the target still
drafts for it well, `--quantization` serves the target from its copy, and speculation keeps a
quantized target's own greedy output."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from server.config import ConfigError, Settings
from server.engine.contract import SamplingOptions
from server.engine.memory import weights_as_served
from server.engine.resolve import resolve
from server.weights import quantized_export
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config
from tests.integration.test_lossless import PROMPTS, _run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def int4_target(tiny: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_export.export(
        tiny.target, tmp_path_factory.mktemp("cache"), "int4", report=lambda _: None
    )


@pytest.fixture(scope="module")
def int8_target(tiny: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_export.export(
        tiny.target, tmp_path_factory.mktemp("cache"), report=lambda _: None
    )


def test_the_export_is_int8_per_channel_and_reused(int8_target: Path, tiny: TinyModels) -> None:
    tensors = load_file(int8_target / "model.safetensors")
    weight = tensors["model.layers.0.mlp.down_proj.weight"]
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert str(weight.dtype) == "torch.int8" and scale.shape == (weight.shape[0], 1)
    original = load_file(tiny.target / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    error = (weight.float() * scale - original).abs().max() / original.abs().max()
    assert error < 0.01  # half a step of 1/127 at most
    assert str(tensors["model.embed_tokens.weight"].dtype) == "torch.float32"
    marker = int8_target / quantized_export.COMPLETE_MARKER
    before = marker.stat().st_mtime_ns
    cache = int8_target.parent.parent
    assert quantized_export.export(tiny.target, cache, report=print) == int8_target
    assert marker.stat().st_mtime_ns == before
    # New weights in the source folder: the copy is made again.
    weights = tiny.target / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        assert quantized_export.export(tiny.target, cache, report=print) == int8_target
        assert marker.stat().st_mtime_ns != before
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_int4_export_packs_groups_of_64_within_half_a_step(
    int4_target: Path, tiny: TinyModels
) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    tensors = load_file(int4_target / "model.safetensors")
    layer = "model.layers.0.mlp.down_proj"
    original = load_file(tiny.target / "model.safetensors")[f"{layer}.weight"]
    packed, scale = tensors[f"{layer}.weight_packed"], tensors[f"{layer}.weight_scale"]
    rows, inputs = original.shape
    assert str(packed.dtype) == "torch.int32" and packed.shape == (rows, inputs // 8)
    assert scale.shape == (rows, inputs // quantized_export.GROUP_SIZE)
    assert tensors[f"{layer}.weight_shape"].tolist() == [rows, inputs]
    values = unpack_from_int32(packed, 4, torch.Size([rows, inputs])).float()
    restored = values * scale.float().repeat_interleave(quantized_export.GROUP_SIZE, dim=1)
    step = scale.float().repeat_interleave(quantized_export.GROUP_SIZE, dim=1)
    assert ((restored - original.float()).abs() <= step / 2 + 1e-6).all()
    assert values.abs().amax() == 7  # the full range is used
    assert f"{layer}.weight" not in tensors
    assert "model.embed_tokens.weight" in tensors


async def test_an_int8_draft_keeps_greedy_output_and_is_accepted(
    tiny: TinyModels,
    int8_target: Path,
    plain_server: RunningServer,
    capfd: pytest.CaptureFixture[str],
) -> None:
    config = tiny_engine_config(tiny, int8_target, served_model_name="tiny-int8-draft")
    greedy = SamplingOptions(max_tokens=32, temperature=0.0)
    drafted = accepted = 0
    async for server in serve(config):
        for i, prompt in enumerate(PROMPTS):
            (tokens,), stats = await _run(server.engine, f"int8-{i}", prompt, greedy)
            (reference,), _ = await _run(plain_server.engine, f"int8-plain-{i}", prompt, greedy)
            assert tokens == reference, prompt
            drafted += sum(s.draft_tokens for s in stats)
            accepted += sum(s.accepted_tokens for s in stats)
    captured = capfd.readouterr()
    assert "CPUInt8ScaledMMLinearKernel" in captured.out + captured.err
    assert drafted > 0 and accepted / drafted > 0.8, (accepted, drafted)


def test_the_setting_points_the_engine_at_the_int8_copy(tiny: TinyModels, tmp_path: Path) -> None:
    settings = Settings(
        model=str(tiny.target),
        draft_model=str(tiny.close_draft),
        draft_quantization="int8",
        cache_dir=tmp_path,
    )
    assert resolve(settings).draft_model == str(
        quantized_export.export_dir(tiny.close_draft, tmp_path)
    )
    remote = settings.model_copy(update={"draft_model": "Qwen/Qwen2.5-Coder-0.5B-Instruct"})
    with pytest.raises(ConfigError, match="needs --draft-model to be a local folder"):
        resolve(remote)


def test_quantization_int8_points_the_engine_at_the_targets_copy_under_its_own_name(
    tiny: TinyModels, tmp_path: Path
) -> None:
    settings = Settings(
        model=str(tiny.target),
        draft_model=str(tiny.close_draft),
        quantization="int8",
        draft_quantization="none",
        cache_dir=tmp_path,
    )
    config = resolve(settings)
    assert config.model == str(quantized_export.export_dir(tiny.target, tmp_path))
    assert config.served_model_name == tiny.target.name
    assert config.draft_model == str(tiny.close_draft)
    assert config.int8_head  # its head too, as it loads (cpu_memory.py)
    assert not resolve(settings.model_copy(update={"quantization": "none"})).int8_head
    remote = settings.model_copy(update={"model": "Qwen/Qwen2.5-Coder-1.5B-Instruct"})
    with pytest.raises(ConfigError, match="needs --model to be a local folder"):
        resolve(remote)
    with pytest.raises(ConfigError, match="--quantization fp8 needs a GPU"):
        resolve(settings.model_copy(update={"quantization": "fp8"}))
    int4_in_float32 = settings.model_copy(update={"quantization": "int4", "dtype": "float32"})
    with pytest.raises(ConfigError, match="int4 needs bfloat16 on a CPU"):
        resolve(int4_in_float32)


@pytest.mark.parametrize(
    ("scheme", "dtype", "kernel"),
    [
        ("int8", "float32", "CPUInt8ScaledMM"),
        # In bf16 on AVX-512 VNNI without AMX, vLLM's sgl int8 kernel (cpu_fix.py).
        ("int8", "bfloat16", "CPUInt8ScaledMM"),
        ("int4", "bfloat16", "CPUWNA16"),
    ],
)
async def test_a_quantized_target_speculates_losslessly_against_itself(
    tiny: TinyModels,
    scheme: str,
    dtype: str,
    kernel: str,
    request: pytest.FixtureRequest,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Speculation keeps the quantized target's own greedy output (its draft unquantized),
    and vLLM runs the copy on its kernel for the scheme (int4's has no float32 path); the int8
    target's head is int8 too, as `--quantization int8` serves it on a CPU."""
    target = request.getfixturevalue(f"{scheme}_target")
    greedy = SamplingOptions(max_tokens=32, temperature=0.0)
    outputs: dict[bool, list[list[int]]] = {}
    for speculating in (True, False):
        config = tiny_engine_config(
            tiny,
            tiny.close_draft if speculating else None,
            model=str(target),
            served_model_name=f"tiny-{scheme}-target",
            dtype=dtype,
            int8_head=scheme == "int8",
        )
        async for server in serve(config):
            outputs[speculating] = []
            drafted = 0
            for i, prompt in enumerate(PROMPTS):
                (tokens,), stats = await _run(server.engine, f"{scheme}-target-{i}", prompt, greedy)
                outputs[speculating].append(tokens)
                drafted += sum(s.draft_tokens for s in stats)
            assert (drafted > 0) == speculating
    assert outputs[True] == outputs[False]
    captured = capfd.readouterr()
    assert f"{kernel}LinearKernel" in captured.out + captured.err


async def test_the_engine_serves_the_int8_targets_head_in_int8(
    tiny: TinyModels, int8_target: Path
) -> None:
    """`int8_head` reaches the engine's processes: the same int8 target without speculation
    answers differently with its head in int8 (the tiny model's logits are close together, so
    rounding the head moves its argmax) and reports the head's bytes as int8 with its scales."""
    greedy = SamplingOptions(max_tokens=32, temperature=0.0)
    outputs: dict[bool, list[list[int]]] = {}
    targets: dict[bool, int] = {}
    for int8_head in (True, False):
        config = tiny_engine_config(
            tiny, None, model=str(int8_target), served_model_name="tiny-head", int8_head=int8_head
        )
        async for server in serve(config):
            outputs[int8_head] = [
                (await _run(server.engine, f"head-{int8_head}-{i}", prompt, greedy))[0][0]
                for i, prompt in enumerate(PROMPTS)
            ]
            memory = server.engine.memory()
            assert memory is not None
            targets[int8_head] = memory["weights_bytes"]["target"]
    assert outputs[True] != outputs[False]
    assert targets[True] == weights_as_served(int8_target, "float32", int8_head=True)
    assert targets[True] < targets[False]
