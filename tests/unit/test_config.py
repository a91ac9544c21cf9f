"""Settings validation and the speculation schedule, without an engine."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.config import ConfigError, Settings
from server.engine.resolve import resolve
from server.engine.runtime import cpu_binding
from server.engine.vllm_engine import speculation_schedule
from server.vllm_plugins import patching


def test_defaults_use_the_embedded_pair_with_speculation() -> None:
    settings = Settings()
    assert settings.uses_embedded_pair
    assert settings.speculative_method == "hybrid"
    assert not settings.no_speculation


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_PORT", "9000")
    monkeypatch.setenv("SPECSERVE_NUM_SPECULATIVE_TOKENS", "5")
    settings = Settings()
    assert (settings.port, settings.num_speculative_tokens) == (9000, 5)
    assert Settings(port=9100).port == 9100  # flags (init values) win


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"num_speculative_tokens": 0}, "at least 1"),
        ({"model": "/no/such/folder", "no_speculation": True}, "does not exist"),
        ({"model": "org/name"}, "needs --draft-model"),
        ({"draft_model": "org/draft", "speculative_method": "ngram"}, "choose one"),
        ({"dtype": "int8"}, "dtype"),
        ({"speculation_trace": "."}, "is a folder"),
    ],
)
def test_unsafe_settings_are_refused(values: dict, words: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(**values)
    assert words in str(refused.value)


def test_hub_ids_are_not_mistaken_for_folders() -> None:
    settings = Settings(model="Qwen/Qwen2.5-Coder-1.5B-Instruct", speculative_method="ngram")
    assert settings.model == "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def test_schedule_switches_speculation_off_above_the_cut_off() -> None:
    assert speculation_schedule(3, 1, 16) == [[1, 1, 3], [2, 16, 0]]
    assert speculation_schedule(4, 16, 16) == [[1, 16, 4]]
    assert speculation_schedule(4, 64, 16) == [[1, 16, 4]]


def test_an_unknown_tool_call_parser_is_refused_before_any_model_loads() -> None:
    with pytest.raises(ConfigError, match="unknown tool call parser 'nope'"):
        resolve(Settings(tool_call_parser="nope"))


@pytest.mark.parametrize(
    ("host", "refused"),
    [
        ("127.0.0.1", False),
        ("127.0.0.2", False),
        ("::1", False),
        ("localhost", False),
        ("0.0.0.0", True),
        ("::", True),
        ("10.1.2.3", True),
        ("specserve.internal", True),  # a name may resolve to any interface
    ],
)
def test_open_access_is_refused_beyond_loopback(host: str, refused: bool, tmp_path: Path) -> None:
    assert Settings(host=host).open_access_refused is refused
    assert not Settings(host=host, allow_unauthenticated=True).open_access_refused
    key_file = tmp_path / "keys.json"
    key_file.write_text('{"keys": [{"key": "k", "tenant": "t"}]}')
    assert not Settings(host=host, api_key_file=key_file).open_access_refused


def test_the_default_host_is_loopback() -> None:
    assert Settings().host == "127.0.0.1"
    assert not Settings().open_access_refused


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"tensor_parallel_size": 3}, r"3 ranks \(tensor x pipeline parallel\) need a CPU core"),
        ({"pipeline_parallel_size": 2, "no_speculation": True}, "does not run on CPUs"),
        ({"pipeline_parallel_size": 2}, "cannot run a draft model"),
        ({"distributed_executor_backend": "ray"}, "GPUs only"),
    ],
)
def test_ranks_this_machine_cannot_run_are_refused_before_any_model_loads(
    values: dict, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("server.engine.resolve.has_gpu", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(ConfigError, match=words):
        resolve(Settings(**values))


def test_cpu_ranks_share_the_cores_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 0, 1, 2, 3})
    assert cpu_binding(1) == "0,1,2,3,4"
    assert cpu_binding(2) == "0,1,2|3,4"
    assert cpu_binding(5) == "0|1|2|3|4"


def test_the_engines_settings_for_vllm_are_not_read_as_specserve_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An in-process engine sets them, and servers started from that process inherit them
    # (an engine-set trace variable read as the setting once made "" the current folder).
    settings = {"patches": [], "autopilot": {"trace": None, "mode": "fixed"}}
    monkeypatch.setenv(patching.SETTINGS_ENV, json.dumps(settings))
    assert Settings().speculation_trace is None
    assert Settings().speculation == "auto"


def test_every_setting_is_a_flag_of_serve() -> None:
    from server.cli import SERVE_FLAGS, _parser

    flags = {flag.removeprefix("--").replace("-", "_") for flag, _ in SERVE_FLAGS}
    assert set(Settings.model_fields) <= flags, sorted(set(Settings.model_fields) - flags)
    argv = ["serve", "--max-connections", "7", "--body-read-timeout-seconds", "2.5"]
    args = vars(_parser().parse_args(argv))
    args.pop("command")
    settings = Settings(**args)
    assert (settings.max_connections, settings.body_read_timeout_seconds) == (7, 2.5)
