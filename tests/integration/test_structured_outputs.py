"""Structured outputs and fill in the middle on the real engine, through the official client.

The tiny models are random, so the schemas bound every reply (an enum, a short string, a
boolean): the grammar, not the model, decides when the JSON is complete.
"""

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import RunningServer
from tests.integration.test_openai_client import client_for

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "color", "ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "item", "schema": SCHEMA, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Describe one item as JSON."}]


class Item(BaseModel):
    name: str = Field(max_length=12)
    color: Literal["red", "green", "blue"]
    ok: bool


async def test_a_json_schema_reply_matches_it_streamed_and_not(
    self_draft_server: RunningServer,
) -> None:
    # The target drafting for itself: where the grammar allows its own best token, the
    # draft's guess is the target's, so drafts are verified under the grammar and accepted.
    client = client_for(self_draft_server)
    request = {
        "model": "tiny-self",
        "messages": MESSAGES,
        "response_format": RESPONSE_FORMAT,
        "max_tokens": 64,
        "temperature": 0,
    }
    whole = await client.chat.completions.create(**request)  # type: ignore[call-overload]
    content = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content or ""), SCHEMA)
    speculation = (whole.model_extra or {})["speculation"]
    assert speculation["accepted_tokens"] > 0, speculation

    stream = await client.chat.completions.create(**request, stream=True)  # type: ignore[call-overload]
    parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(parts) == content


async def test_parse_returns_a_pydantic_object(spec_server: RunningServer) -> None:
    result = await client_for(spec_server).chat.completions.parse(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=Item,
        max_tokens=64,
        temperature=0,
    )
    assert isinstance(result.choices[0].message.parsed, Item)


async def test_completions_take_a_schema_too(spec_server: RunningServer) -> None:
    result = await client_for(spec_server).completions.create(
        model="tiny",
        prompt="item = ",
        max_tokens=64,
        temperature=0,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    assert result.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(result.choices[0].text), SCHEMA)


async def test_greedy_output_under_a_grammar_is_the_same_with_speculation_on_and_off(
    spec_server: RunningServer, plain_server: RunningServer
) -> None:
    replies = []
    for server in (spec_server, plain_server):
        result = await client_for(server).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Another item, please."}],
            response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
            max_tokens=64,
            temperature=0,
        )
        replies.append(result.choices[0].message.content)
    assert replies[0] == replies[1]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_schema_the_grammar_cannot_take_is_400_before_any_stream(
    spec_server: RunningServer, stream: bool
) -> None:
    broken = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        await client_for(spec_server).chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=broken,  # type: ignore[arg-type]
            max_tokens=8,
            stream=stream,
        )
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]


# Within the size and depth bounds, but llguidance expands it to 10**4 arrays, 70,000 symbols.
PRODUCTS = {
    "allOf": [
        {
            "anyOf": [
                {"type": "array", "items": {"type": "integer", "minimum": 100 * i + j}}
                for j in range(10)
            ]
        }
        for i in range(4)
    ]
}
# 60 bytes that would have llguidance write out 10**8 array positions: memory exhausted.
HUGE_ARRAY = {"type": "array", "items": {"type": "integer"}, "minItems": 10**8}


@pytest.mark.parametrize(
    ("schema", "param", "bound"),
    [
        (PRODUCTS, "response_format", "(--max-grammar-symbols)"),
        (HUGE_ARRAY, "response_format.json_schema.schema", "(--max-json-schema-items)"),
    ],
    ids=["grammar symbols", "array items"],
)
async def test_a_schema_over_a_grammar_bound_is_400_and_structured_outputs_go_on(
    spec_server: RunningServer, schema: dict[str, object], param: str, bound: str
) -> None:
    client = client_for(spec_server)
    refused = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=refused,  # type: ignore[arg-type]
            max_tokens=8,
        )
    assert caught.value.body["param"] == param  # type: ignore[index]
    assert bound in caught.value.message
    served = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        max_tokens=64,
        temperature=0,
    )
    assert served.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(served.choices[0].message.content or ""), SCHEMA)


async def test_suffix_on_a_model_without_fill_in_the_middle_tokens_is_400(
    spec_server: RunningServer,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client_for(spec_server).completions.create(
            model="tiny", prompt="def f(", suffix="):\n    pass\n", max_tokens=8
        )
    assert caught.value.body["param"] == "suffix"  # type: ignore[index]
    assert "fill-in-the-middle" in caught.value.message
