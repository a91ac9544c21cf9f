"""The bound on the grammar a JSON schema compiles to (server/engine/grammar.py), on the
installed llguidance: a schema over --max-grammar-symbols is a 400 naming it and the request
field, before vLLM builds the grammar; common schemas are far within it."""

from typing import Any

import llguidance
import pytest

from server.config import DEFAULT_MAX_GRAMMAR_SYMBOLS, Settings
from server.engine import grammar, resolve
from server.engine.contract import GenerationRequest, JsonFormat, SamplingOptions
from server.engine.vllm_engine import VllmEngine
from server.errors import InvalidRequestError

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
    },
    "required": ["name", "color"],
    "additionalProperties": False,
}


def products(branches: int) -> dict[str, Any]:
    """Four anyOfs of `branches` arrays under one allOf: 3 KB at 10, which llguidance expands
    into 10**4 arrays (70,000 symbols) before its own limit of 500,000."""
    return {
        "allOf": [
            {
                "anyOf": [
                    {"type": "array", "items": {"type": "integer", "minimum": 100 * i + j}}
                    for j in range(branches)
                ]
            }
            for i in range(4)
        ]
    }


def optional_properties(count: int) -> dict[str, Any]:
    properties = {f"field_{i}": {"type": "string"} for i in range(count)}
    return {"type": "object", "properties": properties}


@pytest.mark.parametrize(
    "schema",
    [ITEM, {"type": "array", "items": ITEM, "maxItems": 256}, optional_properties(2147)],
    ids=["item", "items", "64 KiB of properties"],
)
def test_common_schemas_are_within_the_default(schema: dict[str, Any]) -> None:
    grammar.check(JsonFormat(schema), DEFAULT_MAX_GRAMMAR_SYMBOLS)


def test_a_grammar_over_the_bound_is_a_400_naming_the_setting_and_the_field() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        grammar.check(JsonFormat(products(10), param="tools"), DEFAULT_MAX_GRAMMAR_SYMBOLS)
    assert refused.value.param == "tools"
    assert refused.value.message == (
        "the schema's grammar must have at most 50000 symbols (--max-grammar-symbols)"
    )
    grammar.check(JsonFormat(products(10)), 2 * DEFAULT_MAX_GRAMMAR_SYMBOLS)  # raised: admitted


def test_wherever_llguidance_trips_on_the_bound_it_is_the_same_400() -> None:
    array = {"type": "array", "items": {"type": "string"}, "maxItems": 1000}
    schema = {"type": "object", "properties": {"a": array}}
    bounds = range(1900, 2100)
    panics = 0
    compact = {"whitespace_flexible": not grammar.COMPACT_JSON}
    built = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
    for max_symbols in bounds:
        limits = llguidance.LLParserLimits(max_grammar_size=max_symbols)
        try:
            llguidance.LLMatcher.validate_grammar(built, None, limits=limits)
        except BaseException:
            panics += 1
    # Near some of these bounds the limit trips inside one of llguidance's builders, which
    # panics (pyo3's PanicException, no Exception) instead of returning its error. If none
    # does any more, grammar._build_error need not catch it.
    assert panics > 0
    outcomes = set()
    for max_symbols in bounds:
        try:
            grammar.check(JsonFormat(schema), max_symbols)
            outcomes.add("admitted")
        except InvalidRequestError as exc:
            assert "(--max-grammar-symbols)" in exc.message
            outcomes.add("refused")
    assert outcomes == {"admitted", "refused"}


def test_a_schema_llguidance_cannot_build_is_a_400_with_its_reason() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        grammar.check(JsonFormat({"type": "nonsense"}), DEFAULT_MAX_GRAMMAR_SYMBOLS)
    assert refused.value.param == "response_format"
    assert refused.value.message == "grammar error: Invalid type: nonsense"


def test_any_json_object_needs_no_check() -> None:
    grammar.check(JsonFormat(), 1)


def test_the_engine_checks_the_grammar_before_vllm_sees_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resolve, "has_gpu", lambda: False)
    settings = Settings(
        model="org/target", no_speculation=True, quantization="none", max_grammar_symbols=1000
    )
    engine = VllmEngine(resolve.resolve(settings))
    assert engine._config.max_grammar_symbols == 1000
    engine._llm = object()  # running, as far as the check goes: vLLM's own are never reached
    sampling = SamplingOptions(max_tokens=1, json_format=JsonFormat(optional_properties(200)))
    with pytest.raises(InvalidRequestError, match="at most 1000 symbols"):
        engine.validate(GenerationRequest("r", [1], sampling))
