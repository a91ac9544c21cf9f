"""The request limits (server/protocol/limits.py): each refused at its default with a 400 that
names the parameter and the flag, before any stream starts; each a setting that raises it."""

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
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


def test_the_defaults_are_the_limits_the_protocol_had_and_the_schema_bounds() -> None:
    assert dataclasses.asdict(DEFAULT_LIMITS) == {
        "max_n": 16,
        "max_logprobs": 20,
        "max_stop_sequences": 4,
        "max_stop_length": 256,
        "max_tools": 128,
        "max_logit_bias": 300,
        "max_completion_sequences": 64,
        "max_json_schema_bytes": 65536,
        "max_json_schema_depth": 32,
        "max_json_schema_items": 256,
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


def _nesting(depth: int) -> dict[str, Any]:
    """A schema whose objects and arrays nest `depth` deep: arrays of arrays of strings."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _weighing(size: int) -> dict[str, Any]:
    """A schema of `size` bytes as compact JSON."""
    empty = len(json.dumps({"type": "object", "description": ""}, separators=(",", ":")))
    return {"type": "object", "description": "x" * (size - empty)}


def _counting(items: int) -> dict[str, Any]:
    """A schema whose deepest array asks for `items` items at least, the others for fewer."""
    inner = {"type": "array", "items": {"type": "integer"}, "minItems": items}
    return {"type": "object", "properties": {"a": {"type": "array", "maxItems": 2}, "b": inner}}


def _chat_tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _responses_tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": parameters}


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    }


# Where a client's schema becomes a grammar: (endpoint, the fields that put it there, param).
SCHEMA_PLACES: dict[
    str, tuple[tuple[str, dict[str, Any]], Callable[[Any], dict[str, Any]], str]
] = {
    "chat response_format": (CHAT, _response_format, "response_format.json_schema.schema"),
    "completions response_format": (
        COMPLETIONS,
        _response_format,
        "response_format.json_schema.schema",
    ),
    "responses text.format": (
        RESPONSES,
        lambda schema: {"text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}},
        "text.format.schema",
    ),
    "chat named tool": (
        CHAT,
        lambda schema: {
            "tools": [_chat_tool("f", schema)],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools.0.function.parameters",
    ),
    "chat required tools": (
        CHAT,
        lambda schema: {
            "tools": [_chat_tool("f"), _chat_tool("g", schema)],
            "tool_choice": "required",
        },
        "tools.1.function.parameters",
    ),
    "responses named tool": (
        RESPONSES,
        lambda schema: {
            "tools": [_responses_tool("f", schema)],
            "tool_choice": {"type": "function", "name": "f"},
        },
        "tools.0.parameters",
    ),
    "responses required tools": (
        RESPONSES,
        lambda schema: {
            "tools": [_responses_tool("f"), _responses_tool("g", schema)],
            "tool_choice": "required",
        },
        "tools.1.parameters",
    ),
}
# (schema just over the default limit, the same at it, message)
SCHEMA_LIMITS = {
    "depth": (
        _nesting(33),
        _nesting(32),
        "must nest objects and arrays at most 32 levels deep (--max-json-schema-depth); got 33",
    ),
    "size": (
        _weighing(65537),
        _weighing(65536),
        "must be at most 65536 bytes as JSON (--max-json-schema-bytes); got 65537",
    ),
    "items": (
        _counting(257),
        _counting(256),
        "must bound arrays (minItems, maxItems) to at most 256 items "
        "(--max-json-schema-items); got 257",
    ),
}


@pytest.mark.parametrize("limit", SCHEMA_LIMITS)
@pytest.mark.parametrize("place", SCHEMA_PLACES)
async def test_a_schema_a_grammar_enforces_is_bounded_in_depth_size_and_items(
    client: httpx.AsyncClient, place: str, limit: str
) -> None:
    endpoint, fields, param = SCHEMA_PLACES[place]
    over, at, message = SCHEMA_LIMITS[limit]
    refused = await client.post(endpoint[0], json=_body(endpoint, stream=True, **fields(over)))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert f"{param} {message}" in error["message"]
    accepted = await client.post(endpoint[0], json=_body(endpoint, **fields(at)))
    assert accepted.status_code == 200, accepted.text


@pytest.mark.parametrize("limit", SCHEMA_LIMITS)
@pytest.mark.parametrize("place", SCHEMA_PLACES)
async def test_raised_schema_limits_admit_what_the_defaults_refuse(
    raised: httpx.AsyncClient, place: str, limit: str
) -> None:
    endpoint, fields, _ = SCHEMA_PLACES[place]
    over, _, _ = SCHEMA_LIMITS[limit]
    response = await raised.post(endpoint[0], json=_body(endpoint, **fields(over)))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        (CHAT, {"tools": [_chat_tool("f", _nesting(40))]}),
        (CHAT, {"tools": [_chat_tool("f", _nesting(40))], "tool_choice": "none"}),
        (
            CHAT,
            {
                "tools": [_chat_tool("f"), _chat_tool("g", _nesting(40))],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
        ),
        (RESPONSES, {"tools": [_responses_tool("f", _weighing(70000))]}),
        (
            RESPONSES,
            {
                "tools": [_responses_tool("f"), _responses_tool("g", _weighing(70000))],
                "tool_choice": {"type": "function", "name": "f"},
            },
        ),
    ],
)
async def test_tool_parameters_no_grammar_enforces_are_not_bounded(
    client: httpx.AsyncClient, endpoint: tuple[str, dict[str, Any]], fields: dict[str, Any]
) -> None:
    # Under auto (or none) the tools only reach the chat template, whose prompt the context
    # length bounds; under a named choice only that function's schema is compiled.
    response = await client.post(endpoint[0], json=_body(endpoint, **fields))
    assert response.status_code == 200, response.text
