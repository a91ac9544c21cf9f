"""The request limits (server/protocol/limits.py): each refused at its default with a 400 that
names the parameter and the flag, before any stream starts; each a setting that raises it."""

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from server.app import create_app
from server.cli import SERVE_FLAGS
from server.config import Settings
from server.protocol.limits import DEFAULT_LIMITS, RequestLimits
from tests.unit.scripted_engine import ScriptedEngine

USER = [{"role": "user", "content": "hi"}]
# Each endpoint's path and the rest of a body, a one-token reply.
COMPLETIONS = ("/v1/completions", {"prompt": "x", "max_tokens": 1})
CHAT = ("/v1/chat/completions", {"messages": USER, "max_tokens": 1})
RESPONSES = ("/v1/responses", {"input": "hi", "max_output_tokens": 1})


def _tools(count: int, responses: bool = False) -> list[dict[str, Any]]:
    if responses:
        return [{"type": "function", "name": f"f{i}"} for i in range(count)]
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


# (endpoint, the fields just over the default limit, the same at it, param, message)
LIMITS = [
    (COMPLETIONS, {"n": 17}, {"n": 16}, "n", "n must be at most 16 (--max-n); got 17"),
    (CHAT, {"n": 17}, {"n": 16}, "n", "n must be at most 16 (--max-n); got 17"),
    (
        COMPLETIONS,
        {"logprobs": 21},
        {"logprobs": 20},
        "logprobs",
        "logprobs must be at most 20 (--max-logprobs); got 21",
    ),
    (
        CHAT,
        {"logprobs": True, "top_logprobs": 21},
        {"logprobs": True, "top_logprobs": 20},
        "top_logprobs",
        "top_logprobs must be at most 20 (--max-logprobs); got 21",
    ),
    (
        COMPLETIONS,
        {"stop": ["a", "b", "c", "d", "e"]},
        {"stop": ["a", "b", "c", "d"]},
        "stop",
        "stop must have at most 4 sequences (--max-stop-sequences); got 5",
    ),
    (
        CHAT,
        {"stop": ["a", "x" * 257]},
        {"stop": ["a", "x" * 256]},
        "stop",
        "stop sequences must be at most 256 characters (--max-stop-length); got 257",
    ),
    (
        COMPLETIONS,
        {"stop": "x" * 257},
        {"stop": "x" * 256},
        "stop",
        "at most 256 characters (--max-stop-length)",
    ),
    (
        CHAT,
        {"tools": _tools(129)},
        {"tools": _tools(128)},
        "tools",
        "tools must have at most 128 tools (--max-tools); got 129",
    ),
    (
        RESPONSES,
        {"tools": _tools(129, responses=True)},
        {"tools": _tools(128, responses=True)},
        "tools",
        "tools must have at most 128 tools (--max-tools); got 129",
    ),
    (
        CHAT,
        {"logit_bias": {str(i): 1 for i in range(301)}},
        {"logit_bias": {str(i): 1 for i in range(300)}},
        "logit_bias",
        "logit_bias must have at most 300 entries (--max-logit-bias); got 301",
    ),
    (
        COMPLETIONS,
        {"prompt": ["p"] * 5, "n": 13},
        {"prompt": ["p"] * 4, "n": 16},
        "prompt",
        "prompts times n must be at most 64 (--max-completion-sequences); got 65",
    ),
]


LIMIT_IDS = [f"{path}:{param}" for (path, _), _, _, param, _ in LIMITS]


def _body(endpoint: tuple[str, dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "scripted", **endpoint[1], **fields}


@pytest.mark.parametrize(("endpoint", "over", "at", "param", "message"), LIMITS, ids=LIMIT_IDS)
async def test_each_limit_refuses_one_past_its_default_naming_the_parameter_and_flag(
    client: httpx.AsyncClient,
    endpoint: tuple[str, dict[str, Any]],
    over: dict[str, Any],
    at: dict[str, Any],
    param: str,
    message: str,
) -> None:
    refused = await client.post(endpoint[0], json=_body(endpoint, stream=True, **over))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"]
    accepted = await client.post(endpoint[0], json=_body(endpoint, **at))
    assert accepted.status_code == 200, accepted.text


async def test_a_limit_is_checked_before_the_model_and_on_the_render_routes(
    client: httpx.AsyncClient,
) -> None:
    # As when the limits were the models' constraints: a 400 for the body before a 404.
    refused = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x", "n": 17})
    assert refused.status_code == 400, refused.text
    rendered = await client.post("/v1/chat/completions/render", json=_body(CHAT, n=17))
    assert rendered.status_code == 400, rendered.text
    assert rendered.json()["error"]["param"] == "n"


@asynccontextmanager
async def _serving(
    engine: ScriptedEngine, limits: RequestLimits
) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(engine, request_limits=limits))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.fixture
async def raised(engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    """A server whose settings raise every limit well past its default."""
    limits = RequestLimits(
        **{name: 2 * value for name, value in dataclasses.asdict(DEFAULT_LIMITS).items()}
    )
    async with _serving(engine, limits) as client:
        yield client


@pytest.mark.parametrize(("endpoint", "over", "at", "param", "message"), LIMITS, ids=LIMIT_IDS)
async def test_a_raised_setting_admits_what_the_default_refuses(
    raised: httpx.AsyncClient,
    endpoint: tuple[str, dict[str, Any]],
    over: dict[str, Any],
    at: dict[str, Any],
    param: str,
    message: str,
) -> None:
    response = await raised.post(endpoint[0], json=_body(endpoint, **over))
    assert response.status_code == 200, response.text


async def test_a_raised_max_n_reaches_the_engine(
    raised: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    response = await raised.post(CHAT[0], json=_body(CHAT, n=32))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 32
    assert engine.requests[-1].sampling.n == 32


async def test_a_lowered_setting_refuses_what_the_default_admits(engine: ScriptedEngine) -> None:
    limits = dataclasses.replace(DEFAULT_LIMITS, max_logit_bias=0)
    async with _serving(engine, limits) as client:
        response = await client.post(
            "/v1/completions", json=_body(COMPLETIONS, logit_bias={"5": 1})
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias"
    assert "at most 0 entries (--max-logit-bias)" in error["message"]


def test_the_defaults_are_the_limits_the_protocol_always_had() -> None:
    assert dataclasses.asdict(DEFAULT_LIMITS) == {
        "max_n": 16,
        "max_logprobs": 20,
        "max_stop_sequences": 4,
        "max_stop_length": 256,
        "max_tools": 128,
        "max_logit_bias": 300,
        "max_completion_sequences": 64,
    }


def test_each_limit_is_a_setting_and_a_flag_of_serve() -> None:
    flags = {flag for flag, _ in SERVE_FLAGS}
    for field in dataclasses.fields(RequestLimits):
        assert Settings.model_fields[field.name].default == field.default
        assert "--" + field.name.replace("_", "-") in flags
    assert Settings().request_limits == DEFAULT_LIMITS


def test_the_command_line_sets_the_limits() -> None:
    from server.cli import _parser

    args = vars(_parser().parse_args(["serve", "--max-n", "32", "--max-tools", "0"]))
    args.pop("command")
    limits = Settings(**args).request_limits
    assert (limits.max_n, limits.max_tools, limits.max_logprobs) == (32, 0, 20)
