"""Bad configurations fail before any weights load, with one clear line."""

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from server.config import ConfigError
from server.engine.compat import check_draft_compatible, check_max_model_len
from tests.integration.conftest import TinyModels, serving
from tests.net import free_port

pytestmark = pytest.mark.integration


def test_incompatible_draft_is_refused_naming_both_sizes(tiny: TinyModels) -> None:
    with pytest.raises(ConfigError) as refused:
        check_draft_compatible(str(tiny.target), str(tiny.incompatible_draft))
    message = str(refused.value)
    assert "512 tokens" in message and "384 tokens" in message


def test_compatible_draft_passes(tiny: TinyModels) -> None:
    check_draft_compatible(str(tiny.target), str(tiny.close_draft))


def test_max_model_len_above_the_model_is_refused(tiny: TinyModels) -> None:
    with pytest.raises(ConfigError, match="2048"):
        check_max_model_len(str(tiny.target), 4096)
    check_max_model_len(str(tiny.target), 2048)


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--num-speculative-tokens", "0"], "at least 1"),
        (["--model", "/does/not/exist", "--no-speculation"], "does not exist"),
        (["--draft-model", "./missing-draft"], "does not exist"),
        (["--host", "0.0.0.0"], "refusing to serve 0.0.0.0 without --api-key-file"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags: list[str], words: str) -> None:
    result = _serve(*flags)
    assert result.returncode == 2
    assert words in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_model_pair_exits_2_before_loading(tiny: TinyModels, tmp_path: Path) -> None:
    result = _serve("--model", str(tiny.target), "--draft-model", str(tiny.incompatible_draft))
    assert result.returncode == 2
    assert "384 tokens" in result.stderr and "Traceback" not in result.stderr
    result = _serve("--model", str(tiny.target), "--no-speculation", "--max-model-len", "99999")
    assert result.returncode == 2
    assert "99999" in result.stderr and "Traceback" not in result.stderr


def test_a_taken_port_exits_2_naming_its_flag(tiny: TinyModels, tmp_path: Path) -> None:
    """A second server on a running one's API or metrics port stops before loading anything,
    with one line naming the flag, and the first keeps serving."""
    with serving(tiny, tmp_path) as first:
        api_port = urlsplit(first.base_url).port
        metrics_port = urlsplit(first.metrics_url).port
        assert api_port is not None and metrics_port is not None
        model = ["--model", str(tiny.target), "--no-speculation"]
        for flag, flags in (
            ("--metrics-port", ["--port", str(free_port()), "--metrics-port", str(metrics_port)]),
            ("--port", ["--port", str(api_port), "--metrics-port", str(free_port())]),
        ):
            result = _serve(*model, *flags)
            assert result.returncode == 2, result.stderr
            taken = api_port if flag == "--port" else metrics_port
            assert f"({flag} {taken}): Address already in use" in result.stderr
            assert "Traceback" not in result.stderr
            assert "loading" not in result.stderr.lower()
        assert httpx.get(f"{first.base_url}/ready").status_code == 200
