"""POST /v1/responses on the real engine, through the official client.

The tiny models are random: schemas bound every structured reply (an enum, a
boolean) so the grammar, not the model, ends it, and calls go through a named
tool_choice (the tiny models never choose a tool themselves; `auto` with a model
that does runs in tests/e2e).
"""

import json

import jsonschema
import pytest

from tests.integration.conftest import RunningServer
from tests.integration.test_openai_client import client_for

pytestmark = pytest.mark.integration

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "boolean"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": CITY}


async def test_streamed_text_reassembles_to_the_greedy_response(spec_server: RunningServer) -> None:
    client = client_for(spec_server)
    request = {
        "model": "tiny",
        "instructions": "Continue the text.",
        "input": "The quick brown fox",
        "max_output_tokens": 24,
        "temperature": 0,
    }
    whole = await client.responses.create(**request)  # type: ignore[call-overload]
    assert whole.id.startswith("resp_") and whole.status in ("completed", "incomplete")
    assert whole.output_text
    assert whole.usage is not None and 0 < whole.usage.output_tokens <= 24
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    speculation = (whole.model_extra or {})["speculation"]
    assert speculation["method"] == "draft_model" and speculation["draft_tokens"] > 0

    stream = await client.responses.create(**request, stream=True)  # type: ignore[call-overload]
    events = [event async for event in stream]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    assert events[-1].type == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_json_schema_text_format_is_followed(spec_server: RunningServer) -> None:
    text_format = {"type": "json_schema", "name": "forecast", "schema": CITY, "strict": True}
    result = await client_for(spec_server).responses.create(
        model="tiny",
        input="Pick a city as JSON.",
        text={"format": text_format},  # type: ignore[typeddict-item]
        max_output_tokens=64,
        temperature=0,
    )
    assert result.status == "completed", result.output_text
    jsonschema.validate(json.loads(result.output_text), CITY)


async def test_a_named_function_call_round_trip(spec_server: RunningServer) -> None:
    client = client_for(spec_server)
    request = {
        "model": "tiny",
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 64,
        "temperature": 0,
    }
    whole = await client.responses.create(**request)  # type: ignore[call-overload]
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)

    async with client.responses.stream(**request) as stream:
        deltas = [
            e.delta async for e in stream if e.type == "response.function_call_arguments.delta"
        ]
        streamed = await stream.get_final_response()
    assert "".join(deltas) == call.arguments
    assert [(c.type, c.arguments) for c in streamed.output] == [("function_call", call.arguments)]

    # The call goes back as it came, followed by its result; the reply is text.
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": '{"forecast": "sunny"}',
        },
    ]
    answer = await client.responses.create(
        model="tiny",
        input=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=8,
        temperature=0,
    )
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text
